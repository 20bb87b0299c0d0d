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
    """Returns (normed, new_residual): new_residual = round(input + residual), normed = rmsnorm(new_residual).

    The sum is rounded to the dtype before it is normalized, as a model that stores its residual
    stream in that dtype (and then normalizes what it stored) computes it.
    """
    c = compute_dtype(input)
    new_residual = (input.to(c) + residual.to(c)).to(input.dtype)
    return rmsnorm(new_residual, weight, eps, weight_offset), new_residual


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
