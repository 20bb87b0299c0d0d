"""pytest-benchmark set-up for bench/: the device timer, machine facts in the JSON, missing peers."""

from . import harness


def pytest_configure(config):
    # Device time per launch (see harness.py). Set here so every run of bench/ uses it.
    if hasattr(config.option, "benchmark_timer"):
        config.option.benchmark_timer = "bench.harness.clock"


def pytest_benchmark_update_machine_info(config, machine_info):
    m = harness.machine()
    machine_info["flashkern"] = {**m.info, "missing_providers": dict(harness.MISSING), "bench_set": _bench_set()}


def _bench_set():
    from .cases import BENCH_SET

    return BENCH_SET


def pytest_terminal_summary(terminalreporter):
    if harness.MISSING:
        terminalreporter.write_line("providers not run: " + "; ".join(f"{k} ({v})" for k, v in harness.MISSING.items()))


def pytest_collection_modifyitems(config, items):
    """torch.compile rows last: they compile first, so a run cut short by its time limit loses only them."""
    items.sort(key=lambda item: "torch.compile" in item.name)
