"""Shared test helpers. Every numeric test is parametrized over DEVICES: the CPU (the reference
backend) always, the GPU where one is visible, so the GPU tests are these same functions, and the
emulated kernels (the `emulate` backends: CPU tensors, the CUDA or HIP kernels' own code run by the
CPU emulation) named in FLASHKERN_TEST_EMULATE (default "emulate,emulate-wave64"; "" for none)."""

import hashlib
import os
import subprocess
from pathlib import Path

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


# CI time: in these files' grids an emulate backend runs one case in SAMPLE[backend], for the backends in ROTATING
# a share that rotates with the code (ROTATION), so that every case runs across commits; every kernel path also runs on every launcher
# directly in test_emulated_kernels.py. FLASHKERN_TEST_EMULATE_SAMPLE=1 runs them all.
SAMPLED_FILES = {"test_decode.py", "test_prefill.py", "test_cascade.py", "test_norm.py", "test_act_and_mul.py",
                 "test_rope.py"}
SAMPLE = {"emulate": 2, "emulate-wave64": 3}
ROTATING = {"emulate"}  # emulate-wave64 keeps the share CI has always run (every third case from the first)
# The same for the emulator checks (test_emulator_checks.py): the ASan run takes one emulated-kernel test in
# SHARE["asan"], the mutants run one in SHARE["mutant"] a commit, each share rotating (rotating_index).
SHARE = {"asan": 3, "mutant": 2}
if "FLASHKERN_TEST_EMULATE_SAMPLE" in os.environ:
    SAMPLE = dict.fromkeys(SAMPLE, int(os.environ["FLASHKERN_TEST_EMULATE_SAMPLE"]))
    SHARE = dict.fromkeys(SHARE, int(os.environ["FLASHKERN_TEST_EMULATE_SAMPLE"]))


def rotation():
    """Which cases of a sampled grid run: FLASHKERN_TEST_ROTATION, else a number from the committed code (the
    trees of csrc/, python/ and tests/), so that each change of the code runs another share and every case runs
    across commits, while a commit of docs alone runs the same share (0 outside a git checkout)."""
    if "FLASHKERN_TEST_ROTATION" in os.environ:
        return int(os.environ["FLASHKERN_TEST_ROTATION"])
    trees = subprocess.run(["git", "rev-parse", "HEAD:csrc", "HEAD:python", "HEAD:tests"], cwd=Path(__file__).parent,
                           capture_output=True, text=True)
    return int(hashlib.sha1(trees.stdout.encode()).hexdigest()[:8], 16) if trees.returncode == 0 else 0


ROTATION = rotation()


def rotating_index(key, parts):
    """Which of `parts` parts this commit (ROTATION) takes for `key` (a check, or a check and a case): so that a
    check that runs one part a commit runs every part across commits, and two checks choose independently."""
    return int(hashlib.sha1(f"{ROTATION} {key}".encode()).hexdigest()[:8], 16) % parts


# pytest-xdist (README's test command: -n auto --dist loadgroup) hands tests out in collection order,
# the groups first: the longest tests (builds, subprocess runs) go first, so that no core is left alone with one of
# them at the end, and the tests of a module-scoped build are one group, run by one worker that builds it once.
LONGEST_FIRST = ["test_emulator_checks.py", "test_kernel_build.py", "test_device_check.py"]
BUILD_FIXTURES = ["cuda_build", "hip_build", "bench_json"]  # module-scoped: built or run once, by one worker


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    seen = {}
    for item in items:
        for build in BUILD_FIXTURES:
            if build in item.fixturenames:
                item.add_marker(pytest.mark.xdist_group(build))
        device = getattr(item, "callspec", None) and item.callspec.params.get("device")
        # `-m gpu` selects what needs a GPU: the cuda-parametrized cases and the tests marked requires_gpu
        if device == "cuda":
            item.add_marker(pytest.mark.gpu)
        elif not GPU and item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA or ROCm GPU"))
        backend = getattr(device, "backend", None)
        if backend not in SAMPLE or item.path.name not in SAMPLED_FILES:
            continue
        k = seen[item.path.name, backend] = seen.get((item.path.name, backend), -1) + 1
        if (k + (ROTATION if backend in ROTATING else 0)) % SAMPLE[backend]:
            how = "rotating by commit" if backend in ROTATING else "the same share every run"
            item.add_marker(pytest.mark.skip(reason=f"{backend}: one case in {SAMPLE[backend]} of this file's grid, "
                                                    f"{how} (CI time; FLASHKERN_TEST_EMULATE_SAMPLE=1 runs all)"))
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))


def pytest_configure(config):
    config.pluginmanager.register(RunOnce(), "flashkern-run-once")


class RunOnce:
    """A test that another test of the same run already runs (the same function on the same launchers, with its
    assertions) is left out of it (deselected): the emulated-kernel tests that test_emulator_checks.py's ASan run
    covers (there under AddressSanitizer; in that run itself, those outside its share), and the wave32 tour of
    every kernel and path, which test_kernel_build.py's gfx1030 launch-bounds test makes. Last, after -k and -m, so that it sees what the run really has."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        ids = {item.nodeid.split("@")[0] for item in items}  # xdist's group suffix off
        asan = "tests/test_emulator_checks.py::test_kernels_under_sanitizer[address]" in ids
        wave32_tour = "tests/test_kernel_build.py::test_every_hip_launch_fits_its_kernels_launch_bounds[gfx1030]" in ids
        asan_run = os.environ.get("FK_EMU_ASAN_SHARE") == "1"  # the ASan run itself: its share of the module only
        if asan or asan_run:
            from test_emulator_checks import covered_by_asan

        def elsewhere(item):
            if asan and covered_by_asan(item):
                return True
            if asan_run and not covered_by_asan(item):
                return True
            return wave32_tour and item.nodeid.startswith(
                "tests/test_emulated_kernels.py::test_every_kernel_and_path[hip-wave32]")

        left_out = [item for item in items if elsewhere(item)]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if not elsewhere(item)]


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


def missing_tool(what):
    """A test whose compiler or tool is not installed: skipped on a developer's machine, failed in CI (CI=true),
    which scripts/setup.sh equips with every one, so that a missing install step is a red run, not a quiet skip."""
    message = f"{what} not installed (scripts/setup.sh installs it)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI: {message}", pytrace=False)
    pytest.skip(message)


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
