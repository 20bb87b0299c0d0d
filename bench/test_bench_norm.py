"""rmsnorm, gemma_rmsnorm, fused_add_rmsnorm and the rmsnorm backward: flashkern beside torch,
torch.compile and the peers."""

import pytest

from . import cases
from .cases import params
from .harness import bench_op

ARGS = "provider,label,tokens,hidden,dtype"


@pytest.mark.benchmark(group="rmsnorm")
@pytest.mark.parametrize(ARGS, params(cases.RMSNORM, cases.model_shapes(cases.HIDDEN)))
def test_rmsnorm(benchmark, provider, label, tokens, hidden, dtype):
    bench_op(benchmark, op="rmsnorm", provider=provider, shape=(tokens, hidden), dtype=dtype,
             bytes_moved=cases.rmsnorm_bytes(tokens, hidden, dtype), make_inputs=cases.rmsnorm_inputs(tokens, hidden, dtype))


@pytest.mark.benchmark(group="rmsnorm-sweep")
@pytest.mark.parametrize(ARGS, params(cases.RMSNORM[:3], cases.sweep_shapes(4096)))
def test_rmsnorm_sweep(benchmark, provider, label, tokens, hidden, dtype):
    test_rmsnorm(benchmark, provider, label, tokens, hidden, dtype)


@pytest.mark.benchmark(group="gemma_rmsnorm")
@pytest.mark.parametrize(ARGS, params(cases.GEMMA_RMSNORM, cases.variant_shapes(cases.HIDDEN)))
def test_gemma_rmsnorm(benchmark, provider, label, tokens, hidden, dtype):
    bench_op(benchmark, op="gemma_rmsnorm", provider=provider, shape=(tokens, hidden), dtype=dtype,
             bytes_moved=cases.rmsnorm_bytes(tokens, hidden, dtype), make_inputs=cases.rmsnorm_inputs(tokens, hidden, dtype))


@pytest.mark.benchmark(group="fused_add_rmsnorm")
@pytest.mark.parametrize(ARGS, params(cases.FUSED_ADD_RMSNORM, cases.model_shapes(cases.HIDDEN)))
def test_fused_add_rmsnorm(benchmark, provider, label, tokens, hidden, dtype):
    bench_op(benchmark, op="fused_add_rmsnorm", provider=provider, shape=(tokens, hidden), dtype=dtype,
             bytes_moved=cases.fused_add_rmsnorm_bytes(tokens, hidden, dtype),
             make_inputs=cases.fused_add_rmsnorm_inputs(tokens, hidden, dtype))


@pytest.mark.benchmark(group="rmsnorm_backward")
@pytest.mark.parametrize(ARGS, params(cases.RMSNORM_BACKWARD, cases.model_shapes(cases.HIDDEN)))
def test_rmsnorm_backward(benchmark, provider, label, tokens, hidden, dtype):
    bench_op(benchmark, op="rmsnorm_backward", provider=provider, shape=(tokens, hidden), dtype=dtype,
             bytes_moved=cases.rmsnorm_backward_bytes(tokens, hidden, dtype),
             make_inputs=cases.rmsnorm_backward_inputs(tokens, hidden, dtype))
