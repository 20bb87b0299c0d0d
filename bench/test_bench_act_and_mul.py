"""silu_and_mul (SwiGLU), gelu_and_mul, gelu_tanh_and_mul and the SwiGLU backward: flashkern beside
torch, torch.compile and the peers."""

import pytest

from . import cases
from .cases import params
from .harness import bench_op

ARGS = "provider,label,tokens,d,dtype"


def _bench(benchmark, act, provider, tokens, d, dtype):
    bench_op(benchmark, op=f"{act}_and_mul", provider=provider, shape=(tokens, 2 * d), dtype=dtype,
             bytes_moved=cases.silu_and_mul_bytes(tokens, d, dtype), make_inputs=cases.silu_and_mul_inputs(tokens, d, dtype))


@pytest.mark.benchmark(group="silu_and_mul")
@pytest.mark.parametrize(ARGS, params(cases.SILU_AND_MUL, cases.model_shapes(cases.INTERMEDIATE)))
def test_silu_and_mul(benchmark, provider, label, tokens, d, dtype):
    _bench(benchmark, "silu", provider, tokens, d, dtype)


@pytest.mark.benchmark(group="silu_and_mul-sweep")
@pytest.mark.parametrize(ARGS, params(cases.SILU_AND_MUL[:3], cases.sweep_shapes(14336)))
def test_silu_and_mul_sweep(benchmark, provider, label, tokens, d, dtype):
    _bench(benchmark, "silu", provider, tokens, d, dtype)


@pytest.mark.benchmark(group="gelu_and_mul")
@pytest.mark.parametrize(
    "act," + ARGS,
    [p for act in ("gelu", "gelu_tanh")
     for p in params(cases.act_and_mul_providers(act), cases.variant_shapes(cases.INTERMEDIATE), act)],
)
def test_gelu_and_mul(benchmark, act, provider, label, tokens, d, dtype):
    _bench(benchmark, act, provider, tokens, d, dtype)


@pytest.mark.benchmark(group="silu_and_mul_backward")
@pytest.mark.parametrize(ARGS, params(cases.SILU_AND_MUL_BACKWARD, cases.model_shapes(cases.INTERMEDIATE)))
def test_silu_and_mul_backward(benchmark, provider, label, tokens, d, dtype):
    bench_op(benchmark, op="silu_and_mul_backward", provider=provider, shape=(tokens, 2 * d), dtype=dtype,
             bytes_moved=cases.silu_and_mul_backward_bytes(tokens, d, dtype),
             make_inputs=cases.silu_and_mul_backward_inputs(tokens, d, dtype))
