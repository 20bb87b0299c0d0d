"""Shared test helpers. Every numeric test is parametrized over DEVICES: the CPU (the reference
backend) always, and the GPU where one is visible, so the GPU tests are these same functions."""

import pytest
import torch

from flashkern.tolerances import tolerance

GPU = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if GPU else [])
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES)


def rand(shape, dtype, device, scale=1.0, seed=0):
    """Random normal data (never zeros), generated on the CPU in float64 so every device sees the same values."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


def poisoned(shape, dtype, device):
    """An output buffer full of NaN: an element the kernel does not write shows up in the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_close(actual, expected, dtype=None):
    """actual (any device/dtype) against a float64 expected value, with the tolerance of `dtype`."""
    dtype = dtype or actual.dtype
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), **tolerance(dtype), equal_nan=False)


requires_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA or ROCm GPU")


def pytest_make_parametrize_id(config, val, argname):
    if isinstance(val, torch.dtype):
        return str(val).replace("torch.", "")
    return None
