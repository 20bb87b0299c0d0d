"""Turn pytest-benchmark JSON files from bench/ into a markdown table and PNG plots.

    python -m bench.report RUN.json [MORE.json ...] --out DIR

writes DIR/bench.md (one table per op: median device time, GB/s, % of peak, % of copy bandwidth,
speedup over the op's baseline, host time per call) and DIR/bench.png (achieved GB/s against bytes
moved for each provider in the sweeps, with the device's peak and measured copy bandwidth as lines,
and the cascade speedups over the same batch decoded without the cascade).
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path


def load(paths):
    """[(machine_info, benchmark)] for every benchmark that recorded extra_info."""
    rows = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        machine = data.get("machine_info", {}).get("flashkern", {})
        for b in data.get("benchmarks", []):
            if b.get("extra_info", {}).get("op"):
                rows.append((machine, b))
    return rows


# The provider each op's rows are compared with ("speedup" column); torch unless named here.
BASELINE = {"cascade": "flashkern (no cascade)", "batch_decode_fp8": "flashkern (16-bit cache)", "decode_kv_scores": "flashkern (decode only)",
            "decode_compressed": "flashkern (uncompressed)", "prefix_cache_decode": "flashkern (plan_decode)",
            "prefix_cache_plan": "plan_decode"}
# Dense fp16/bf16 tensor-core peaks from the vendors' datasheets (TFLOP/s, without sparsity), for
# ops that report FLOPs (prefill attention).
DENSE_16BIT_TFLOPS = {"NVIDIA H200": 989.0, "NVIDIA H100 80GB HBM3": 989.0}


def speedups(items, op):
    """{(shape, dtype, provider): the baseline's median time over the provider's}."""
    base = BASELINE.get(op, "torch")
    base_us = {(tuple(e["shape"]), e["dtype"]): e.get("median_us") for e in items if e["provider"] == base}
    out = {}
    for e in items:
        b = base_us.get((tuple(e["shape"]), e["dtype"]))
        if b and e.get("median_us"):
            out[(tuple(e["shape"]), e["dtype"], e["provider"])] = b / e["median_us"]
    return out


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def markdown(rows, sources):
    lines = ["# flashkern benchmarks", ""]
    machines = {json.dumps(m, sort_keys=True): m for m, _ in rows}
    for m in machines.values():
        lines += [
            f"- device: {m.get('gpu', 'cpu')} ({m.get('arch', '-')}), driver {m.get('driver', '-')}; "
            f"torch {m.get('torch')} (cuda {m.get('torch_cuda')}, hip {m.get('torch_hip')}); "
            f"flashkern {m.get('flashkern_backend')} at commit {m.get('commit')}",
            f"- peak bandwidth {_fmt(m.get('peak_gbps'), '.0f')} GB/s (memory clock x bus width); "
            f"copy bandwidth measured in the same run {_fmt(m.get('copy_gbps'), '.0f')} GB/s; set: {m.get('bench_set')}",
        ]
        if m.get("gpu") is None:  # a run without a GPU: the benchmark code's smoke run, not a measurement
            lines.append("- **CPU smoke run**: flashkern ran its pure-torch reference backend here, not its kernels; "
                         "these numbers check the benchmark code and are no performance claim")
        if m.get("missing_providers"):
            lines.append("- not run: " + "; ".join(f"{k} ({v})" for k, v in sorted(m["missing_providers"].items())))
    lines += [f"- source: {', '.join(str(s) for s in sources)}", ""]

    by_op = defaultdict(list)
    for _, b in rows:
        by_op[(b["extra_info"]["op"], "sweep" in b.get("group", ""))].append(b["extra_info"])
    tensor_peak = next((DENSE_16BIT_TFLOPS[m["gpu"]] for m in machines.values() if m.get("gpu") in DENSE_16BIT_TFLOPS),
                       None)
    for (op, sweep), items in sorted(by_op.items()):
        ratio = speedups(items, op)
        if any(e.get("tflops") for e in items):  # compute-bound: TFLOP/s of the unmasked work first
            lines += [f"## {op}{' (sweep)' if sweep else ''}", "",
                      f"| shape | dtype | provider | median µs | TFLOP/s | % dense 16-bit peak | GB/s | vs torch | "
                      "host µs |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
            for e in sorted(items, key=lambda e: (e["shape"], e["dtype"], e["provider"])):
                speedup = ratio.get((tuple(e["shape"]), e["dtype"], e["provider"]))
                pct = 100 * e["tflops"] / tensor_peak if tensor_peak and e.get("tflops") else None
                lines.append(f"| {tuple(e['shape'])} | {e['dtype']} | {e['provider']} | "
                             f"{_fmt(e.get('median_us'), '.2f')} | {_fmt(e.get('tflops'), '.4g')} | {_fmt(pct, '.0f')} | "
                             f"{_fmt(e.get('gbps'), '.4g')} | {_fmt(speedup, '.2f')}x | {_fmt(e.get('host_us'), '.1f')} |")
            lines.append("")
            continue
        lines += [
            f"## {op}{' (sweep)' if sweep else ''}",
            "",
            f"| shape | dtype | provider | median µs | GB/s | % peak | % copy | vs {BASELINE.get(op, 'torch')} | host µs | timing |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for e in sorted(items, key=lambda e: (e["shape"], e["dtype"], e["provider"])):
            speedup = ratio.get((tuple(e["shape"]), e["dtype"], e["provider"]))
            timing = e["timing"] + ("" if e.get("l2_cold", True) else ", L2-warm")
            lines.append(
                f"| {tuple(e['shape'])} | {e['dtype']} | {e['provider']} | {_fmt(e.get('median_us'), '.2f')} | "
                f"{_fmt(e.get('gbps'), '.4g')} | {_fmt(e.get('pct_peak'), '.0f')} | {_fmt(e.get('pct_copy'), '.0f')} | "
                f"{_fmt(speedup, '.2f')}x | {_fmt(e.get('host_us'), '.1f')} | {timing} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(rows, path):
    """Achieved GB/s against bytes per provider for every swept op (plus cascade speedups when present)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = defaultdict(lambda: defaultdict(list))
    cascade = defaultdict(list)
    peak = copy = None
    cascade_items = [b["extra_info"] for _, b in rows if b["extra_info"]["op"] == "cascade"]
    ratio = speedups(cascade_items, "cascade")
    for m, b in rows:
        e = b["extra_info"]
        peak, copy = m.get("peak_gbps") or peak, m.get("copy_gbps") or copy
        if "sweep" in b.get("group", "") and e.get("gbps"):
            sweeps[f"{e['op']} {e['dtype']}"][e["provider"]].append((e["bytes"], e["gbps"]))
        speedup = ratio.get((tuple(e["shape"]), e["dtype"], e["provider"]))
        if e["op"] == "cascade" and e["provider"] != BASELINE["cascade"] and speedup:
            batch, prefix, suffix = e["shape"]
            cascade[f"{e['provider']} b={batch} suffix={suffix}"].append((prefix, speedup))
    panels = list(sweeps.items()) + ([("cascade", None)] if cascade else [])
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (title, providers) in zip(axes[0], panels):
        if providers is None:
            for provider, points in sorted(cascade.items()):
                ax.plot(*zip(*sorted(points)), marker="o", label=provider)
            ax.set(xscale="log", xlabel="shared prefix length", ylabel="speedup over non-cascade decode", title=title)
        else:
            for provider, points in sorted(providers.items()):
                ax.plot(*zip(*sorted(points)), marker="o", label=provider)
            for value, name, style in ((peak, "peak", "--"), (copy, "copy (measured)", ":")):
                if value:
                    ax.axhline(value, color="gray", linestyle=style, label=f"{name} {value:.0f} GB/s")
            ax.set(xscale="log", xlabel="bytes moved per call", ylabel="GB/s", title=title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", help="pytest-benchmark JSON files (--benchmark-json)")
    parser.add_argument("--out", default=".", help="folder for bench.md and bench.png")
    args = parser.parse_args(argv)
    rows = load(args.json)
    if not rows:
        parser.error("no flashkern benchmarks in " + ", ".join(args.json))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(markdown(rows, args.json))
    plotted = plot(rows, out / "bench.png")
    print(f"wrote {out / 'bench.md'}" + (f" and {out / 'bench.png'}" if plotted else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
