"""RoPE (in place, theta-based, NeoX style): flashkern beside torch, torch.compile, FlashInfer and Liger."""

import pytest

from . import cases
from .cases import params
from .harness import bench_op


@pytest.mark.benchmark(group="rope")
@pytest.mark.parametrize("provider,label,tokens,heads,dtype", params(cases.ROPE, cases.rope_shapes()))
def test_rope(benchmark, provider, label, tokens, heads, dtype):
    bench_op(benchmark, op="rope", provider=provider, shape=(tokens, *heads), dtype=dtype,
             bytes_moved=cases.rope_bytes(tokens, heads, dtype), make_inputs=cases.rope_inputs(tokens, heads, dtype))
