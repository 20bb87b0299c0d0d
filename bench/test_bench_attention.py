"""merge_states (the split-KV / cascade merge): flashkern beside torch, torch.compile and FlashInfer."""

import pytest

from . import cases
from .cases import params
from .harness import bench_op


@pytest.mark.benchmark(group="merge_states")
@pytest.mark.parametrize("provider,label,tokens,shape,dtype", params(cases.MERGE_STATES, cases.merge_shapes()))
def test_merge_states(benchmark, provider, label, tokens, shape, dtype):
    bench_op(benchmark, op="merge_states", provider=provider, shape=(tokens, *shape), dtype=dtype,
             bytes_moved=cases.merge_bytes(tokens, shape, dtype), make_inputs=cases.merge_inputs(tokens, shape, dtype))
