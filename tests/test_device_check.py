"""A dry run of bench/device_check.sh against a faked GPU (tests/device_check_fake/): torch reports an sm_90
device with no driver behind it, the build returns at once, pytest only collects, compute-sanitizer is a
logger. What is checked is the script's control flow: the build gets the backend and the architecture, the
`-m gpu` and sanitizer selections parse and reach every kernel family, the budget holds (a hung step is
stopped with SIGINT and the summary still comes), a device that refuses compute-sanitizer is skipped with a
note, and OUT holds at most 8 files."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAKE = ROOT / "tests" / "device_check_fake"
# One test module per kernel family: the sanitizer subset must reach each with a GPU case
FAMILIES = {"test_norm.py", "test_act_and_mul.py", "test_rope.py", "test_attention_state.py", "test_decode.py",
            "test_cascade.py", "test_prefill.py", "test_sampling.py", "test_speculative.py", "test_optim.py",
            "test_page.py"}

pytestmark = pytest.mark.skipif(shutil.which("timeout") is None or shutil.which("git") is None,
                                reason="needs coreutils' timeout and git")


def dry_run(tmp_path, mode="check", budget=540, **env):
    """Runs the script on a copy of the repository (its build directory is the copy's) with the fakes; returns
    (seconds, output, summary, the fakes' call log as dicts, the files in OUT)."""
    repo = tmp_path / "repo"
    files = [] if repo.exists() else subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, repo / f)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "python3"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE / "python.py"}" "$@"\n')
    shim.chmod(0o755)
    shutil.copy2(FAKE / "compute-sanitizer", bin_dir / "compute-sanitizer")
    out, log = tmp_path / "out", tmp_path / "calls.jsonl"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": str(shim),
           "FAKE_REAL_PYTHON": sys.executable, "FAKE_LOG": str(log), "FLASHKERN_CHECK_BUDGET_S": str(budget),
           "FLASHKERN_COMMIT": "dry-run", **env}
    start = time.time()
    run = subprocess.run(["bash", str(repo / "bench" / "device_check.sh"), str(out), mode], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=budget + 120)
    seconds = time.time() - start
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    return seconds, run.stdout + run.stderr, summary, calls, sorted(p.name for p in out.iterdir())


def by_step(calls, step):
    return [c for c in calls if c.get("step") == step]


def test_check(tmp_path):
    seconds, output, summary, calls, files = dry_run(tmp_path)
    assert summary and summary in output, output
    # the build: this GPU's architecture only, no emulator modules, every core
    (build,) = by_step(calls, "build")
    assert build["env"]["FLASHKERN_BUILD_BACKEND"] == "cuda"
    assert build["env"]["FLASHKERN_CUDA_ARCHS"] == "90-real"
    assert build["env"]["FLASHKERN_BUILD_EMULATE"] == "0" and build["env"]["MAX_JOBS"] == str(os.cpu_count())
    # the GPU tests: -m gpu, in parallel, with a per-test limit and JUnit XML; only cuda cases and GPU-only tests
    (tests,) = by_step(calls, "tests")
    assert tests["rc"] == 0, tests["stderr"]
    args = tests["args"]
    assert args[args.index("-m") + 1] == "gpu" and "-n" in args and "--timeout" in args
    assert any(a.startswith("--junitxml=") for a in args)
    ids = tests["collected"]
    assert len(ids) > 500
    assert not any("[cpu" in i or "emulate" in i for i in ids)
    assert {i.split("::")[0].split("/")[-1] for i in ids} >= FAMILIES | {"test_backend.py", "test_validation.py"}
    assert "tests/test_prefill.py::test_cuda_graph_replay_after_replan" in ids
    # the sanitizer: a probe first, then memcheck (caching allocator off) and racecheck over a small subset
    sanitizer = by_step(calls, "compute-sanitizer")
    assert [(c["tool"], c["probe"]) for c in sanitizer] == [("memcheck", True), ("memcheck", False), ("racecheck", False)]
    assert all(c["no_caching"] == "1" for c in sanitizer[1:])
    subsets = by_step(calls, "sanitizer")
    assert len(subsets) == 2 and all(s["rc"] == 0 for s in subsets), [s["stderr"] for s in subsets]
    subset = subsets[0]["collected"]
    assert {i.split("::")[0].split("/")[-1] for i in subset} == FAMILIES
    assert 10 <= len(subset) <= 60 and set(subset) <= set(ids)
    # the summary and the files
    for name in ("build", "tests", "memcheck", "racecheck"):
        assert any(line.split()[:2] == [name, "ok"] for line in summary.splitlines()), summary
    assert "Faked H200" in summary and "cuda 90" in summary and "dry-run" in summary
    assert set(files) <= {"summary.txt", "build.log", "check.log", "tests.xml"} and len(files) <= 8


def test_budget_cuts_a_hung_step_with_sigint(tmp_path):
    # the steps before (the fake build and probe, four torch imports: 3 s here idle) must end within budget - 45 s
    # (the tests step needs 20 s after the 15 s grace and 10 s margin): room for a loaded 2-core machine
    budget = 100
    seconds, output, summary, calls, files = dry_run(tmp_path, budget=budget, FAKE_SLEEP_TESTS="1000")
    assert seconds < budget + 10, output
    (tests,) = by_step(calls, "tests")
    assert tests["interrupted_after"] > 10  # pytest got SIGINT, so it could still write its summary and XML
    assert any(line.split()[:1] == ["tests"] and line.split()[1].startswith("cut:") for line in summary.splitlines()), summary
    assert "3 passed" in summary  # the step's own summary line, printed after the interrupt
    assert any(line.split()[:2] == ["memcheck", "skipped:budget"] for line in summary.splitlines()), summary


def test_device_that_refuses_the_sanitizer(tmp_path):
    _, output, summary, calls, _ = dry_run(tmp_path, FAKE_SANITIZER="refuse")
    assert "refuses compute-sanitizer" in summary, output
    assert len(by_step(calls, "compute-sanitizer")) == 1 and not by_step(calls, "sanitizer")


def test_bench_rebuilds_only_a_changed_tree(tmp_path):
    _, output, summary, calls, files = dry_run(tmp_path, mode="bench")
    (bench,) = by_step(calls, "bench")
    assert bench["rc"] == 0, bench["stderr"]
    compiled = ["torch.compile" in i for i in bench["collected"]]
    assert any(compiled) and compiled == sorted(compiled), "torch.compile rows last"
    assert not by_step(calls, "tests") and len(files) <= 8
    assert len(by_step(calls, "build")) == 1
    (tmp_path / "repo" / "python" / "flashkern.egg-info").mkdir()  # what pip leaves in the tree is not a change
    (tmp_path / "repo" / "python" / "flashkern.egg-info" / "SOURCES.txt").write_text("setup.py\n")
    dry_run(tmp_path, mode="bench")  # the same tree again: no build
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(by_step(calls, "build")) == 1 and len(by_step(calls, "bench")) == 2
    with open(tmp_path / "repo" / "csrc" / "cuda" / "rmsnorm.cu", "a") as f:
        f.write("// changed\n")
    dry_run(tmp_path, mode="bench")  # a changed source: built again
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(by_step(calls, "build")) == 2
