"""The benchmark suite itself: bench/ runs (its smoke set: CPU providers here, the GPU path where a
GPU is visible), records the numbers the report needs, reports missing peers, and the report
turns its JSON into a markdown table and a plot."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import subprocess_limit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import report  # noqa: E402
OPS = {"rmsnorm", "gemma_rmsnorm", "fused_add_rmsnorm", "rmsnorm_backward", "silu_and_mul", "gelu_and_mul",
       "gelu_tanh_and_mul", "silu_and_mul_backward", "rope", "merge_states", "batch_decode", "batch_decode_fp8", "batch_decode_d512",
       "cascade",
       "prefill",
       "top_k_sampling_from_probs", "top_p_sampling_from_probs", "top_k_top_p_sampling_from_probs",
       "sampling_from_probs", "min_p_sampling_from_probs", "top_k_renorm_probs", "top_p_renorm_probs",
       "top_k_mask_logits", "chain_speculative_sampling", "prefix_cache_decode", "adamw_step", "softmax",
       "decode_kv_scores", "kv_select", "kv_compact", "decode_compressed"}
HOST_OPS = {"prefix_cache_plan": {"plan_cascade", "plan_decode"}}  # host code: µs per call, no bytes


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    # not an xdist worker's variables: pytest-benchmark would take the run for a worker and measure nothing
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},
           "FLASHKERN_BENCH_SET": "smoke", "FLASHKERN_COMMIT": "test-commit"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "bench", f"--benchmark-json={out}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=subprocess_limit(60),
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    assert "providers not run:" in run.stdout  # peers absent here are named, not dropped
    return out


def test_every_op_is_measured_with_bytes_and_bandwidth(bench_json):
    data = json.loads(bench_json.read_text())
    info = data["machine_info"]["flashkern"]
    assert info["commit"] == "test-commit" and info["torch"] and info["copy_gbps"] > 0
    assert info["missing_providers"], "the peers not installed here must be listed"
    extras = [b["extra_info"] for b in data["benchmarks"]]
    assert {e["op"] for e in extras} == OPS | set(HOST_OPS)
    for op, providers in HOST_OPS.items():
        host = [e for e in extras if e["op"] == op]
        assert {e["provider"] for e in host} == providers and all(e["median_us"] > 0 for e in host)
    extras = [e for e in extras if e["op"] not in HOST_OPS]
    for e in extras:
        assert e["bytes"] > 0 and e["median_us"] > 0 and e["host_us"] > 0
        assert abs(e["gbps"] - e["bytes"] / (e["median_us"] * 1e-6) / 1e9) < 1e-6 * e["gbps"]
        assert e["pct_copy"] > 0
    for op in OPS:
        providers = {e["provider"] for e in extras if e["op"] == op}
        baseline = report.BASELINE.get(op, "torch")
        assert {"flashkern", baseline} <= providers, (op, providers)
    assert all(e["prefix_len"] > 0 for e in extras if e["op"] == "cascade")
    assert all(e["flops"] > 0 and e["tflops"] > 0 for e in extras if e["op"] == "prefill")


def test_clock_reports_time_per_launch():
    """pytest-benchmark times a round of K launches with bench.harness.clock scaled by 1/K, so its
    statistics (and --benchmark-compare) are per launch. 40 ms with K = 4 must read about 10 ms."""
    from bench.harness import DeviceClock

    clock = DeviceClock()
    clock.scale = 1 / 4
    start = clock()
    time.sleep(0.04)
    assert 0.009 < clock() - start < 0.02


def test_report_writes_table_and_plot(bench_json, tmp_path):
    run = subprocess.run([sys.executable, "-m", "bench.report", str(bench_json), "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=subprocess_limit(15))
    assert run.returncode == 0, run.stderr
    md = (tmp_path / "bench.md").read_text()
    for op in OPS:
        assert f"## {op}" in md
    assert "| flashkern |" in md and "vs torch" in md and "test-commit" in md and "not run:" in md
    assert "vs flashkern (no cascade)" in md
    assert "TFLOP/s" in md  # prefill is measured in FLOPs of the unmasked work
    gpu = json.loads(bench_json.read_text())["machine_info"]["flashkern"].get("gpu")
    assert ("CPU smoke run" in md) == (gpu is None)  # a CPU run is labelled, not read as a performance claim
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_refuses_a_file_without_benchmarks(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"machine_info": {}, "benchmarks": []}))
    run = subprocess.run([sys.executable, "-m", "bench.report", str(empty)], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode != 0 and "no flashkern benchmarks" in run.stderr
