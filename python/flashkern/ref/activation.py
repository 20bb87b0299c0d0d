import math

import torch

from ._compute import compute_dtype

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_TANH_BETA = 0.044715


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return x * torch.sigmoid(x)
    if name == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x * _INV_SQRT_2))
    if name == "gelu_tanh":
        return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + _GELU_TANH_BETA * x.pow(3))))
    raise ValueError(f"activation must be 'silu', 'gelu' or 'gelu_tanh', got {name!r}")


def activation_derivative(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        s = torch.sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    if name == "gelu":
        return 0.5 * (1.0 + torch.erf(x * _INV_SQRT_2)) + x * _INV_SQRT_2PI * torch.exp(-0.5 * x * x)
    if name == "gelu_tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (x + _GELU_TANH_BETA * x.pow(3)))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_BETA * x * x)
    raise ValueError(f"activation must be 'silu', 'gelu' or 'gelu_tanh', got {name!r}")


def act_and_mul(input, activation_name="silu"):
    """act(input[..., :d]) * input[..., d:] for input [..., 2d], rounded once to input.dtype."""
    c = compute_dtype(input)
    gate, up = input.to(c).chunk(2, dim=-1)
    return (activation(activation_name, gate) * up).to(input.dtype)


def act_and_mul_backward(grad_out, input, activation_name="silu"):
    """grad_input [..., 2d] = [dy * up * act'(gate), dy * act(gate)]."""
    c = compute_dtype(input)
    gate, up = input.to(c).chunk(2, dim=-1)
    g = grad_out.to(c)
    grad_gate = g * up * activation_derivative(activation_name, gate)
    grad_up = g * activation(activation_name, gate)
    return torch.cat([grad_gate, grad_up], dim=-1).to(input.dtype)


def act_mul(gate, up, activation_name="silu"):
    """act(gate) * up, rounded once to gate.dtype."""
    c = compute_dtype(gate)
    return (activation(activation_name, gate.to(c)) * up.to(c)).to(gate.dtype)


def act_mul_backward(grad_out, gate, up, activation_name="silu"):
    """(grad_gate, grad_up) = (dy * up * act'(gate), dy * act(gate))."""
    c = compute_dtype(gate)
    g, x, u = grad_out.to(c), gate.to(c), up.to(c)
    return (g * u * activation_derivative(activation_name, x)).to(gate.dtype), (g * activation(activation_name, x)).to(up.dtype)
