"""Device timing for pytest-benchmark, and the bookkeeping every benchmark shares.

How a GPU benchmark is timed (bench_op):
  * inputs: enough independent input sets that one pass over them moves at least 4x the L2 size
    (up to MAX_SETS), so each launch reads from HBM, not from the previous launch's L2 lines;
  * a CUDA graph (HIP graph on ROCm) of K launches cycling through the sets, captured after a
    warm-up (compiles, autotuning, first-touch allocations happen outside it);
  * pytest-benchmark times graph replays with `clock` (--benchmark-timer bench.harness.clock): it
    records a device event and synchronizes only at the edges of a timed round, never per launch,
    and scales by 1/K, so its statistics are device seconds per launch;
  * the host cost of one eager call (Python + dispatch + launch) is timed separately, without any
    synchronization, and reported as host_us.
On the CPU the same code runs eagerly with a wall clock: a smoke check of the benchmark code.
"""

import math
import os
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
MAX_SETS = 256  # input sets rotated through; graphs hold K >= n_sets launches
MIN_GRAPH_BYTES = 2**28  # aim for >= 256 MB moved per graph replay (or MAX_LAUNCHES launches)
MAX_LAUNCHES = 512


class DeviceClock:
    """A pytest-benchmark timer: device time in seconds (GPU) or wall time (CPU), times `scale`."""

    def __init__(self):
        self.scale = 1.0
        self._origin = None

    def __call__(self):
        if not GPU:
            return time.perf_counter() * self.scale
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        event.synchronize()
        if self._origin is None:
            self._origin = event
        return self._origin.elapsed_time(event) * 1e-3 * self.scale


clock = DeviceClock()


# ---------------------------------------------------------------- the machine


def _git_commit():
    if os.environ.get("FLASHKERN_COMMIT"):
        return os.environ["FLASHKERN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip() or None
    except OSError:
        return None


def _driver_version():
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return None


def measure_copy_bandwidth(nbytes=2**30, repeats=20):
    """Bytes read + written per second by a device-to-device copy of `nbytes`, this device, this run."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    if GPU:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) * 1e-3
    else:
        t0 = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    return 2 * nbytes * repeats / seconds


@dataclass
class Machine:
    name: str
    peak_bytes_per_s: float | None  # from the memory clock and bus width the driver reports
    copy_bytes_per_s: float
    l2_bytes: int
    info: dict = field(default_factory=dict)


_machine = None


def machine() -> Machine:
    global _machine
    if _machine is not None:
        return _machine
    info = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": torch.version.hip,
        "commit": _git_commit(),
        "flashkern_backend": None,
    }
    try:
        import flashkern

        info["flashkern_backend"] = flashkern.info()["built_backend"]
    except Exception as e:  # the benchmark of the peers still runs
        info["flashkern_backend"] = f"unavailable: {e}"
    if GPU:
        p = torch.cuda.get_device_properties(0)
        mem_clock_khz, bus_bits = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
        peak = 2 * mem_clock_khz * 1e3 * bus_bits / 8 if mem_clock_khz and bus_bits else None
        l2 = getattr(p, "L2_cache_size", 0) or 50 * 2**20
        info.update(
            gpu=p.name,
            arch=getattr(p, "gcnArchName", None) or f"sm_{p.major}{p.minor}",
            multiprocessors=p.multi_processor_count,
            driver=_driver_version(),
            l2_bytes=l2,
            memory_clock_khz=mem_clock_khz,
            memory_bus_bits=bus_bits,
        )
        name = p.name
        copy_bw = measure_copy_bandwidth()
    else:
        peak, l2, name = None, 32 * 2**20, "cpu"
        copy_bw = measure_copy_bandwidth(nbytes=2**26, repeats=3)
    info.update(peak_gbps=peak and peak / 1e9, copy_gbps=copy_bw / 1e9)
    _machine = Machine(name, peak, copy_bw, l2, info)
    return _machine


# ---------------------------------------------------------------- providers


MISSING = {}  # provider -> why it did not run, for the report


@dataclass
class Provider:
    """One implementation of an op: `make(inputs) -> callable` for one input set, or None when absent."""

    name: str
    make: Callable
    requires: str | None = None  # the module a peer needs
    gpu_only: bool = False

    def missing(self):
        if self.gpu_only and not GPU:
            return "needs a GPU"
        if self.requires:
            try:
                __import__(self.requires)
            except Exception as e:  # ImportError, or a broken install
                return f"{self.requires} not importable ({type(e).__name__}: {e})"[:200]
        return None


# ---------------------------------------------------------------- timing one case


def _input_sets(make_inputs, bytes_per_call, l2_bytes):
    n_sets = max(1, min(MAX_SETS, math.ceil(4 * l2_bytes / max(bytes_per_call, 1)))) if GPU else 2
    return [make_inputs(seed) for seed in range(n_sets)]


def bench_op(benchmark, *, op, provider, shape, dtype, bytes_moved, make_inputs, flops=None):
    """Time `provider` on inputs from make_inputs(seed) and record GB/s, % of peak and % of copy."""
    reason = provider.missing()
    if reason:
        MISSING[provider.name] = reason
        import pytest

        pytest.skip(f"{provider.name} missing: {reason}")
    m = machine()
    sets = _input_sets(make_inputs, bytes_moved, m.l2_bytes)
    calls = [provider.make(*inputs) for inputs in sets]
    passes = math.ceil(MIN_GRAPH_BYTES / max(bytes_moved * len(calls), 1)) if GPU else 1
    launches = min(len(calls) * passes, max(MAX_LAUNCHES, len(calls)))

    for call in calls:  # warm-up: compilation, autotuning, allocator
        call()
    host_us = _host_us_per_call(calls)

    run, method = _graph_or_loop(calls, launches)
    clock.scale = 1.0 / launches
    try:
        benchmark.pedantic(run, rounds=10 if GPU else 3, iterations=1, warmup_rounds=1)
    finally:
        clock.scale = 1.0

    stats = getattr(benchmark, "stats", None)
    median_s = stats.stats.median if stats is not None and not getattr(benchmark, "disabled", False) else None
    extra = {
        "op": op,
        "provider": provider.name,
        "shape": list(shape),
        "dtype": str(dtype).replace("torch.", ""),
        "bytes": int(bytes_moved),
        "flops": flops,
        "timing": method,
        "launches_per_replay": launches,
        "input_sets": len(sets),
        "rotated_bytes": int(bytes_moved * len(sets)),
        "l2_cold": bytes_moved * len(sets) >= 2 * m.l2_bytes,
        "host_us": host_us,
        "device": m.name,
    }
    if median_s:
        gbps = bytes_moved / median_s / 1e9
        extra.update(
            median_us=median_s * 1e6,
            gbps=gbps,
            pct_peak=100 * gbps * 1e9 / m.peak_bytes_per_s if m.peak_bytes_per_s else None,
            pct_copy=100 * gbps * 1e9 / m.copy_bytes_per_s,
        )
        if flops:
            extra["tflops"] = flops / median_s / 1e12
    benchmark.extra_info.update(extra)
    return extra


def _host_us_per_call(calls, n=50):
    """Host time to issue one call, with no synchronization in the loop."""
    if GPU:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        calls[i % len(calls)]()
    t1 = time.perf_counter()
    if GPU:
        torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def _graph_or_loop(calls, launches):
    """A callable running `launches` calls: one CUDA/HIP graph replay, or (if capture fails) a plain loop."""
    if GPU:
        try:
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                calls[0]()  # side-stream warm-up, as capture requires
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph):
                for i in range(launches):
                    calls[i % len(calls)]()
            graph.replay()
            torch.cuda.synchronize()
            return graph.replay, "graph"
        except Exception as e:  # a provider that cannot be captured is timed in a loop, and says so
            torch.cuda.synchronize()
            method = f"loop ({type(e).__name__})"
    else:
        method = "cpu"

    def loop():
        for i in range(launches):
            calls[i % len(calls)]()

    return loop, method
