"""The prefix cache: host time of plan_cascade and plan_decode for serving batches of 256 / 1K / 4K
requests (cases.prefix_cache_batch: a few long system prompts, few-shot blocks, many short
suffixes), and one decode step of the same batch through the planned cascade beside the flat
decode table (on a GPU: device time; the cascade reads each shared prompt once)."""

import time

import pytest

from . import cases
from .harness import DEVICE, bench_op, clock


@pytest.mark.benchmark(group="prefix_cache_plan")
@pytest.mark.parametrize("planner", ["plan_cascade", "plan_decode"])
@pytest.mark.parametrize("requests", cases.prefix_cache_requests())
def test_plan(benchmark, planner, requests):
    """Host µs per plan (the timer is the device clock on a GPU: no device work runs in between)."""
    cache, batch = cases.prefix_cache_batch(requests)
    plan = getattr(cache, planner)
    start = time.perf_counter()
    result = plan(batch)
    calls = max(1, int(0.05 / max(time.perf_counter() - start, 1e-6)))  # rounds of about 50 ms

    def run():
        for _ in range(calls):
            plan(batch)

    clock.scale = 1.0 / calls
    try:
        benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    finally:
        clock.scale = 1.0
    stats = getattr(benchmark, "stats", None)
    median_us = stats.stats.median * 1e6 if stats is not None and not getattr(benchmark, "disabled", False) else None
    benchmark.extra_info.update(op="prefix_cache_plan", provider=planner, shape=[requests], dtype="-",
                                timing="host", median_us=median_us, host_us=median_us, device=DEVICE,
                                levels=len(getattr(result, "qo_indptr_arr", [None])),
                                kv_tokens=cache.kv_tokens_read(result))


@pytest.mark.benchmark(group="prefix_cache_decode")
@pytest.mark.parametrize("provider", cases.PREFIX_DECODE, ids=lambda p: p.name)
@pytest.mark.parametrize("requests", cases.prefix_decode_requests())
@pytest.mark.parametrize("dtype", cases.DTYPES[:1], ids=str)
def test_decode_step(benchmark, provider, requests, dtype):
    bench_op(benchmark, op="prefix_cache_decode", provider=provider, shape=(requests,), dtype=dtype,
             bytes_moved=cases.prefix_decode_bytes(requests, dtype), make_inputs=cases.prefix_decode_inputs(requests, dtype))
