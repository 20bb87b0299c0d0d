import torch

from ._compute import compute_dtype


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rmsnorm(input, weight, eps=1e-6, weight_offset=0.0):
    """input * rsqrt(mean(input^2, -1) + eps) * (weight + weight_offset), rounded once to input.dtype."""
    c = compute_dtype(input)
    x = input.to(c)
    return (x * _rstd(x, eps) * (weight.to(c) + weight_offset)).to(input.dtype)


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, weight_offset=0.0):
    """Returns (normed, new_residual): with s = input + residual in the compute dtype,
    new_residual = round(s) and normed = round(rmsnorm(s)).

    The unrounded sum is normalized, as FlashInfer's fused_add_rmsnorm does; only the stored
    residual is rounded to the dtype.
    """
    c = compute_dtype(input)
    s = input.to(c) + residual.to(c)
    return rmsnorm(s, weight, eps, weight_offset).to(input.dtype), s.to(input.dtype)


def rmsnorm_backward(grad_out, input, weight, eps=1e-6, weight_offset=0.0):
    """(grad_input, grad_weight) of rmsnorm, from the closed form (gradcheck verifies it)."""
    c = compute_dtype(input)
    x, g = input.to(c), grad_out.to(c)
    w = weight.to(c) + weight_offset
    r = _rstd(x, eps)
    mean_gwx = (g * w * x).mean(-1, keepdim=True)
    grad_input = r * (g * w - x * r.pow(2) * mean_gwx)
    grad_weight = (g * x * r).reshape(-1, x.shape[-1]).sum(0)
    return grad_input.to(input.dtype), grad_weight.to(weight.dtype)
