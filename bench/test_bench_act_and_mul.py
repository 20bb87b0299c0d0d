"""silu_and_mul (SwiGLU) and its backward: flashkern beside torch, torch.compile and the peers."""

import pytest

from . import cases
from .harness import bench_op
from .test_bench_norm import _params


@pytest.mark.benchmark(group="silu_and_mul")
@pytest.mark.parametrize("provider,label,tokens,d,dtype", _params(cases.SILU_AND_MUL, cases.model_shapes(cases.INTERMEDIATE)))
def test_silu_and_mul(benchmark, provider, label, tokens, d, dtype):
    bench_op(benchmark, op="silu_and_mul", provider=provider, shape=(tokens, 2 * d), dtype=dtype,
             bytes_moved=cases.silu_and_mul_bytes(tokens, d, dtype), make_inputs=cases.silu_and_mul_inputs(tokens, d, dtype))


@pytest.mark.benchmark(group="silu_and_mul-sweep")
@pytest.mark.parametrize("provider,label,tokens,d,dtype", _params(cases.SILU_AND_MUL[:3], cases.sweep_shapes(14336)))
def test_silu_and_mul_sweep(benchmark, provider, label, tokens, d, dtype):
    bench_op(benchmark, op="silu_and_mul", provider=provider, shape=(tokens, 2 * d), dtype=dtype,
             bytes_moved=cases.silu_and_mul_bytes(tokens, d, dtype), make_inputs=cases.silu_and_mul_inputs(tokens, d, dtype))


@pytest.mark.benchmark(group="silu_and_mul_backward")
@pytest.mark.parametrize(
    "provider,label,tokens,d,dtype", _params(cases.SILU_AND_MUL_BACKWARD, cases.model_shapes(cases.INTERMEDIATE))
)
def test_silu_and_mul_backward(benchmark, provider, label, tokens, d, dtype):
    bench_op(benchmark, op="silu_and_mul_backward", provider=provider, shape=(tokens, 2 * d), dtype=dtype,
             bytes_moved=cases.silu_and_mul_backward_bytes(tokens, d, dtype),
             make_inputs=cases.silu_and_mul_backward_inputs(tokens, d, dtype))
