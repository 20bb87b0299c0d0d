"""rmsnorm, fused_add_rmsnorm and the rmsnorm backward: flashkern beside torch, torch.compile and the peers."""

import pytest

from . import cases
from .harness import bench_op


def _params(providers, shapes):
    return [
        pytest.param(p, label, t, size, dtype, id=f"{p.name}-{label.replace(' ', '-')}-{size}-{str(dtype)[6:]}")
        for label, t, size in shapes
        for dtype in cases.DTYPES
        for p in providers
    ]


@pytest.mark.benchmark(group="rmsnorm")
@pytest.mark.parametrize("provider,label,tokens,hidden,dtype", _params(cases.RMSNORM, cases.model_shapes(cases.HIDDEN)))
def test_rmsnorm(benchmark, provider, label, tokens, hidden, dtype):
    bench_op(benchmark, op="rmsnorm", provider=provider, shape=(tokens, hidden), dtype=dtype,
             bytes_moved=cases.rmsnorm_bytes(tokens, hidden, dtype), make_inputs=cases.rmsnorm_inputs(tokens, hidden, dtype))


@pytest.mark.benchmark(group="rmsnorm-sweep")
@pytest.mark.parametrize("provider,label,tokens,hidden,dtype", _params(cases.RMSNORM[:3], cases.sweep_shapes(4096)))
def test_rmsnorm_sweep(benchmark, provider, label, tokens, hidden, dtype):
    bench_op(benchmark, op="rmsnorm", provider=provider, shape=(tokens, hidden), dtype=dtype,
             bytes_moved=cases.rmsnorm_bytes(tokens, hidden, dtype), make_inputs=cases.rmsnorm_inputs(tokens, hidden, dtype))


@pytest.mark.benchmark(group="fused_add_rmsnorm")
@pytest.mark.parametrize(
    "provider,label,tokens,hidden,dtype", _params(cases.FUSED_ADD_RMSNORM, cases.model_shapes(cases.HIDDEN))
)
def test_fused_add_rmsnorm(benchmark, provider, label, tokens, hidden, dtype):
    bench_op(benchmark, op="fused_add_rmsnorm", provider=provider, shape=(tokens, hidden), dtype=dtype,
             bytes_moved=cases.fused_add_rmsnorm_bytes(tokens, hidden, dtype),
             make_inputs=cases.fused_add_rmsnorm_inputs(tokens, hidden, dtype))


@pytest.mark.benchmark(group="rmsnorm_backward")
@pytest.mark.parametrize(
    "provider,label,tokens,hidden,dtype", _params(cases.RMSNORM_BACKWARD, cases.model_shapes(cases.HIDDEN))
)
def test_rmsnorm_backward(benchmark, provider, label, tokens, hidden, dtype):
    bench_op(benchmark, op="rmsnorm_backward", provider=provider, shape=(tokens, hidden), dtype=dtype,
             bytes_moved=cases.rmsnorm_backward_bytes(tokens, hidden, dtype),
             make_inputs=cases.rmsnorm_backward_inputs(tokens, hidden, dtype))
