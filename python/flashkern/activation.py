"""Gated activations: silu_and_mul (SwiGLU), gelu_and_mul and gelu_tanh_and_mul (GeGLU).

One op, torch.ops.flashkern.act_and_mul, serves all three through its activation argument.
Order in this file: public functions, CPU reference registration, fake functions, autograd.
"""

import torch

from . import _backend, ref
from ._validate import (
    check_same,
    check_enable_pdl,
    check_act_and_mul,
    check_act_mul,
    check_act_and_mul_output,
    check_activation,
    check_tensor,
    half_last_dim,
)

_ops = torch.ops.flashkern


def _act_and_mul(input, activation, out, pdl=False):
    check_tensor(f"{activation}_and_mul", "input", input)
    if _backend.use_reference(input.device):
        _check(input, activation, reference=True)
        y = ref.act_and_mul(input, activation)
        return y if out is None else out.copy_(y)
    if out is None:
        return _ops.act_and_mul(input, activation, pdl)
    if torch.is_grad_enabled() and input.requires_grad:
        raise RuntimeError(
            f"{activation}_and_mul(): functions with out=... arguments don't support automatic differentiation"
        )
    _ops.act_and_mul_out(out, input, activation, pdl)
    return out


def silu_and_mul(input: torch.Tensor, out: torch.Tensor = None, enable_pdl: bool = None) -> torch.Tensor:
    """SwiGLU: ``silu(input[..., :d]) * input[..., d:]`` for input ``[..., 2d]``; returns ``[..., d]``.

    float16, bfloat16 or float32, last dimension contiguous; math in float32. Differentiable when
    ``out`` is None. ``enable_pdl``: as in rmsnorm.
    """
    return _act_and_mul(input, "silu", out, check_enable_pdl("silu_and_mul", enable_pdl))


def gelu_and_mul(input: torch.Tensor, out: torch.Tensor = None, enable_pdl: bool = None) -> torch.Tensor:
    """GeGLU with the exact (erf) GELU: ``gelu(input[..., :d]) * input[..., d:]``; see silu_and_mul."""
    return _act_and_mul(input, "gelu", out, check_enable_pdl("gelu_and_mul", enable_pdl))


def gelu_tanh_and_mul(input: torch.Tensor, out: torch.Tensor = None, enable_pdl: bool = None) -> torch.Tensor:
    """GeGLU with the tanh-approximated GELU: ``gelu_tanh(input[..., :d]) * input[..., d:]``."""
    return _act_and_mul(input, "gelu_tanh", out, check_enable_pdl("gelu_tanh_and_mul", enable_pdl))


def act_mul(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` for two tensors of one shape: silu_and_mul (or gelu_and_mul, gelu_tanh_and_mul)
    of ``cat([gate, up], -1)`` without the concatenation, as a gated MLP with separate gate and up
    projections produces them. Differentiable in gate and up."""
    check_tensor("act_mul", "gate", gate)
    if _backend.use_reference(gate.device):
        check_activation("act_mul", activation)
        check_act_mul("act_mul", gate, up, reference=True)
        return ref.act_mul(gate, up, activation)
    return _ops.act_mul(gate, up, activation)


# ---- CPU: the reference, with the same checks as the kernels ----
# Errors name the public op (silu_and_mul, ...), as the kernels' checks do.


def _check(input, activation, reference, backward=False):
    check_activation("act_and_mul", activation)
    op = f"{activation}_and_mul" + ("_backward" if backward else "")
    check_act_and_mul(op, input, reference)
    return op


@_backend.register_cpu("act_and_mul")
def _act_and_mul_cpu(input, activation, enable_pdl=False):
    _check(input, activation, reference=True)
    return ref.act_and_mul(input, activation).contiguous()


@_backend.register_cpu("act_and_mul_out")
def _act_and_mul_out_cpu(out, input, activation, enable_pdl=False):
    check_act_and_mul_output(_check(input, activation, reference=True), "out", out, input)
    out.copy_(ref.act_and_mul(input, activation))


@_backend.register_cpu("act_and_mul_backward")
def _act_and_mul_backward_cpu(grad_out, input, activation):
    op = _check(input, activation, reference=True, backward=True)
    check_act_and_mul_output(op, "grad_out", grad_out, input)
    return ref.act_and_mul_backward(grad_out, input, activation).contiguous()


@_backend.register_cpu("act_mul")
def _act_mul_cpu(gate, up, activation):
    check_activation("act_mul", activation)
    check_act_mul("act_mul", gate, up, reference=True)
    return ref.act_mul(gate, up, activation).contiguous()


@_backend.register_cpu("act_mul_backward")
def _act_mul_backward_cpu(grad_out, gate, up, activation):
    check_activation("act_mul_backward", activation)
    check_act_mul("act_mul_backward", gate, up, reference=True)
    check_same("act_mul_backward", "grad_out", grad_out, "gate", gate)
    grad_gate, grad_up = ref.act_mul_backward(grad_out, gate, up, activation)
    return grad_gate.contiguous(), grad_up.contiguous()


# ---- fake functions ----


@torch.library.register_fake("flashkern::act_mul")
def _act_mul_fake(gate, up, activation):
    check_activation("act_mul", activation)
    check_act_mul("act_mul", gate, up, reference=gate.device.type == "cpu")
    return gate.new_empty(gate.shape)


@torch.library.register_fake("flashkern::act_mul_backward")
def _act_mul_backward_fake(grad_out, gate, up, activation):
    check_act_mul("act_mul_backward", gate, up, reference=gate.device.type == "cpu")
    check_same("act_mul_backward", "grad_out", grad_out, "gate", gate)
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


@torch.library.register_fake("flashkern::act_and_mul")
def _act_and_mul_fake(input, activation, enable_pdl=False):
    _check(input, activation, reference=input.device.type == "cpu")
    return input.new_empty(half_last_dim(input.shape))


@torch.library.register_fake("flashkern::act_and_mul_out")
def _act_and_mul_out_fake(out, input, activation, enable_pdl=False):
    check_act_and_mul_output(_check(input, activation, reference=input.device.type == "cpu"), "out", out, input)


@torch.library.register_fake("flashkern::act_and_mul_backward")
def _act_and_mul_backward_fake(grad_out, input, activation):
    op = _check(input, activation, reference=input.device.type == "cpu", backward=True)
    check_act_and_mul_output(op, "grad_out", grad_out, input)
    return input.new_empty(input.shape)


# ---- autograd ----


def _setup_context(ctx, inputs, output):
    input, activation = inputs[:2]  # and enable_pdl, for the forward only
    ctx.save_for_backward(input)
    ctx.activation = activation


def _backward(ctx, grad):
    (input,) = ctx.saved_tensors
    if grad.dim() >= 1 and grad.shape[-1] > 1 and grad.stride(-1) != 1:
        grad = grad.contiguous()
    return _ops.act_and_mul_backward(grad, input, ctx.activation), None, None


torch.library.register_autograd("flashkern::act_and_mul", _backward, setup_context=_setup_context)


def _act_mul_setup_context(ctx, inputs, output):
    gate, up, activation = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _act_mul_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    if grad.dim() >= 1 and grad.shape[-1] > 1 and grad.stride(-1) != 1:
        grad = grad.contiguous()
    grad_gate, grad_up = _ops.act_mul_backward(grad, gate, up, ctx.activation)
    return grad_gate, grad_up, None


torch.library.register_autograd("flashkern::act_mul", _act_mul_backward, setup_context=_act_mul_setup_context)
