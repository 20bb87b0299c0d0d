"""Backend selection, flashkern.info() and the `flashkern` command."""

import importlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import GPU, ROTATION, assert_close, rand, requires_gpu, subprocess_limit

import flashkern
from flashkern import _backend, ref


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "flashkern", *args], capture_output=True, text=True, timeout=subprocess_limit(60), env=env
    )


def test_info_describes_the_build():
    data = flashkern.info()
    assert data["built_backend"] in ("cuda", "hip", "cpu")
    assert data["torch"] == torch.__version__
    archs = data["built_archs"]
    if data["built_backend"] == "cuda":
        assert archs and all(re.fullmatch(r"\d{2,3}[af]?(-real|-virtual)?", a) for a in archs), archs  # CMake syntax
        assert set(data["warp_sizes"].values()) == {32}
        if GPU:
            assert _cuda_build_covers(archs, torch.cuda.get_device_capability(0)), (archs, torch.cuda.get_device_capability(0))
    elif data["built_backend"] == "hip":
        assert archs and all(re.fullmatch(r"gfx[0-9a-f]{3,4}(:[a-z+-:]+)?", a) for a in archs), archs
        if GPU:
            assert torch.cuda.get_device_properties(0).gcnArchName.split(":")[0] in [a.split(":")[0] for a in archs]
    cpu = data["devices"][0]
    assert cpu["device"] == "cpu" and cpu["backend"] == "reference"
    assert set(data["ops"]) >= {"rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "silu_and_mul", "gelu_and_mul"}
    assert all(where["cpu"] == "reference" for where in data["ops"].values())
    if GPU:
        assert data["devices"][1]["backend"] == data["built_backend"]


def _cuda_build_covers(archs, capability):
    """Whether CMake architectures `archs` hold code a GPU of `capability` runs: machine code of its major
    version and a minor version at most its own, or PTX (a virtual architecture) of at most its version."""
    major, minor = capability
    for arch in archs:
        number, _, kind = arch.partition("-")
        a_major, a_minor = int(number.rstrip("af")[:-1]), int(number.rstrip("af")[-1])
        if kind != "virtual" and a_major == major and a_minor <= minor and not number.endswith(("a", "f")):
            return True
        if kind != "real" and (a_major, a_minor) <= (major, minor):
            return True
    return False


def test_cuda_build_covers():
    assert _cuda_build_covers(["80-real", "90"], (9, 0)) and _cuda_build_covers(["90-real"], (9, 0))
    assert _cuda_build_covers(["80-real"], (8, 6)) and _cuda_build_covers(["80"], (12, 0))
    assert not _cuda_build_covers(["80-real"], (9, 0)) and not _cuda_build_covers(["90-real"], (8, 0))
    assert not _cuda_build_covers(["90-virtual"], (8, 9)) and not _cuda_build_covers(["100-real"], (12, 0))


def test_warp_size_by_architecture():
    from flashkern.info import _arch_warp_size

    assert [_arch_warp_size(a) for a in ("90", "80-real", "gfx90a", "gfx942", "gfx1030", "gfx1100")] == [
        32, 32, 64, 64, 32, 32,
    ]


def test_cli_info_and_check():
    info = run_cli("info", "--json")
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["built_backend"] == flashkern.info()["built_backend"]
    text = run_cli("info")
    assert "devices:" in text.stdout and "rmsnorm" in text.stdout
    assert "modules: _C (" in text.stdout and "_emulate (" in text.stdout and "_emulate_wave64 (" in text.stdout
    check = run_cli("check")
    assert check.returncode == 0, check.stdout + check.stderr
    last = check.stdout.strip().splitlines()[-1]
    assert last.endswith("passed, 0 failed") and not last.startswith("0 passed")


def test_check_covers_every_family():
    rows = flashkern.check(devices=["cpu"])
    check_module = importlib.import_module("flashkern.check")
    assert {r["family"] for r in rows} == set(check_module.FAMILIES)
    assert {"norms", "activations", "rope", "merge", "decode", "prefill", "cascade", "softmax", "renorm", "sampling",
            "speculative", "optimizer", "prefix cache", "kv compression", "page", "tensor parallel",
            "batch invariance"} <= set(check_module.FAMILIES)
    assert all(r["passed"] for r in rows), [r for r in rows if not r["passed"]]


# CI time: every family's kernels run on every launcher in test_emulated_kernels.py and the family tests' emulate
# cases; the main job under emulate takes EMULATED_FAMILIES of its families a commit, rotating (conftest.ROTATION)
EMULATED_FAMILIES = 4


def test_cli_check_under_emulate():
    """The main job through the kernels' own code: a rotating share of the families, passed."""
    families = sorted(importlib.import_module("flashkern.check").FAMILIES)
    chosen = [families[(ROTATION + i) % len(families)] for i in range(EMULATED_FAMILIES)]
    out = run_cli("check", "--backend", "emulate", "--json", *(a for f in chosen for a in ("--family", f)))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr
    rows = json.loads(out.stdout)
    assert {r["backend"] for r in rows} == {"emulate"} and all(r["passed"] for r in rows)
    assert {r["family"] for r in rows} == set(chosen)


def test_check_catches_a_wrong_answer(monkeypatch, capsys):
    """check() compares, it does not just run: a broken op shows up as FAIL, and the command exits 1; an op
    that raises is a failed row, not an aborted check."""
    check_module = importlib.import_module("flashkern.check")  # flashkern.check is the function

    monkeypatch.setattr(check_module.norm, "rmsnorm", lambda x, w, **kw: ref.rmsnorm(x, w) * 1.01)
    rows = flashkern.check(devices=["cpu"], dtypes=(torch.float32,))
    failed = {r["op"] for r in rows if not r["passed"]}
    assert failed == {"rmsnorm"}
    from flashkern import cli

    assert cli.main(["check", "--family", "norms", "--device", "cpu"]) == 1
    assert "FAIL" in capsys.readouterr().out

    def broken(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(check_module.sampling, "softmax", broken)
    rows = flashkern.check(devices=["cpu"], dtypes=(torch.float32,), families=["softmax", "merge"])
    assert [r["error"] for r in rows if not r["passed"]] == ["RuntimeError: planted"]
    assert any(r["family"] == "merge" and r["passed"] for r in rows)


@pytest.mark.parametrize("args,message", [
    (["check", "--backend", "bogus"], "FLASHKERN_BACKEND must be one of"),
    (["check", "--family", "nonsense"], "invalid choice: 'nonsense'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "the following arguments are required"),
    (["check", "--device", "nodevice"], "--device nodevice"),
])
def test_cli_errors_are_one_line(args, message):
    out = run_cli(*args)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_every_subcommand_has_help():
    for command in ("info", "check"):
        out = run_cli(command, "--help")
        assert out.returncode == 0 and "--json" in out.stdout and "--backend" in out.stdout
    assert "--family" in run_cli("check", "--help").stdout


def test_forced_backend_from_environment(monkeypatch):
    env = {**os.environ, "FLASHKERN_BACKEND": "reference"}
    out = run_cli("info", "--json", env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["forced_backend"] == "reference"
    env["FLASHKERN_BACKEND"] = "nonsense"
    bad = run_cli("info", env=env)
    assert bad.returncode == 2 and "FLASHKERN_BACKEND must be one of" in bad.stderr and "Traceback" not in bad.stderr


def test_reference_is_used_for_gpu_tensors_when_no_kernels(monkeypatch):
    """A GPU tensor with a build that has no kernels for it falls back to the reference quietly."""
    monkeypatch.setattr(_backend, "kernels_usable", lambda: False)
    assert _backend.use_reference(torch.device("cuda", 0))
    assert _backend.backend_for(torch.device("cuda", 0)) == "reference"
    assert not _backend.use_reference(torch.device("cpu"))


@requires_gpu
def test_forced_reference_on_gpu():
    x, w = rand((37, 769), torch.bfloat16, "cuda"), rand((769,), torch.bfloat16, "cuda", seed=1)
    previous = flashkern.set_backend("reference")
    try:
        assert flashkern.info()["devices"][1]["backend"] == "reference"
        assert_close(flashkern.rmsnorm(x, w), ref.rmsnorm(x.double(), w.double()))
    finally:
        flashkern.set_backend(previous)


def test_rocm_device_details_from_hip_python_or_torch(monkeypatch):
    """On ROCm, info() reports gcnArchName, wavefront size and CUs (HIP Python when installed, else
    torch) and which kernel width runs. Checked here with stand-ins for both sources."""
    import sys
    import types

    from flashkern.info import _rocm_details

    props = types.SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-", warp_size=64, multi_processor_count=304)
    monkeypatch.setitem(sys.modules, "hip", None)  # HIP Python absent: torch's properties
    assert _rocm_details(0, props) == {"arch": "gfx942:sramecc+:xnack-", "warp_size": 64, "multiprocessors": 304,
                                       "source": "torch", "kernels": "wave64"}
    hip_props = types.SimpleNamespace(gcnArchName=b"gfx1100", warpSize=32, multiProcessorCount=48)
    fake_hip = types.SimpleNamespace(
        hipError_t=types.SimpleNamespace(hipSuccess=0), hipGetDeviceProperties=lambda i: (0, hip_props)
    )
    monkeypatch.setitem(sys.modules, "hip", types.SimpleNamespace(hip=fake_hip))
    details = _rocm_details(0, props)
    assert details["source"] == "hip-python" and details["arch"] == "gfx1100" and details["kernels"] == "wave32"


@requires_gpu
def test_info_on_this_gpu():
    """The build's description on the GPU itself (`pytest -m gpu` selects this one): its architectures cover it."""
    test_info_describes_the_build()
