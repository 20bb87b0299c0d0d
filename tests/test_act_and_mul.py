"""silu_and_mul, gelu_and_mul, gelu_tanh_and_mul and their backward against the float64 reference."""

import pytest
import torch
from conftest import FLOAT_DTYPES, GPU, assert_close, poisoned, rand

import flashkern
from flashkern import ref

ACTIVATIONS = ["silu", "gelu", "gelu_tanh"]
D = [1, 7, 111, 769, 4096, 5125, 14336]
TOKENS = [1, 37, 989]
CPU_MAX_ELEMENTS = 2**20  # float64 reference on the CPU: larger sizes run on a GPU only
SIZES = [(t, d) for t in TOKENS for d in D if t * d <= (2**26 if GPU else CPU_MAX_ELEMENTS)]


def fn(name):
    return getattr(flashkern, f"{name}_and_mul")


@pytest.mark.parametrize("tokens,d", SIZES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_act_and_mul(device, tokens, d, dtype, act):
    if device == "cpu" and tokens * d > CPU_MAX_ELEMENTS:
        pytest.skip("float64 reference on the CPU: GPU-only size")
    x = rand((tokens, 2 * d), dtype, device, scale=3.0, seed=1)
    y = fn(act)(x)
    assert y.shape == (tokens, d) and y.dtype == dtype
    assert_close(y, ref.act_and_mul(x.double(), act), dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_act_and_mul_out_strided_and_poisoned(device, dtype, act):
    xb = rand((37, 2 * 769 + 16), dtype, device, seed=2)
    x = xb[:, 8 : 8 + 2 * 769]
    out_base = poisoned((37, 800), dtype, device)
    out = out_base[:, :769]
    assert fn(act)(x, out=out) is out
    assert_close(out, ref.act_and_mul(x.double(), act), dtype)
    assert out_base[:, 769:].isnan().all(), "wrote outside the out view"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_act_and_mul_any_rank_and_layout(device, dtype):
    x1 = rand((2 * 4096,), dtype, device, seed=3)  # one token, no batch dimension
    assert_close(flashkern.silu_and_mul(x1), ref.act_and_mul(x1.double(), "silu"), dtype)
    x3 = rand((3, 5, 2 * 111), dtype, device, seed=4)
    assert_close(flashkern.silu_and_mul(x3), ref.act_and_mul(x3.double(), "silu"), dtype)
    # leading dimensions that no two strides describe: handled through a contiguous copy
    x4 = rand((4, 3, 5, 2 * 64), dtype, device, seed=5).permute(2, 0, 1, 3)
    assert_close(flashkern.gelu_and_mul(x4), ref.act_and_mul(x4.double(), "gelu"), dtype)
    out4 = poisoned((4, 5, 3, 64), dtype, device).permute(1, 0, 2, 3)
    flashkern.silu_and_mul(x4, out=out4)
    assert_close(out4, ref.act_and_mul(x4.double(), "silu"), dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_act_and_mul_misaligned(device, dtype):
    flat = rand((1 + 37 * 2 * 4096,), dtype, device, seed=6)
    x = flat[1:].view(37, 2 * 4096)
    assert_close(flashkern.silu_and_mul(x), ref.act_and_mul(x.double(), "silu"), dtype)


def test_act_and_mul_extreme_inputs(device):
    """Large |x| must not overflow into NaN (silu(-100) = -0, silu(100) = 100)."""
    x = torch.tensor([[-100.0, -20.0, 0.0, 20.0, 100.0] + [1.0] * 5], device=device)
    for act in ACTIVATIONS:
        y = fn(act)(x)
        assert torch.isfinite(y).all()
        assert_close(y, ref.act_and_mul(x.double(), act))


def test_empty(device):
    x = torch.empty((0, 16), device=device)
    assert flashkern.silu_and_mul(x).shape == (0, 8)


@pytest.mark.parametrize("tokens,d", [(1, 1), (37, 7), (37, 769), (989, 4096)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_act_and_mul_backward(device, tokens, d, dtype, act):
    x = rand((tokens, 2 * d), dtype, device, scale=2.0, seed=7).requires_grad_()
    dy = rand((tokens, d), dtype, device, seed=8)
    fn(act)(x).backward(dy)
    assert_close(x.grad, ref.act_and_mul_backward(dy.double(), x.detach().double(), act), dtype)


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_act_and_mul_gradcheck_float64(act):
    x = rand((5, 2 * 13), torch.float64, "cpu", seed=9).requires_grad_()
    assert torch.autograd.gradcheck(fn(act), (x,))


@pytest.mark.parametrize("tokens,d", [(1, 1), (37, 769), (989, 4096)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_act_mul_two_tensors(device, tokens, d, dtype, act):
    """act_mul(gate, up) is act_and_mul(cat([gate, up])) without the concatenation; and its backward."""
    gate = rand((tokens, d), dtype, device, scale=2.0, seed=10).requires_grad_()
    up = rand((tokens, d), dtype, device, seed=11).requires_grad_()
    y = flashkern.act_mul(gate, up, act)
    x = torch.cat([gate.detach(), up.detach()], dim=-1).double()
    assert_close(y, ref.act_and_mul(x, act), dtype)
    dy = rand((tokens, d), dtype, device, seed=12)
    y.backward(dy)
    expected = ref.act_and_mul_backward(dy.double(), x, act)
    assert_close(gate.grad, expected[:, :d], dtype)
    assert_close(up.grad, expected[:, d:], dtype)


def test_act_mul_strided_and_bad_input(device):
    base = rand((37, 3 * 64), torch.bfloat16, device, seed=13)
    gate, up = base[:, :64], base[:, 128:]  # halves of a wider projection output
    assert_close(flashkern.act_mul(gate, up), ref.act_mul(gate.double(), up.double()), torch.bfloat16)
    with pytest.raises(ValueError, match=r"up must have the shape of gate"):
        flashkern.act_mul(gate, up[:, :32])
    with pytest.raises(TypeError, match=r"up must have the dtype of gate"):
        flashkern.act_mul(gate, up.float())
    with pytest.raises(ValueError, match=r"activation must be 'silu', 'gelu' or 'gelu_tanh', got 'relu'"):
        flashkern.act_mul(gate, up, "relu")


def test_act_mul_gradcheck_float64():
    gate = rand((5, 7), torch.float64, "cpu", seed=14).requires_grad_()
    up = rand((5, 7), torch.float64, "cpu", seed=15).requires_grad_()
    for act in ACTIVATIONS:
        assert torch.autograd.gradcheck(lambda a, b: flashkern.act_mul(a, b, act), (gate, up))


@pytest.mark.parametrize("name", ["silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"])
def test_flashinfer_calling_conventions(device, name):
    """FlashInfer's signature (input, out=None, enable_pdl=None): enable_pdl is accepted and, with no
    programmatic dependent launch in flashkern yet, changes nothing."""
    fn = getattr(flashkern, name)
    x = rand((3, 2 * 40), torch.float16, device, seed=40)
    expected = fn(x)
    for enable_pdl in (None, True, False):
        out = torch.empty(3, 40, dtype=torch.float16, device=device)
        assert fn(x, out, enable_pdl) is out and torch.equal(out, expected)
        assert torch.equal(fn(x, enable_pdl=enable_pdl), expected)
    with pytest.raises(TypeError, match=f"{name}: enable_pdl must be None or a bool"):
        fn(x, enable_pdl=1)
