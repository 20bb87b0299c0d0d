"""The static performance report: for the row kernels' benchmarked instantiations (KERNELS: rmsnorm, fused add,
silu/gelu_tanh_and_mul; attention is not in it yet), what their sm_90 and sm_90a SASS says about their speed, read
without a GPU (bench/sass.py).

    python -m bench.static            compile (nvcc -Xptxas -v, sm_90 and sm_90a), print the table
    python -m bench.static --write    the same, into docs/benchmarks.md between its "static report" markers

Per kernel: registers, spill bytes, static shared memory, resident blocks and warps on an H100/H200 SM (from the
registers, the block the benchmarked shape launches and shared memory), and for its steady loop (the loop with
the most 16-byte loads; the whole function where there is no loop), along the shortest path through a pass that
runs what the shape needs (Kernel.needs: its 16-byte loads and stores, a reduction's shuffles and barrier): the
instruction mix, the 16-byte loads a thread issues before it uses the first (in flight), and instructions per
element a thread handles (row kernels) or per HMMA (attention tiles). It is static: instructions as laid out,
not as issued; no timing is modelled. tests/test_kernel_build.py holds the figures to GOALS on every CI run.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench import sass

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- static report: begin (python -m bench.static --write) -->", "<!-- static report: end -->"


@dataclass(frozen=True)
class Kernel:
    """One benchmarked instantiation: `name` (the demangled kernel, exactly) in csrc/cuda/`source`.cu, launched in
    blocks of `threads` at the benchmarked `shape`, each thread handling `elements` elements a pass of the steady loop
    (0: an attention tile, counted per HMMA). `needs`: the instructions the shape must run in a pass (its 16-byte
    loads; a reduction across warps: a warp's shuffles and a barrier): what is counted is the shortest path through
    the pass that runs them (sass.main_path)."""
    label: str
    shape: str
    source: str
    name: str
    threads: int
    elements: int
    needs: tuple  # ((kind, count), ...)
    by: str = "LDG.128"  # what picks the steady loop: the loop with the most


# The launched block: rmsnorm's is the row's 16-byte vectors over the vectors a thread holds (8192 bf16 columns =
# 1024 vectors: 4 a thread, 256 threads; fused, 2 a thread, 512); act_and_mul's is kActThreads, one vector a thread;
# the attention kernels' is their launch bound (TileShape::kThreads, decode's 128). What a pass needs: rmsnorm x and
# the weight, 4 vectors each, and 4 stores of y (fused: x, the residual and the weight, 2 each; stores of the
# residual and y, 2 each) and the row's sum over 8 (16) warps: 5 shuffles and a barrier at least; act_and_mul one
# vector of each half and one store.
KERNELS = [
    Kernel("rmsnorm", "32768 x 8192 bf16", "rmsnorm",
           "void fk::rmsnorm_kernel<32, fk::bf16_t, fk::bf16_t, 8, 4, false>(fk::RmsnormParams, fk::RowPlan)", 256, 32,
           (("LDG.128", 8), ("STG.128", 4), ("SHFL", 5), ("BAR", 1))),
    Kernel("fused_add_rmsnorm", "32768 x 8192 bf16", "rmsnorm",
           "void fk::rmsnorm_kernel<32, fk::bf16_t, fk::bf16_t, 8, 2, true>(fk::RmsnormParams, fk::RowPlan)", 512, 16,
           (("LDG.128", 6), ("STG.128", 4), ("SHFL", 5), ("BAR", 1))),
    Kernel("silu_and_mul", "32768 x 2·28672 bf16", "act_and_mul",
           "void fk::act_and_mul_kernel<fk::bf16_t, (fk::Activation)0, 8>(fk::ActAndMulParams, fk::ActPlan)", 256, 8,
           (("LDG.128", 2), ("STG.128", 1))),
    Kernel("gelu_tanh_and_mul", "32768 x 2·28672 bf16", "act_and_mul",
           "void fk::act_and_mul_kernel<fk::bf16_t, (fk::Activation)2, 8>(fk::ActAndMulParams, fk::ActPlan)", 256, 8,
           (("LDG.128", 2), ("STG.128", 1))),
]

# What CI holds each figure to (tests/test_kernel_build.py): the goals where met; where a goal is not met
# yet, today's figure as the bound (a regression fails) and the goal beside it.
GOALS = {  # label: {figure: (op, bound, the goal where the bound is not it yet)}
    "rmsnorm": {"registers": ("<=", 64, None), "in_flight": (">=", 4, None), "spill": ("<=", 0, None)},
    "fused_add_rmsnorm": {"registers": ("<=", 64, None), "in_flight": (">=", 4, None), "spill": ("<=", 0, None)},
    "silu_and_mul": {"per_element": ("<=", 33, "<= 8"), "in_flight": (">=", 2, ">= 4"), "spill": ("<=", 0, None)},
}


@dataclass
class Figures:
    registers: int
    spill: int
    shared: int
    blocks: int
    warps: int
    loop: bool  # a steady loop was found (else: the whole function)
    mix: dict
    in_flight: int
    per_element: float  # instructions per element (row kernels) or per HMMA (attention)


def figures(kernel, sass_text, ptxas_log, arch):
    """The Figures of `kernel` from cuobjdump -sass text and ptxas -v output holding it for `arch` ('sm_90')."""
    functions = sass.parse_sass(sass_text)
    names = sass.demangle(functions)
    mangled = [m for m, d in names.items() if d == kernel.name]
    if not mangled:
        raise LookupError(f"{kernel.label}: no {kernel.name} in the {arch} SASS of {kernel.source}")
    body = functions[mangled[0]]
    resources = sass.ptxas_resources(ptxas_log).get((mangled[0], arch))
    if resources is None:
        raise LookupError(f"{kernel.label}: no ptxas report for {kernel.name} on {arch}")
    loop = sass.steady_loop(body, by=kernel.by)
    counted = sass.main_path(loop if loop is not None else body, dict(kernel.needs), loop=loop is not None)
    if counted is None:
        raise LookupError(f"{kernel.label}: no path through the {'loop' if loop else 'body'} of {kernel.name}")
    counts = sass.mix(counted)
    per = kernel.elements if kernel.elements else max(1, counts.get("HMMA", 0))
    blocks, warps = sass.occupancy(resources.registers, kernel.threads, resources.shared)
    return Figures(resources.registers, resources.spill_stores + resources.spill_loads, resources.shared, blocks, warps,
                   loop is not None, counts, sass.wide_loads_in_flight(counted), counts["total"] / per)


def unmet(label, f):
    """[(figure, value, op, bound)] of `label`'s GOALS that f does not meet."""
    ops = {"<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b}
    value = {"registers": f.registers, "in_flight": f.in_flight, "per_element": f.per_element, "spill": f.spill}
    return [(k, value[k], op, bound) for k, (op, bound, _) in GOALS.get(label, {}).items()
            if not ops[op](value[k], bound)]


# ---------------------------------------------------------------- compiling


def nvcc():
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    return str(Path(home) / "bin" / "nvcc")


def compile_object(source, arch, out):
    """csrc/cuda/<source>.cu compiled as the library is (-O3, -DNDEBUG) for `arch` ('90' or '90a') SASS alone;
    returns (cuobjdump -sass text, ptxas -v output)."""
    obj = out / f"{source}.sm_{arch}.o"
    launcher = [ccache] if (ccache := shutil.which("ccache")) else []  # CI compiles these on every run
    done = subprocess.run([*launcher, nvcc(), "-O3", "-DNDEBUG", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}",
                           "-Xptxas=-v", f"-I{ROOT / 'csrc' / 'include'}", "-c", str(ROOT / "csrc" / "cuda" / f"{source}.cu"),
                           "-o", str(obj)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nvcc {source}.cu sm_{arch}:\n{done.stderr[-4000:]}")
    return sass.dump_sass(obj), done.stderr


def compiled(archs, sources, out):
    """{(source, arch): (sass text, ptxas log)}, compiled two at a time."""
    jobs = [(s, a) for a in archs for s in sources]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda job: compile_object(*job, out), jobs))
    return dict(zip(jobs, results))


# ---------------------------------------------------------------- the table


def row(kernel, arch, f):
    m = f.mix
    narrow = sum(v for k, v in m.items() if k.startswith("LDG.") and k != "LDG.128")
    per = f"{f.per_element:.1f}" + ("/HMMA" if not kernel.elements else "")
    goals = GOALS.get(kernel.label, {})
    open_goals = "; ".join(f"{k} {goal}" for k, (_, _, goal) in goals.items() if goal)
    where = "loop" if f.loop else "body"
    return (f"| {kernel.label} | {kernel.shape} | {arch} | {f.registers} | {f.spill} | {f.shared} | {kernel.threads} | "
            f"{f.blocks} / {f.warps} | {where} {m['total']} | {m.get('LDG.128', 0)} / {narrow} | {m.get('STG.128', 0)} | "
            f"{m.get('MUFU', 0)} | {m.get('SHFL', 0)} | {m.get('BAR', 0)} | {m.get('BRA', 0)} / {m.get('BSSY', 0)} | "
            f"{m.get('LDL', 0) + m.get('STL', 0)} | {f.in_flight} | {per} | "
            f"{open_goals or ('met' if goals else 'none set')} |")


HEADER = ("| kernel | shape | arch | regs | spill B | smem B | block | blocks / warps an SM | instructions | LDG.128 / "
          "narrower | STG.128 | MUFU | SHFL | BAR | BRA / BSSY | LDL+STL | 16-byte loads in flight | instructions an "
          "element | open goals |\n" + "|---" * 19 + "|")


def table(results):
    lines = [HEADER]
    for kernel in KERNELS:
        for arch in ("sm_90", "sm_90a"):
            text, log = results[(kernel.source, arch[3:])]
            lines.append(row(kernel, arch, figures(kernel, text, log, arch)))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args(argv)
    if sass.disassembler() is None:
        sys.exit(sass.MISSING_DISASSEMBLER)
    with tempfile.TemporaryDirectory() as tmp:
        results = compiled(["90", "90a"], sorted({k.source for k in KERNELS}), Path(tmp))
    text = table(results)
    version = subprocess.run([nvcc(), "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    text += f"\n\n{version}; occupancy for {sass.HOPPER.name}."
    print(text)
    if args.write:
        doc = DOC.read_text()
        if BEGIN not in doc or END not in doc:
            sys.exit(f"no static report markers in {DOC}")
        head, rest = doc.split(BEGIN, 1)
        DOC.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    main()
