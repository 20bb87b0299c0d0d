"""Shared test helpers. Every numeric test is parametrized over DEVICES: the CPU (the reference
backend) always, the GPU where one is visible, so the GPU tests are these same functions, and the
emulated kernels (the `emulate` backends: CPU tensors, the CUDA or HIP kernels' own code run by the
CPU emulation) named in FLASHKERN_TEST_EMULATE (default "emulate,emulate-wave64"; "" for none)."""

import os

import pytest
import torch

import flashkern
from flashkern.tolerances import tolerance


class Emulated(str):
    """The "cpu" device under an emulate backend (the test runs with flashkern.set_backend(backend))."""

    def __new__(cls, backend):
        device = super().__new__(cls, "cpu")
        device.backend = backend
        return device


GPU = torch.cuda.is_available()
EMULATED = [Emulated(b) for b in os.environ.get("FLASHKERN_TEST_EMULATE", "emulate,emulate-wave64").split(",") if b]
DEVICES = ["cpu"] + (["cuda"] if GPU else []) + EMULATED
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def pytest_collection_finish(session):
    """The emulator checks (test_emulator_checks.py: sanitizer runs and mutants, each a subprocess) start
    in a background thread as soon as they are collected, so they use the second core meanwhile."""
    if session.config.option.collectonly:
        return
    if any(item.path.name == "test_emulator_checks.py" for item in session.items):
        import test_emulator_checks

        if test_emulator_checks.CXX:
            test_emulator_checks.start()


# CI time: the emulate-wave64 backend runs one case in WAVE64_SAMPLE of these files' grids (every kernel
# path also runs on the wave64 and wave32 launchers directly in test_emulated_kernels.py);
# FLASHKERN_TEST_WAVE64_SAMPLE=1 runs them all.
WAVE64_SAMPLED = {"test_decode.py", "test_prefill.py", "test_cascade.py", "test_norm.py", "test_act_and_mul.py",
                  "test_rope.py"}
WAVE64_SAMPLE = int(os.environ.get("FLASHKERN_TEST_WAVE64_SAMPLE", "3"))


def pytest_collection_modifyitems(config, items):
    seen = {}
    for item in items:
        device = getattr(item, "callspec", None) and item.callspec.params.get("device")
        # `-m gpu` selects what needs a GPU: the cuda-parametrized cases and the tests marked requires_gpu
        if device == "cuda":
            item.add_marker(pytest.mark.gpu)
        elif not GPU and item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA or ROCm GPU"))
        if getattr(device, "backend", None) != "emulate-wave64" or item.path.name not in WAVE64_SAMPLED:
            continue
        k = seen[item.path.name] = seen.get(item.path.name, -1) + 1
        if k % WAVE64_SAMPLE:
            item.add_marker(pytest.mark.skip(reason=f"emulate-wave64: one case in {WAVE64_SAMPLE} of this file's grid "
                                                    "(CI time; FLASHKERN_TEST_WAVE64_SAMPLE=1 runs all)"))
    # the emulator checks last: they wait for their background runs, which the rest of the suite overlaps
    items.sort(key=lambda item: item.path.name == "test_emulator_checks.py")


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES, ids=[getattr(d, "backend", d) for d in DEVICES])


@pytest.fixture(autouse=True)
def _emulate_backend(request):
    """Runs a test parametrized with an Emulated device under its backend."""
    device = getattr(request.node, "callspec", None) and request.node.callspec.params.get("device")
    if not isinstance(device, Emulated):
        yield
        return
    previous = flashkern.set_backend(device.backend)
    try:
        yield
    finally:
        flashkern.set_backend(previous)


def subprocess_limit(alone_seconds):
    """A subprocess's time limit from what it takes alone on 2 idle cores: 20 times that (FLASHKERN_TEST_LIMIT_SCALE),
    times the load average per core when it is above 1, so that a busy machine makes a run slower, not red; the
    limit only stops a hang."""
    scale = float(os.environ.get("FLASHKERN_TEST_LIMIT_SCALE", "20"))
    load = os.getloadavg()[0] / (os.cpu_count() or 1) if hasattr(os, "getloadavg") else 1.0
    return alone_seconds * scale * max(1.0, load)


def emulated(device):
    """True for an Emulated device: the kernels run, not the reference (their semantics, e.g. NaN where
    the reference raises; their size limits; an emulation thousands of times slower than a GPU)."""
    return isinstance(device, Emulated)


def skip_if_emulated(device, why):
    """Cases the CPU emulation cannot afford (`why` says which); the same case runs on the reference and on a GPU."""
    if emulated(device):
        pytest.skip(f"{device.backend}: {why}")


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


requires_gpu = pytest.mark.gpu  # a GPU-only test: skipped without one, selected by `pytest -m gpu`


def pytest_make_parametrize_id(config, val, argname):
    if isinstance(val, torch.dtype):
        return str(val).replace("torch.", "")
    return None


@pytest.fixture
def restore_rope():
    """apply_flashkern patches the family's module-level apply_rotary_pos_emb: put the originals back
    (tests/test_integrations.py, tests/test_batch_invariance.py; transformers must be importable)."""
    import importlib

    from flashkern.integrations.transformers import FAMILIES

    pytest.importorskip("transformers", reason="transformers is an optional dependency")

    saved = {}
    for module_name, *_ in FAMILIES.values():
        module = importlib.import_module(module_name)
        saved[module] = module.apply_rotary_pos_emb
    yield
    for module, fn in saved.items():
        module.apply_rotary_pos_emb = fn
