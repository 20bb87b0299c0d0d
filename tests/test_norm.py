"""rmsnorm, gemma_rmsnorm, fused_add_rmsnorm, gemma_fused_add_rmsnorm and the rmsnorm backward
against the float64 reference."""

import pytest
import torch
from conftest import FLOAT_DTYPES, GPU, assert_close, poisoned, rand

import flashkern
from flashkern import ref

HIDDEN = [1, 7, 111, 769, 4096, 5125, 16384, 65536]
TOKENS = [1, 37, 989]
# Every (tokens, hidden) pair on a GPU; the CPU reference in float64 is slow on the biggest ones.
CPU_MAX_ELEMENTS = 2**22
SIZES = [(t, h) for t in TOKENS for h in HIDDEN if t * h <= (2**26 if GPU else CPU_MAX_ELEMENTS)]


def _skip_large_on_cpu(device, numel):
    if device == "cpu" and numel > CPU_MAX_ELEMENTS:
        pytest.skip("float64 reference on the CPU: GPU-only size")


@pytest.mark.parametrize("tokens,hidden", SIZES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("weight_fp32", [False, True])
def test_rmsnorm(device, tokens, hidden, dtype, weight_fp32):
    _skip_large_on_cpu(device, tokens * hidden)
    x = rand((tokens, hidden), dtype, device, seed=1)
    w = rand((hidden,), torch.float32 if weight_fp32 else dtype, device, seed=2)
    y = flashkern.rmsnorm(x, w, eps=1e-6)
    assert y.dtype == dtype and y.shape == x.shape and y.device == x.device
    assert_close(y, ref.rmsnorm(x.double(), w.double(), 1e-6), dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_gemma_rmsnorm(device, dtype):
    x, w = rand((37, 769), dtype, device, seed=3), rand((769,), dtype, device, seed=4)
    assert_close(flashkern.gemma_rmsnorm(x, w, eps=1e-5), ref.rmsnorm(x.double(), w.double(), 1e-5, 1.0), dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rmsnorm_out_is_fully_written(device, dtype):
    x, w = rand((37, 5125), dtype, device, seed=5), rand((5125,), dtype, device, seed=6)
    out = poisoned((37, 5125), dtype, device)
    assert flashkern.rmsnorm(x, w, out=out) is out
    assert_close(out, ref.rmsnorm(x.double(), w.double(), 1e-6), dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rmsnorm_strided_rows_and_output(device, dtype):
    base = rand((37, 4096 + 24), dtype, device, seed=7)
    x = base[:, 8 : 8 + 4096]  # rows 4120 apart, starting 8 elements in
    out_base = poisoned((37, 5000), dtype, device)
    out = out_base[:, :4096]
    w = rand((4096,), dtype, device, seed=8)
    flashkern.rmsnorm(x, w, out=out)
    assert_close(out, ref.rmsnorm(x.double(), w.double(), 1e-6), dtype)
    assert out_base[:, 4096:].isnan().all(), "wrote outside the out view"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rmsnorm_misaligned_pointer(device, dtype):
    """A view starting one element in is not 16-byte aligned: the scalar path, same answer."""
    flat = rand((1 + 37 * 4096,), dtype, device, seed=9)
    x = flat[1:].view(37, 4096)
    w = rand((4096,), dtype, device, seed=10)
    assert_close(flashkern.rmsnorm(x, w), ref.rmsnorm(x.double(), w.double(), 1e-6), dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rmsnorm_per_head_in_fused_qkv(device, dtype):
    """q/k norm: [tokens, heads, head_dim] views of a fused qkv buffer (token stride > heads * head_dim)."""
    tokens, heads, kv_heads, head_dim = 37, 8, 2, 128
    qkv = rand((tokens, (heads + 2 * kv_heads) * head_dim), dtype, device, seed=11)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    w = rand((head_dim,), dtype, device, seed=12)
    for t in (q, k):
        assert_close(flashkern.rmsnorm(t, w), ref.rmsnorm(t.double(), w.double(), 1e-6), dtype)
    # heads-major view: rows are not a single stride apart
    t = rand((heads, tokens, head_dim), dtype, device, seed=13).transpose(0, 1)
    assert_close(flashkern.rmsnorm(t, w), ref.rmsnorm(t.double(), w.double(), 1e-6), dtype)


@pytest.mark.parametrize("tokens,hidden", [(1, 1), (37, 7), (989, 4096), (37, 5125), (3, 65536)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("gemma", [False, True])
def test_fused_add_rmsnorm(device, tokens, hidden, dtype, gemma):
    x, res = rand((tokens, hidden), dtype, device, seed=14), rand((tokens, hidden), dtype, device, seed=15)
    w = rand((hidden,), dtype, device, seed=16)
    expected_y, expected_res = ref.fused_add_rmsnorm(x.double(), res.double(), w.double(), 1e-6, 1.0 if gemma else 0.0)
    fn = flashkern.gemma_fused_add_rmsnorm if gemma else flashkern.fused_add_rmsnorm
    assert fn(x, res, w) is None
    assert_close(res, expected_res, dtype)
    assert_close(x, expected_y, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_add_rmsnorm_normalizes_the_unrounded_sum(device, dtype):
    """FlashInfer's rounding point: the norm is of the fp32 sum, not of the residual as stored. The
    formula written out here, in float64 from the 16-bit inputs, is matched to within the output's
    own rounding (half an ulp, and fp32 error; normalizing the rounded sum misses that on about 9% of
    these elements), and the stored residual is the sum rounded once."""
    x, res = rand((37, 769), dtype, device, seed=17), rand((37, 769), dtype, device, seed=18)
    w = rand((769,), dtype, device, seed=19)
    s = x.cpu().double() + res.cpu().double()
    expected_y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.cpu().double()
    rounded = s.to(dtype).double()  # the other rounding point, which must not be the one used
    other_y = rounded * torch.rsqrt(rounded.pow(2).mean(-1, keepdim=True) + 1e-6) * w.cpu().double()
    flashkern.fused_add_rmsnorm(x, res, w)
    assert torch.equal(res.cpu(), s.to(dtype))
    ulp = torch.finfo(dtype).eps
    error = (x.cpu().double() - expected_y).abs()
    assert (error <= 0.5 * ulp * expected_y.abs() * (1 + 1e-3) + 1e-6).all()
    # the two rounding points give other outputs for a good share of the elements
    assert (x.cpu() != other_y.to(dtype)).float().mean() > 0.01


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_fused_add_rmsnorm_strided(device, dtype):
    xb, rb = rand((37, 800), dtype, device, seed=20), rand((37, 900), dtype, device, seed=21)
    x, res = xb[:, :769], rb[:, 3:772]
    w = rand((769,), torch.float32, device, seed=22)
    expected_y, expected_res = ref.fused_add_rmsnorm(x.double(), res.double(), w.double(), 1e-6)
    untouched_x, untouched_r = xb[:, 769:].clone(), rb[:, 772:].clone()
    flashkern.fused_add_rmsnorm(x, res, w)
    assert_close(x, expected_y, dtype)
    assert_close(res, expected_res, dtype)
    assert torch.equal(xb[:, 769:], untouched_x) and torch.equal(rb[:, 772:], untouched_r)


def test_empty_batch(device):
    x, w = torch.empty((0, 4096), device=device), rand((4096,), torch.float32, device)
    assert flashkern.rmsnorm(x, w).shape == (0, 4096)
    res = torch.empty_like(x)
    flashkern.fused_add_rmsnorm(x, res, w)


@pytest.mark.parametrize("tokens,hidden", [(1, 1), (37, 7), (37, 769), (989, 4096), (5, 5125), (2, 20000)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("weight_fp32", [False, True])
@pytest.mark.parametrize("gemma", [False, True])
def test_rmsnorm_backward(device, tokens, hidden, dtype, weight_fp32, gemma):
    x = rand((tokens, hidden), dtype, device, seed=23).requires_grad_()
    w = rand((hidden,), torch.float32 if weight_fp32 else dtype, device, seed=24).requires_grad_()
    dy = rand((tokens, hidden), dtype, device, seed=25)
    fn = flashkern.gemma_rmsnorm if gemma else flashkern.rmsnorm
    fn(x, w).backward(dy)
    dx, dw = ref.rmsnorm_backward(dy.double(), x.detach().double(), w.detach().double(), 1e-6, 1.0 if gemma else 0.0)
    assert x.grad.dtype == dtype and w.grad.dtype == w.dtype
    assert_close(x.grad, dx, dtype)
    # dw sums `tokens` terms of size ~1: its absolute error grows with them
    scale = max(1.0, dw.abs().max().item())
    assert_close(w.grad / scale, dw / scale, w.dtype)


def test_rmsnorm_backward_non_contiguous_grad(device):
    x = rand((37, 64), torch.float32, device, seed=26).requires_grad_()
    w = rand((64,), torch.float32, device, seed=27).requires_grad_()
    flashkern.rmsnorm(x, w).sum().backward()  # grad is an expanded (stride 0) tensor
    x64, w64 = x.detach().double().cpu(), w.detach().double().cpu()
    dx, dw = ref.rmsnorm_backward(torch.ones(37, 64, dtype=torch.float64), x64, w64)
    assert_close(x.grad, dx)
    assert_close(w.grad, dw)


def test_rmsnorm_gradcheck_float64():
    x = rand((7, 33), torch.float64, "cpu", seed=28).requires_grad_()
    w = rand((33,), torch.float64, "cpu", seed=29).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: flashkern.rmsnorm(a, b, 1e-5), (x, w))
    assert torch.autograd.gradcheck(lambda a, b: flashkern.gemma_rmsnorm(a, b, 1e-5), (x, w))
    x3 = rand((3, 4, 16), torch.float64, "cpu", seed=30).requires_grad_()
    w3 = rand((16,), torch.float64, "cpu", seed=31).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: flashkern.rmsnorm(a, b), (x3, w3))


def test_out_variant_refuses_autograd(device):
    x = rand((4, 8), torch.float32, device).requires_grad_()
    w = rand((8,), torch.float32, device)
    with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
        flashkern.rmsnorm(x, w, out=torch.empty(4, 8, device=device))


@pytest.mark.parametrize("enable_pdl", [None, True, False])
def test_flashinfer_calling_conventions(device, enable_pdl):
    """FlashInfer's signatures: eps, out and enable_pdl by position and by name (enable_pdl is accepted
    and, with no programmatic dependent launch in flashkern yet, changes nothing)."""
    x, w = rand((5, 64), torch.bfloat16, device, seed=30), rand((64,), torch.bfloat16, device, seed=31)
    expected = flashkern.rmsnorm(x, w, 1e-5)
    for fn, offset in ((flashkern.rmsnorm, 0.0), (flashkern.gemma_rmsnorm, 1.0)):
        out = torch.empty_like(x)
        assert fn(x, w, 1e-5, out, enable_pdl) is out
        assert torch.equal(out, fn(x, w, eps=1e-5, enable_pdl=enable_pdl))
    assert torch.equal(flashkern.rmsnorm(x, w, 1e-5, None, enable_pdl), expected)
    for fn in (flashkern.fused_add_rmsnorm, flashkern.gemma_fused_add_rmsnorm):
        a, r, b, s = x.clone(), w.expand(5, 64).clone(), x.clone(), w.expand(5, 64).clone()
        fn(a, r, w, 1e-5, enable_pdl)
        fn(b, s, w, eps=1e-5)
        assert torch.equal(a, b) and torch.equal(r, s)
    with pytest.raises(TypeError, match="rmsnorm: enable_pdl must be None or a bool, got 'yes'"):
        flashkern.rmsnorm(x, w, enable_pdl="yes")
