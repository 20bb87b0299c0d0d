"""scripts/torch_choice.sh, which picks the torch build scripts/setup.sh installs, against stubbed probes:
commands on PATH (nvcc, nvidia-smi) and device files under FLASHKERN_PROBE_ROOT (/proc/driver/nvidia,
/dev/kfd); FLASHKERN_TORCH overrides them."""

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "torch_choice.sh"
BASH = shutil.which("bash")


def choose(tmp_path, commands=(), files=(), **env):
    bin_dir, root = tmp_path / "bin", tmp_path / "root"
    bin_dir.mkdir(exist_ok=True)
    for name in commands:
        (bin_dir / name).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / name).chmod(0o755)
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    run = subprocess.run([BASH, str(SCRIPT)], capture_output=True, text=True, timeout=60,
                         env={"PATH": str(bin_dir), "CUDA_HOME": str(tmp_path / "no-cuda"),
                              "FLASHKERN_PROBE_ROOT": str(root), **env})
    return run.returncode, run.stdout.strip(), run.stderr


@pytest.mark.parametrize("commands,files,expected", [
    (["nvcc"], [], "cuda"),
    (["nvidia-smi"], [], "cuda"),
    ([], ["proc/driver/nvidia/version"], "cuda"),
    (["nvcc", "hipcc"], ["dev/kfd"], "cuda"),  # NVIDIA first
    (["hipcc"], ["dev/kfd"], "rocm"),
    ([], ["dev/kfd"], "rocm"),
    (["hipcc"], [], "cpu"),  # hipcc alone (setup.sh installs it for compile checks) is no AMD GPU
    ([], [], "cpu"),
])
def test_probes(tmp_path, commands, files, expected):
    assert choose(tmp_path, commands, files) == (0, expected, "")


def test_override(tmp_path):
    assert choose(tmp_path, ["nvcc"], FLASHKERN_TORCH="cpu")[:2] == (0, "cpu")
    assert choose(tmp_path, [], FLASHKERN_TORCH="rocm")[:2] == (0, "rocm")
    code, _, err = choose(tmp_path, [], FLASHKERN_TORCH="metal")
    assert code == 2 and "FLASHKERN_TORCH must be cuda, rocm, cpu or auto, got 'metal'" in err


def test_cuda_home(tmp_path):
    (tmp_path / "cuda" / "bin").mkdir(parents=True)
    (tmp_path / "cuda" / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (tmp_path / "cuda" / "bin" / "nvcc").chmod(0o755)
    assert choose(tmp_path, CUDA_HOME=str(tmp_path / "cuda"))[:2] == (0, "cuda")
