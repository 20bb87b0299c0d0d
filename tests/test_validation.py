"""Bad input raises TypeError or ValueError naming the argument and the value, on every device
(the CPU reference and the fake functions check in Python, the GPU kernels in C++)."""

import re
from pathlib import Path

import pytest
import torch
from conftest import emulated, rand, requires_gpu

import flashkern

ops = torch.ops.flashkern


def norm_args(device, tokens=4, hidden=8, dtype=torch.float32):
    return rand((tokens, hidden), dtype, device), rand((hidden,), dtype, device, seed=1)


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda d: (rand((4, 8), torch.float32, d).int(), rand((8,), torch.float32, d)), TypeError, r"input must be .*got torch.int32|input must be .*got Int"),
        (lambda d: (rand((4, 8), torch.float16, d), rand((8,), torch.bfloat16, d)), TypeError, r"weight must be float32 or the dtype of input"),
        (lambda d: (rand((8,), torch.float32, d), rand((8,), torch.float32, d)), ValueError, r"input must be 2-D .* got shape"),
        (lambda d: (rand((2, 2, 2, 8), torch.float32, d), rand((8,), torch.float32, d)), ValueError, r"input must be 2-D"),
        (lambda d: (rand((4, 8), torch.float32, d), rand((7,), torch.float32, d)), ValueError, r"weight must have shape \[8\]"),
        (lambda d: (rand((4, 8), torch.float32, d), rand((8, 1), torch.float32, d)), ValueError, r"weight must have shape \[8\]"),
        (lambda d: (rand((8, 4), torch.float32, d).t(), rand((8,), torch.float32, d)), ValueError, r"input must be contiguous in its last dimension"),
        (lambda d: (rand((4, 0), torch.float32, d), rand((0,), torch.float32, d)), ValueError, r"hidden size .* must be positive"),
        (lambda d: (rand((4, 8), torch.float32, d), rand((16,), torch.float32, d)[::2]), ValueError, r"weight must be contiguous"),
    ],
)
def test_rmsnorm_bad_tensors(device, make, exc, match):
    x, w = make(device)
    with pytest.raises(exc, match=match):
        flashkern.rmsnorm(x, w)
    with pytest.raises(exc, match=match):
        flashkern.fused_add_rmsnorm(x, x.clone(), w)


@pytest.mark.parametrize("eps", [-1e-6, float("nan"), float("inf")])
def test_rmsnorm_bad_eps(device, eps):
    x, w = norm_args(device)
    with pytest.raises(ValueError, match=r"eps must be a finite number >= 0, got"):
        flashkern.rmsnorm(x, w, eps=eps)


def test_float64_is_reference_only(device):
    x, w = norm_args(device, dtype=torch.float64)
    if device == "cpu" and not emulated(device):
        flashkern.rmsnorm(x, w)  # the reference takes float64 (gradcheck needs it); the kernels do not
    else:
        with pytest.raises(TypeError, match=r"input must be float16, bfloat16 or float32"):
            flashkern.rmsnorm(x, w)


def test_mismatched_devices():
    """Tensors on two devices: CPU + meta here (the dispatcher picks Meta, whose fake function checks)."""
    x = rand((4, 8), torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"weight is on meta but input is on cpu"):
        ops.rmsnorm(x, torch.empty(8, device="meta"), 1e-6, 0.0)
    with pytest.raises(ValueError, match=r"residual is on meta but input is on cpu"):
        ops.fused_add_rmsnorm(x, torch.empty(4, 8, device="meta"), torch.ones(8), 1e-6, 0.0)


@requires_gpu
def test_mismatched_devices_gpu():
    x = rand((4, 8), torch.float32, "cuda")
    with pytest.raises(ValueError, match=r"weight is on cpu but input is on cuda"):
        flashkern.rmsnorm(x, torch.ones(8))
    with pytest.raises(ValueError, match=r"residual is on cpu but input is on cuda"):
        flashkern.fused_add_rmsnorm(x, torch.ones(4, 8), torch.ones(8, device="cuda"))


def test_residual_and_out_must_match(device):
    x, w = norm_args(device)
    with pytest.raises(ValueError, match=r"residual must have the shape of input \(4, 8\)|residual must have the shape of input \[4, 8\]"):
        flashkern.fused_add_rmsnorm(x, rand((4, 9), torch.float32, device), w)
    with pytest.raises(TypeError, match=r"residual must have the dtype of input"):
        flashkern.fused_add_rmsnorm(x, x.half(), w)
    with pytest.raises(ValueError, match=r"residual must be contiguous in its last dimension"):
        flashkern.fused_add_rmsnorm(x, rand((8, 4), torch.float32, device).t(), w)
    with pytest.raises(ValueError, match=r"out must have the shape of input"):
        flashkern.rmsnorm(x, w, out=torch.empty(4, 9, device=device))
    with pytest.raises(TypeError, match=r"out must have the dtype of input"):
        flashkern.rmsnorm(x, w, out=torch.empty(4, 8, device=device, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"out must be contiguous in its last dimension"):
        flashkern.rmsnorm(x, w, out=torch.empty(8, 4, device=device).t())


@pytest.mark.parametrize("name", ["silu", "gelu", "gelu_tanh"])
def test_act_and_mul_bad_input(device, name):
    fn = getattr(flashkern, f"{name}_and_mul")
    with pytest.raises(ValueError, match=rf"{name}_and_mul: the last dimension of input must be even .* got 7"):
        fn(rand((4, 7), torch.float32, device))
    with pytest.raises(TypeError, match=rf"{name}_and_mul: input must be float16, bfloat16(, float32 or float64| or float32), got"):
        fn(torch.ones(4, 8, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=r"input must be contiguous in its last dimension"):
        fn(rand((8, 4), torch.float32, device).t())
    with pytest.raises(ValueError, match=r"input must have at least one dimension"):
        fn(torch.tensor(1.0, device=device))
    x = rand((4, 8), torch.float32, device)
    with pytest.raises(ValueError, match=r"out must have shape \(4, 4\)|out must have shape \[4, 4\]"):
        fn(x, out=torch.empty(4, 8, device=device))
    with pytest.raises(TypeError, match=r"out must have the dtype of input"):
        fn(x, out=torch.empty(4, 4, device=device, dtype=torch.float16))


def test_act_and_mul_unknown_activation(device):
    with pytest.raises(ValueError, match=r"activation must be 'silu', 'gelu' or 'gelu_tanh', got 'relu'"):
        ops.act_and_mul(rand((4, 8), torch.float32, device), "relu")


def test_non_tensor_arguments():
    with pytest.raises(TypeError, match=r"rmsnorm: input must be a torch.Tensor, got list"):
        flashkern.rmsnorm([[1.0, 2.0]], torch.ones(2))
    with pytest.raises(TypeError, match=r"silu_and_mul: input must be a torch.Tensor, got list"):
        flashkern.silu_and_mul([1.0, 2.0])
    with pytest.raises((TypeError, RuntimeError), match=r"weight"):
        flashkern.rmsnorm(torch.ones(2, 2), [1.0, 2.0])


def test_backend_choice_errors(monkeypatch):
    from flashkern import _backend

    with pytest.raises(ValueError, match=r"FLASHKERN_BACKEND must be one of"):
        flashkern.set_backend("tpu")
    other = "hip" if _backend.BUILT == "cuda" else "cuda"
    with pytest.raises(RuntimeError, match=rf"FLASHKERN_BACKEND={other}, but this flashkern build has"):
        flashkern.set_backend(other)
    assert flashkern.get_backend() == "auto"


def test_glue_formats_its_own_numbers():
    """The C++ checks build their messages with message() (csrc/torch/glue/common.h) and never stream a
    number through TORCH_CHECK's own c10::str: on the H200 image (torch 2.11, GCC 13.3) every check that
    did crashed the process instead of raising."""
    root = Path(__file__).resolve().parent.parent / "csrc" / "torch"
    offenders = []
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".h", ".cpp"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b(TORCH_CHECK\w*|c10::str)\(", line) and not line.startswith("#define FK_CHECK"):
                offenders.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
