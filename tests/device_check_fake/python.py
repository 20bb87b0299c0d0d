"""The `python3` the dry run of bench/device_check.sh gives the script (PYTHON=this, through a shim): it logs
every call as a JSON line to FAKE_LOG, and
  -m pip install ... .   (the build)   returns at once
  -c "import xdist" / "import pytest_timeout"   succeeds, as on the GPU machine's image
  -m pytest ARGS        collects what ARGS select (--collect-only) on the faked GPU, after checking -n and
                        --timeout are well formed; FAKE_SLEEP_<STEP>=seconds makes a step hang until SIGINT
  anything else         the real python, on the faked GPU
"""

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REAL = os.environ["FAKE_REAL_PYTHON"]
ENV_KEYS = ("FLASHKERN_", "MAX_JOBS", "PYTORCH_", "OMP_")


def log(**entry):
    entry["env"] = {k: v for k, v in os.environ.items() if k.startswith(ENV_KEYS)}
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps(entry) + "\n")


def pytest(args):
    rest, i = [], 0
    while i < len(args):
        if args[i] in ("-n", "--timeout"):
            assert int(args[i + 1]) > 0, args
            i += 2
            continue
        rest.append(args[i])
        i += 1
    step = "bench" if "bench" in rest else "sanitizer" if any(a.startswith("tests/test_") for a in rest) else "tests"
    start = time.time()
    sleep = float(os.environ.get(f"FAKE_SLEEP_{step.upper()}", "0"))
    try:
        time.sleep(sleep)
    except KeyboardInterrupt:
        log(step=step, args=args, interrupted_after=time.time() - start)
        print("!!!!! KeyboardInterrupt !!!!!\n= 3 passed in 1.00s =")
        return 2
    env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rest = [a for a in rest if a != "-q"]  # one -q: collect-only then lists the ids
    run = subprocess.run([REAL, "-m", "pytest", *rest, "--collect-only", "-q"], env=env, capture_output=True, text=True)
    print(run.stdout[-3000:] + run.stderr[-3000:])
    ids = [line for line in run.stdout.splitlines() if "::" in line]
    log(step=step, args=args, rc=run.returncode, collected=ids, stderr=run.stderr[-2000:] + run.stdout[-2000:])
    return run.returncode


def main(args):
    if args[:2] == ["-m", "pip"] and "install" in args and "." in args:
        log(step="build", args=args)
        return 0
    if args[:1] == ["-c"] and args[1].strip() in ("import xdist", "import pytest_timeout"):
        return 0
    if args[:2] == ["-m", "pytest"]:
        return pytest(args[2:])
    env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([REAL, *args], env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
