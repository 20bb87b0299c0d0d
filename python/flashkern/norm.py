"""RMSNorm family: rmsnorm, fused_add_rmsnorm and their Gemma variants (weight + 1).

One op, torch.ops.flashkern.rmsnorm, serves both: the Gemma variants pass weight_offset=1.
Order in this file: public functions, CPU reference registration, fake functions, autograd.
"""

import torch

from . import _backend, ref
from ._validate import check_enable_pdl, check_last_dim_contiguous, check_rmsnorm, check_same, check_tensor

_ops = torch.ops.flashkern


def _no_grad_for_out(op, *tensors):
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(f"{op}(): functions with out=... or in-place arguments don't support automatic differentiation")


def _rmsnorm(input, weight, eps, weight_offset, out, pdl=False):
    check_tensor("rmsnorm", "input", input)
    if _backend.use_reference(input.device):
        check_rmsnorm("rmsnorm", input, weight, eps, reference=True)
        y = ref.rmsnorm(input, weight, eps, weight_offset)
        return y if out is None else out.copy_(y)
    if out is None:
        return _ops.rmsnorm(input, weight, eps, weight_offset, pdl)
    _no_grad_for_out("rmsnorm", input, weight)
    _ops.rmsnorm_out(out, input, weight, eps, weight_offset, pdl)
    return out


def _fused_add_rmsnorm(input, residual, weight, eps, weight_offset, pdl=False):
    check_tensor("fused_add_rmsnorm", "input", input)
    if _backend.use_reference(input.device):
        check_rmsnorm("fused_add_rmsnorm", input, weight, eps, reference=True)
        check_same("fused_add_rmsnorm", "residual", residual, "input", input)
        y, new_residual = ref.fused_add_rmsnorm(input, residual, weight, eps, weight_offset)
        residual.copy_(new_residual)
        input.copy_(y)
        return
    _no_grad_for_out("fused_add_rmsnorm", input, residual, weight)
    _ops.fused_add_rmsnorm(input, residual, weight, eps, weight_offset, pdl)


def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor = None,
            enable_pdl: bool = None) -> torch.Tensor:
    """Root mean square normalization: ``input * rsqrt(mean(input**2, -1) + eps) * weight``.

    input: ``[tokens, hidden]``, or ``[tokens, heads, head_dim]`` to normalize each head (q/k norm);
    float16, bfloat16 or float32, last dimension contiguous (rows may be strided).
    weight: ``[hidden]``, input's dtype or float32. Math in float32; the result is rounded once to
    input's dtype. Differentiable (input and weight) when ``out`` is None. ``enable_pdl=True``
    (FlashInfer's): a programmatic dependent launch on GPUs that have it (CUDA sm_90+; elsewhere a
    plain launch), so that the kernel's launch overlaps the end of the one before; None is off.
    """
    return _rmsnorm(input, weight, eps, 0.0, out, check_enable_pdl("rmsnorm", enable_pdl))


def gemma_rmsnorm(input, weight, eps: float = 1e-6, out=None, enable_pdl=None):
    """Gemma's RMSNorm: ``input * rsqrt(mean(input**2, -1) + eps) * (1 + weight)``; see rmsnorm."""
    return _rmsnorm(input, weight, eps, 1.0, out, check_enable_pdl("gemma_rmsnorm", enable_pdl))


def fused_add_rmsnorm(input, residual, weight, eps: float = 1e-6, enable_pdl=None) -> None:
    """In place: ``residual += input``, then ``input = rmsnorm(residual, weight, eps)``.

    Rounding, as FlashInfer's: the sum is computed in float32; ``residual`` gets it rounded to the
    dtype, and the norm is computed from the unrounded float32 sum and rounded once when written
    to ``input``. Inference only (no autograd). ``enable_pdl``: as in rmsnorm.
    """
    _fused_add_rmsnorm(input, residual, weight, eps, 0.0, check_enable_pdl("fused_add_rmsnorm", enable_pdl))


def gemma_fused_add_rmsnorm(input, residual, weight, eps: float = 1e-6, enable_pdl=None) -> None:
    """fused_add_rmsnorm with Gemma's ``(1 + weight)``."""
    _fused_add_rmsnorm(input, residual, weight, eps, 1.0, check_enable_pdl("gemma_fused_add_rmsnorm", enable_pdl))


# ---- CPU: the reference, with the same checks as the kernels ----


@_backend.register_cpu("rmsnorm")
def _rmsnorm_cpu(input, weight, eps, weight_offset, enable_pdl=False):
    check_rmsnorm("rmsnorm", input, weight, eps, reference=True)
    return ref.rmsnorm(input, weight, eps, weight_offset).contiguous()


@_backend.register_cpu("rmsnorm_out")
def _rmsnorm_out_cpu(out, input, weight, eps, weight_offset, enable_pdl=False):
    check_rmsnorm("rmsnorm", input, weight, eps, reference=True)
    check_same("rmsnorm", "out", out, "input", input)
    check_last_dim_contiguous("rmsnorm", "out", out)
    out.copy_(ref.rmsnorm(input, weight, eps, weight_offset))


@_backend.register_cpu("fused_add_rmsnorm")
def _fused_add_rmsnorm_cpu(input, residual, weight, eps, weight_offset, enable_pdl=False):
    check_rmsnorm("fused_add_rmsnorm", input, weight, eps, reference=True)
    check_same("fused_add_rmsnorm", "residual", residual, "input", input)
    check_last_dim_contiguous("fused_add_rmsnorm", "residual", residual)
    y, new_residual = ref.fused_add_rmsnorm(input, residual, weight, eps, weight_offset)
    residual.copy_(new_residual)
    input.copy_(y)


@_backend.register_cpu("rmsnorm_backward")
def _rmsnorm_backward_cpu(grad_out, input, weight, eps, weight_offset):
    check_rmsnorm("rmsnorm_backward", input, weight, eps, reference=True)
    check_same("rmsnorm_backward", "grad_out", grad_out, "input", input)
    grad_input, grad_weight = ref.rmsnorm_backward(grad_out, input, weight, eps, weight_offset)
    return grad_input.contiguous(), grad_weight


# ---- fake functions: shapes and checks only, for torch.compile and meta tensors ----


def _is_reference(t):
    return t.device.type == "cpu"


@torch.library.register_fake("flashkern::rmsnorm")
def _rmsnorm_fake(input, weight, eps, weight_offset, enable_pdl=False):
    check_rmsnorm("rmsnorm", input, weight, eps, reference=_is_reference(input))
    return input.new_empty(input.shape)


@torch.library.register_fake("flashkern::rmsnorm_out")
def _rmsnorm_out_fake(out, input, weight, eps, weight_offset, enable_pdl=False):
    check_rmsnorm("rmsnorm", input, weight, eps, reference=_is_reference(input))
    check_same("rmsnorm", "out", out, "input", input)


@torch.library.register_fake("flashkern::fused_add_rmsnorm")
def _fused_add_rmsnorm_fake(input, residual, weight, eps, weight_offset, enable_pdl=False):
    check_rmsnorm("fused_add_rmsnorm", input, weight, eps, reference=_is_reference(input))
    check_same("fused_add_rmsnorm", "residual", residual, "input", input)


@torch.library.register_fake("flashkern::rmsnorm_backward")
def _rmsnorm_backward_fake(grad_out, input, weight, eps, weight_offset):
    check_rmsnorm("rmsnorm_backward", input, weight, eps, reference=_is_reference(input))
    check_same("rmsnorm_backward", "grad_out", grad_out, "input", input)
    return input.new_empty(input.shape), weight.new_empty(weight.shape)


# ---- autograd ----


def _rmsnorm_setup_context(ctx, inputs, output):
    input, weight, eps, weight_offset = inputs[:4]  # and enable_pdl, for the forward only
    ctx.save_for_backward(input, weight)
    ctx.eps, ctx.weight_offset = eps, weight_offset


def _rmsnorm_autograd_backward(ctx, grad):
    input, weight = ctx.saved_tensors
    if grad.dim() >= 1 and grad.shape[-1] > 1 and grad.stride(-1) != 1:
        grad = grad.contiguous()
    grad_input, grad_weight = _ops.rmsnorm_backward(grad, input, weight, ctx.eps, ctx.weight_offset)
    return grad_input, grad_weight, None, None, None


torch.library.register_autograd(
    "flashkern::rmsnorm", _rmsnorm_autograd_backward, setup_context=_rmsnorm_setup_context
)
