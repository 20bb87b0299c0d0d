"""The kernels compile for every target, without register spills, with 16-byte global loads.

CMakeLists.txt builds the torch-free kernel library on its own: CUDA for sm_80, sm_90, sm_100 and
sm_120 (ptxas -v report; the PTX for sm_80 and sm_90 read from the objects, which carry it), HIP for gfx90a
(wave64, CDNA) and gfx1030 (wave32, RDNA), keeping each target's device assembly (registers, spills and launch bounds from its
code-object metadata; the MFMA instructions). A test is skipped only where its compiler is absent, and
fails so in CI (conftest.missing_tool).
Also: a CPU-only build of the extension (what a machine without nvcc or ROCm gets) registers and
runs every op.
"""

import functools
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import missing_tool

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import sass, static  # noqa: E402  (the repository's bench/: cuobjdump, SASS, the static report)

ROOT = Path(__file__).resolve().parent.parent
CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
NVCC = CUDA_HOME / "bin" / "nvcc" if (CUDA_HOME / "bin" / "nvcc").exists() else shutil.which("nvcc")
HIPCC = shutil.which("hipcc")
ROW_SOURCES = ["rmsnorm", "act_and_mul", "rope", "merge_states"]  # one template argument is the vector width
SOURCES = ROW_SOURCES + ["batch_attention", "sampling", "optim", "kv_compress", "page"]
FAMILIES = ["rmsnorm_kernel", "rmsnorm_backward_kernel", "rmsnorm_dw_reduce_kernel", "act_and_mul_kernel",
            "act_and_mul_backward_kernel", "rope_kernel", "merge_states_kernel", "decode_attention_kernel",
            "multi_query_attention_kernel", "merge_partials_kernel", "sampling_kernel", "renorm_kernel",
            "speculative_kernel", "grad_norm_chunks_kernel", "grad_norm_finish_kernel", "adamw_kernel",
            "adamw_steps_kernel", "kv_scores_kernel", "kv_select_kernel", "kv_compact_kernel",
            "append_paged_kv_kernel"]
# ptxas reports for these (the no-spill check); Blackwell's ptxas allocates differently and spilled
# kernels that fit sm_80 and sm_90. The PTX checks read sm_80 and sm_90 only. Two builds: setup.py's own
# architectures and flags (PTX for both; a ccache hit after scripts/setup.sh, its report replayed), then Blackwell.
SETUP_ARCHS = ["80", "90"]  # setup.py's DEFAULT_ARCHS
BLACKWELL_ARCHS = ["100-real", "120-real"]
CMAKE = shutil.which("cmake")
NINJA = shutil.which("ninja")


def is_family(family, name):
    """A demangled kernel name is an instantiation of `family` (a template or a plain kernel)."""
    return re.search(rf"fk::{family}[<(]", name) is not None


def cmake_build(build_dir, *options):
    # setup.py's configuration and ccache keys (paths relative to the tree), so that its objects are hits
    env = {**os.environ, "CCACHE_BASEDIR": str(ROOT), "CCACHE_NOHASHDIR": "1"}
    configure = [CMAKE, "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", *options]
    subprocess.run(configure, check=True, capture_output=True, text=True, env=env)
    # -v: ninja prints each command; the compilers' reports come with it
    done = subprocess.run([CMAKE, "--build", str(build_dir), "--", "-v"], capture_output=True, text=True, env=env)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-8000:]
    return log


demangle = sass.demangle  # {mangled: demangled}


# ---------------------------------------------------------------- CUDA


@pytest.fixture(scope="module")
def cuda_build(tmp_path_factory):
    """(the sm_80/sm_90 build directory, the ptxas report of all four architectures)."""
    if not (NVCC and CMAKE and NINJA):
        missing_tool("nvcc, cmake or ninja")
    if sass.disassembler() is None:
        missing_tool("cuobjdump and nvdisasm (the nvidia-cuda-cuobjdump and -nvdisasm wheels: scripts/setup.sh)")
    # setup's twin where setup.py builds (build/<name>): ccache's paths are relative to the build directory, so a
    # hit needs one at the same depth in the tree; its own name, removed after the module
    twin = ROOT / "build" / f"test-cuda-{os.getpid()}"
    shutil.rmtree(twin, ignore_errors=True)
    builds = {"80": twin, "100": tmp_path_factory.mktemp("cuda")}
    log = "".join(cmake_build(build, f"-DCMAKE_CUDA_COMPILER={NVCC}", "-DFLASHKERN_CUDA=ON",
                              f"-DFLASHKERN_CUDA_ARCHS={';'.join(archs)}", "-DFLASHKERN_RESOURCE_USAGE=ON")
                  for archs, build in zip((SETUP_ARCHS, BLACKWELL_ARCHS), builds.values()))
    yield twin, log
    shutil.rmtree(twin, ignore_errors=True)


def cuda_object(build, source):
    return build / "CMakeFiles" / "flashkern_cuda.dir" / "csrc" / "cuda" / f"{source}.cu.o"


def test_cuda_kernels_compile_without_spills(cuda_build):
    build, log = cuda_build
    assert (build / "libflashkern_cuda.a").exists()
    reports = sass.ptxas_resources(log)
    kernels = {k for k, _ in reports}
    archs = {sm for _, sm in reports}
    assert archs == {"sm_80", "sm_90", "sm_100", "sm_120"}, archs
    names = demangle(sorted(kernels))
    for family in FAMILIES:
        assert any(is_family(family, n) for n in names.values()), f"no {family} in the ptxas report"
    spills = {f"{names[k]} {sm}": r for (k, sm), r in reports.items() if r.spill_stores or r.spill_loads}
    assert not spills, f"register spills: {spills}"




@pytest.fixture(scope="module")
def static_figures(cuda_build, tmp_path_factory):
    """{(label, arch): Figures} of bench/static.py's kernels: sm_90 from this module's build, sm_90a compiled here."""
    build, log = cuda_build
    sources = sorted({k.source for k in static.KERNELS})
    results = {(s, "90"): (sass.by_arch(sass.dump_sass(cuda_object(build, s)))["sm_90"], log) for s in sources}
    results.update(static.compiled(["90a"], sources, tmp_path_factory.mktemp("sm_90a")))
    return {(k.label, arch): static.figures(k, *results[(k.source, arch[3:])], arch)
            for k in static.KERNELS for arch in ("sm_90", "sm_90a")}


@pytest.mark.parametrize("arch", ["sm_90", "sm_90a"])
def test_static_report_meets_its_goals(static_figures, arch):
    """The static report's figures (docs/benchmarks.md) held to bench/static.py's GOALS: registers, 16-byte
    loads in flight, instructions an element, spills; a change that loses one fails here."""
    unmet = {label: static.unmet(label, static_figures[(label, arch)]) for label in static.GOALS}
    assert not any(unmet.values()), f"{arch}: {unmet}"


# Two passes of a row loop: x and w loaded, then a tail branch with its own narrow load, the use, a store.
_SASS = """
        Function : kernel
        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0010*/                   LDG.E.128 R8, desc[UR4][R12.64] ;
        /*0020*/              @!P0 BRA 0x50 ;
        /*0030*/                   LDG.E.U16 R14, desc[UR4][R2.64] ;
        /*0040*/                   LDG.E.U16 R15, desc[UR4][R2.64+0x2] ;
        /*0050*/                   HFMA2 R4, R4, R8, RZ ;
        /*0060*/                   STG.E.128 desc[UR4][R2.64], R4 ;
        /*0070*/               @P1 BRA 0x0 ;
        /*0080*/                   EXIT ;
"""


def test_static_report_reader_on_known_code():
    """bench/sass.py on hand-written SASS: the loop, both loads in flight before the first use, the tail
    branch left out of the main path (and taken where the path must have a narrow load), one load at a time
    when each is used before the next."""
    (body,) = sass.parse_sass(_SASS).values()
    loop = sass.steady_loop(body, by="LDG.128")
    assert [i.address for i in (loop[0], loop[-1])] == [0x0, 0x70]
    main = sass.main_path(loop, {"LDG.128": 2})
    assert [i.address for i in main] == [0x0, 0x10, 0x20, 0x50, 0x60, 0x70]
    assert sass.wide_loads_in_flight(main) == 2
    assert len(sass.main_path(loop, {"LDG.128": 2, "LDG.16": 1})) == 8
    assert sass.main_path(loop, {"LDG.128": 3}) is None
    serial = sass.parse_sass(_SASS.replace("R8, desc[UR4][R12.64]", "R8, desc[UR4][R4.64]"))
    assert sass.wide_loads_in_flight(next(iter(serial.values()))) == 1
    diverged = sass.parse_sass(_SASS.replace("@!P0 BRA 0x50", "BRA.DIV UR4, 0x50"))  # a convergence test: both ways
    assert len(sass.main_path(next(iter(diverged.values()))[:8], {"LDG.128": 2, "LDG.16": 1})) == 8
    assert sass.occupancy(64, 256, 256) == (4, 32) and sass.occupancy(56, 512, 256) == (2, 32)


def test_inline_asm_that_touches_memory_says_so():
    """Every inline-asm statement in platform.h with a memory operand ([...]: cp.async, ldmatrix) or
    that orders memory (commit, wait) has a "memory" clobber, so that the compiler keeps plain loads
    and stores on their side of it; without one, nothing but a barrier in between stops it moving an
    ldmatrix above the shared-memory stores it reads."""
    source = (ROOT / "csrc" / "include" / "flashkern" / "platform.h").read_text()
    statements = re.findall(r"asm volatile\((.*?)\);", source, flags=re.S)
    assert len(statements) >= 5, statements
    for statement in statements:
        template = re.match(r'\s*"([^"]*)"', statement).group(1)
        if "[%" in template or "cp.async" in template:
            assert '"memory"' in statement, f"no memory clobber: {template.strip()}"


def ptx_entries(ptx):
    """{mangled entry name: body} of a PTX file."""
    parts = re.split(r"\.visible \.entry (\S+)\(", ptx)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


@functools.cache
def ptx_of(build, source, arch):
    """({mangled entry: PTX body}, {mangled: demangled}) of csrc/cuda/<source>.cu for sm_<arch>, from its object."""
    ptx = sass.by_arch(sass.cuobjdump("-ptx", cuda_object(build, source))).get(f"sm_{arch}")
    assert ptx, f"no PTX for {source} sm_{arch}"
    entries = ptx_entries(ptx)
    return entries, demangle(sorted(entries))


@pytest.mark.parametrize("source", ROW_SOURCES)
@pytest.mark.parametrize("arch", ["80", "90"])
def test_cuda_ptx_has_16_byte_global_loads(cuda_build, source, arch):
    build, _ = cuda_build
    entries, names = ptx_of(build, source, arch)
    wide = {m: b for m, b in entries.items() if "reduce" not in names[m] and _is_wide(names[m])}
    assert wide, f"no 16-byte-vector instantiations found in {sorted(names.values())}"
    for mangled, body in wide.items():
        assert re.search(r"ld\.global(\.nc)?\.v4\.(u32|b32|f32)", body), f"{names[mangled]}: no 16-byte global load"
        assert re.search(r"st\.global(\.wb)?\.v4\.(u32|b32|f32)", body), f"{names[mangled]}: no 16-byte global store"


@pytest.mark.parametrize("arch", ["80", "90"])
def test_cuda_sampling_ptx(cuda_build, arch):
    """The sampling kernels read rows 16 bytes at a time (float4 probabilities; 16-bit renorm rows as
    8 elements), and renormalization and softmax write them so."""
    build, _ = cuda_build
    entries, names = ptx_of(build, "sampling", arch)
    def wide_path(name):  # sampling_kernel<threads, warp, vec> reads float only
        return name.endswith(", 4>(fk::SamplingParams)") if "fk::sampling_kernel<" in name else _is_wide(name)

    wide = {names[m]: b for m, b in entries.items() if wide_path(names[m])}
    assert {re.search(r"fk::(\w+)<", n).group(1) for n in wide} == {"sampling_kernel", "renorm_kernel",
                                                                      "speculative_kernel"}
    for name, body in wide.items():
        assert re.search(r"ld\.global(\.nc)?\.v4\.(u32|b32|f32)", body), f"{name}: no 16-byte global load"
        if "renorm" in name:
            assert re.search(r"st\.global(\.wb)?\.v4\.(u32|b32|f32)", body), f"{name}: no 16-byte global store"
    softmax = {names[m]: b for m, b in entries.items() if "softmax" in names[m]}
    assert len(softmax) == 9, sorted(softmax)  # stats, stats-and-write, merge-and-write for three dtypes
    for name, body in softmax.items():  # every one reads 16 bytes at a time; those that write, write so
        assert re.search(r"ld\.global(\.nc)?\.v4\.(u32|b32|f32)", body), f"{name}: no 16-byte global load"
        if "merge_write" in name or "true>" in name:
            assert re.search(r"st\.global(\.wb)?\.v4\.(u32|b32|f32)", body), f"{name}: no 16-byte global store"


@pytest.mark.parametrize("arch", ["80", "90"])
def test_cuda_optim_ptx(cuda_build, arch):
    """The training-step kernels move 16 bytes at a time: the norm's gradient loads, AdamW's loads and
    stores of the parameter, its moments and master copy."""
    build, _ = cuda_build
    entries, names = ptx_of(build, "optim", arch)
    bodies = {names[m]: b for m, b in entries.items()}
    for family in ("grad_norm_chunks_kernel", "adamw_kernel"):
        found = [b for n, b in bodies.items() if is_family(family, n)]
        assert found, f"no {family} in the PTX"
        for body in found:
            assert re.search(r"ld\.global(\.nc)?\.v4\.(u32|b32|f32)", body), f"{family}: no 16-byte global load"
            if family == "adamw_kernel":
                assert re.search(r"st\.global(\.wb)?\.v4\.(u32|b32|f32)", body), f"{family}: no 16-byte global store"


@pytest.mark.parametrize("arch", ["80", "90"])
def test_cuda_kv_compress_ptx(cuda_build, arch):
    """KV compression moves K and V 16 bytes at a time: the score kernel's K tile loads, the compaction's
    loads and stores of K and V."""
    build, _ = cuda_build
    entries, names = ptx_of(build, "kv_compress", arch)
    bodies = {names[m]: b for m, b in entries.items()}
    for family, patterns in (("kv_scores_kernel", [r"ld\.global(\.nc)?\.v4\.u32"]),
                             ("kv_compact_kernel", [r"ld\.global(\.nc)?\.v4\.u32", r"st\.global(\.wb)?\.v4\.u32"])):
        found = {n: b for n, b in bodies.items() if is_family(family, n)}
        assert len(found) == 6, f"{family}: {sorted(found)}"  # two dtypes, three head dims
        for name, body in found.items():
            for pattern in patterns:
                assert re.search(pattern, body), f"{name}: no {pattern}"


@pytest.mark.parametrize("arch", ["80", "90"])
def test_cuda_append_paged_kv_ptx(cuda_build, arch):
    """Appending reads K and V 16 bytes at a time and writes them 16 bytes at a time (a 16-bit cache) or 8
    (fp8: 8 codes of one 16-byte input vector)."""
    build, _ = cuda_build
    entries, names = ptx_of(build, "page", arch)
    found = {names[m]: b for m, b in entries.items() if is_family("append_paged_kv_kernel", names[m])}
    assert len(found) == 10, sorted(found)  # two input dtypes, the copy and four fp8 formats
    for name, body in found.items():
        assert re.search(r"ld\.global(\.nc)?\.v4\.u32", body), f"{name}: no 16-byte global load"
        store = r"st\.global(\.wb)?\.v4\.u32" if ", -1>" in name else r"st\.global\.v2\.u32"
        assert len(re.findall(store, body)) == 2, f"{name}: not one {store} each for K and V"


ATTENTION_PTX = {  # what each attention kernel must contain: 16-byte copies and loads, the matrix instructions
    "decode_attention_kernel": [r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16", r"ld\.global(\.nc)?\.v4\.u32",
                                r"st\.global(\.wb)?\.v4"],
    "multi_query_attention_kernel": [r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16",
                                     r"ldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16",
                                     r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16",
                                     r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(bf16\.bf16|f16\.f16)\.f32",
                                     r"cp\.async\.wait_group"],
    "merge_partials_kernel": [r"ld\.global(\.nc)?\.v4\.f32", r"st\.global(\.wb)?\.v4"],
}
FP8_DECODE_COPY = r"cp\.async\.ca\.shared\.global \[%r\d+\], \[%rd\d+\], 8"


@pytest.mark.parametrize("arch", ["80", "90"])
def test_cuda_attention_ptx(cuda_build, arch):
    """cp.async 16-byte K/V copies and 16-byte q loads in the decode kernel; ldmatrix (plain and
    transposed), mma.sync m16n8k16 and cp.async in the multi-query kernel; 16-byte accesses in the merge."""
    build, _ = cuda_build
    entries, names = ptx_of(build, "batch_attention", arch)
    for family, patterns in ATTENTION_PTX.items():
        bodies = {names[m]: b for m, b in entries.items() if f"fk::{family}<" in names[m]}
        assert bodies, f"no {family} in the PTX"
        for name, body in bodies.items():
            fp8 = name.endswith(", true>(fk::BatchAttentionParams)")  # an fp8 cache's instantiation
            wanted = patterns  # the fp8 decode kernel copies its codes 8 bytes (8 of them) at a time
            if fp8 and family == "decode_attention_kernel":
                wanted = [FP8_DECODE_COPY] + patterns[1:]
            for pattern in wanted:
                assert re.search(pattern, body), f"{name}: no {pattern}"
            if fp8:  # sm_89+ decodes two codes an instruction, in both OCP formats; sm_80 in software
                for fmt in ("e4m3x2", "e5m2x2"):
                    assert (f"cvt.rn.f16x2.{fmt}" in body) == (arch == "90"), (name, fmt)
            if "bf16_t" in name and family == "multi_query_attention_kernel":
                assert ".bf16.bf16" in body, name
            if ", 16, 32>" in name:  # 16-row tiles store merged rows 16 bytes at a time (64-row ones in pairs)
                assert re.search(r"st\.global(\.wb)?\.v4", body), name


# launched with enable_pdl: they let the next kernel start launching
PDL_LAUNCHED = ["rmsnorm_kernel", "act_and_mul_kernel", "decode_attention_kernel", "multi_query_attention_kernel",
                "merge_partials_kernel", "softmax_chunk_kernel", "softmax_merge_write_kernel"]
# global or generic-address loads, stores, atomics and copies (not parameters, shared, local or constant memory)
GLOBAL_ACCESS = r"\b(ld|st|atom|red)\.(?!param|shared|local|const)|cp\.async\.(bulk\.)?\w*\.?shared[:\w]*\.global"


@pytest.mark.parametrize("arch", ["80", "90"])
def test_every_kernel_waits_for_the_previous_one_before_touching_memory(cuda_build, arch):
    """Programmatic dependent launch (platform.h): on sm_90 every kernel's griddepcontrol.wait comes
    before its first global load, store or copy (a kernel launched early must not read what the previous
    kernel is still writing, nor overwrite what it still reads), and the kernels launched with PDL
    signal launch_dependents; sm_80 has neither instruction."""
    build, _ = cuda_build
    for source in SOURCES:
        entries, names = ptx_of(build, source, arch)
        for mangled, body in entries.items():
            name, first_access = names[mangled], re.search(GLOBAL_ACCESS, body)
            assert first_access, f"{name}: no global memory access in the PTX"
            if arch == "80":
                assert "griddepcontrol" not in body, name
                continue
            wait = body.find("griddepcontrol.wait")
            assert 0 <= wait < first_access.start(), f"{name}: a global access before griddepcontrol.wait"
            pdl = any(f"fk::{family}<" in name for family in PDL_LAUNCHED)
            assert ("griddepcontrol.launch_dependents" in body) == pdl, name


# ---------------------------------------------------------------- launch bounds


def ptx_launch_bounds(build, arch="90"):
    """{mangled kernel: the most threads a block of it may have} from the PTX: .maxntid is what
    __launch_bounds__ became; a kernel without one may have 1024."""
    bounds = {}
    for source in SOURCES:
        entries, _ = ptx_of(build, source, arch)
        for mangled, body in entries.items():
            m = re.search(r"\.maxntid (\d+), (\d+), (\d+)", body.split("{", 1)[0])
            bounds[mangled] = math.prod(map(int, m.groups())) if m else 1024
    return bounds


def emulated_launches(lib):
    """{mangled kernel: its largest block} over the launches the emulated library made (emu_launches:
    offsets in the library, which nm names)."""
    nm = subprocess.run(["nm", "--defined-only", lib._name], capture_output=True, text=True, check=True).stdout
    names = {int(f[0], 16): f[2] for f in (line.split() for line in nm.splitlines()) if len(f) == 3}
    launches = {}
    for line in lib.emu_launches().decode().splitlines():
        offset, threads = map(int, line.split())
        launches[names.get(offset, f"<unnamed at {offset:#x}>")] = threads
    launches.pop("probe_kernel", None)  # tests/emu's own
    return launches


def launches_and_bounds(lib, bounds):
    """{kernel: (its largest block, its bound)} over what lib launched."""
    launches = emulated_launches(lib)
    assert launches, "no kernel was launched"
    unknown = sorted(set(launches) - set(bounds))
    assert not unknown, f"launched kernels missing from the device code: {list(demangle(unknown).values())}"
    names = demangle(sorted(launches))
    return {names[k]: (t, bounds[k]) for k, t in launches.items()}


def over_bounds(launched):
    return {name: (threads, bound) for name, (threads, bound) in launched.items() if threads > bound}


def every_kernel_and_path(lib):
    import test_emulated_kernels as emulated

    emulated.test_every_kernel_and_path(lib)
    emulated.test_rmsnorm_backward_kernel(lib, 2, 20000, torch.float32, 1e-6)  # the streamed backward


def test_every_launch_fits_its_kernels_launch_bounds(cuda_build, tmp_path_factory):
    """A GPU refuses to launch a kernel with more threads a block than its __launch_bounds__ (it is
    compiled for no more). A host compiler cannot see the attribute, so the emulator records each
    kernel's largest block over a run of every kernel and path (the CUDA launchers' own sizing), and
    that is held against the bound nvcc wrote into the sm_90 PTX."""
    import test_emulated_kernels as emulated

    bounds = ptx_launch_bounds(cuda_build[0])
    lib = emulated.build(tmp_path_factory, "cuda")
    every_kernel_and_path(lib)
    launched = launches_and_bounds(lib, bounds)
    assert {f for f in FAMILIES if any(is_family(f, name) for name in launched)} == set(FAMILIES)
    assert over_bounds(launched) == {}


def test_launch_bounds_check_bites(cuda_build, tmp_path_factory):
    """The mutant: the merge of partial states launched with twice its block. Every value stays right
    (its loop strides by the rows of the bound), so only the bounds check can catch it."""
    import test_emulated_kernels as emulated

    source = tmp_path_factory.mktemp("mutant-launch-bounds")
    shutil.copytree(ROOT / "csrc", source / "csrc")
    shutil.copytree(ROOT / "tests" / "emu", source / "tests" / "emu")
    launcher = source / "csrc" / "include" / "flashkern" / "kernels" / "batch_attention.cuh"
    text = launcher.read_text()
    assert text.count("dim3(kMergeBlock), 0, stream,") == 1
    launcher.write_text(text.replace("dim3(kMergeBlock), 0, stream,", "dim3(2 * kMergeBlock), 0, stream,"))
    lib = emulated.build(tmp_path_factory, "cuda", source_root=source)
    emulated.test_batch_attention_kernels(lib, 24, 128, 16, torch.bfloat16)
    over = over_bounds(launches_and_bounds(lib, ptx_launch_bounds(cuda_build[0])))
    assert over and all("merge_partials_kernel" in name and t == 512 for name, (t, _) in over.items()), over


def _is_wide(name):
    """Template arguments of an instantiation: the vector width is the last integer (after any warp width)."""
    args = name[name.index("<") + 1 : name.index(">(")].split(", ")
    vec = int([a for a in args if a.isdigit()][-1])
    dtype = next(a for a in args if a in ("fk::bf16_t", "fk::half_t", "float"))
    return vec == (4 if dtype == "float" else 8)


# ---------------------------------------------------------------- HIP


HIP_ARCHS = ["gfx90a", "gfx1030"]


@pytest.fixture(scope="module")
def hip_build(tmp_path_factory):
    """The HIP library for gfx90a and gfx1030, each source's device assembly kept (one compile for both)."""
    if not (HIPCC and CMAKE and NINJA):
        missing_tool("hipcc, cmake or ninja")
    build = tmp_path_factory.mktemp("hip")
    cmake_build(build, "-DFLASHKERN_HIP=ON", f"-DFLASHKERN_HIP_ARCHS={';'.join(HIP_ARCHS)}", "-DFLASHKERN_HIP_ASSEMBLY=ON")
    return build


@pytest.fixture(scope="module")
def hip_asm(hip_build):
    """{(source, arch): device assembly} of every csrc/hip/*.hip for each of HIP_ARCHS."""
    return {(source.stem, arch): (hip_build / "hip" / f"{source.stem}-hip-amdgcn-amd-amdhsa-{arch}.s").read_text()
            for source in sorted((ROOT / "csrc" / "hip").glob("*.hip")) for arch in HIP_ARCHS}


def hip_resource_usage(hip_asm):
    """[(kernel, {"VGPRs": n, "VGPRs Spill": n, "ScratchSize": bytes a lane})], one per kernel and target, from
    the code objects' metadata (amdhsa.kernels: a kernel's keys in order, its name before its registers)."""
    kernels = []
    for asm in hip_asm.values():
        metadata = asm.split("amdhsa.kernels:", 1)[1]
        for name, scratch, vgprs, spills in re.findall(
                r"\.name:\s+(\S+)\s+\.private_segment_fixed_size:\s+(\d+)[\s\S]*?\.vgpr_count:\s+(\d+)\s+"
                r"\.vgpr_spill_count:\s+(\d+)", metadata):
            kernels.append((name, {"VGPRs": int(vgprs), "VGPRs Spill": int(spills), "ScratchSize": int(scratch)}))
    return kernels


def test_hip_kernels_compile_for_wave64_and_wave32(hip_build, hip_asm):
    assert (hip_build / "libflashkern_hip.a").exists()
    for source in SOURCES:
        obj = (hip_build / "hip" / f"{source}.o").read_bytes()
        for arch in HIP_ARCHS:
            assert f"amdgcn-amd-amdhsa--{arch}".encode() in obj, f"{source}.o has no {arch} code object"
    usage = hip_resource_usage(hip_asm)
    names = {name for name, _ in usage}
    for family in FAMILIES:
        assert any(family in n for n in names), f"no {family} in the code objects' metadata"
    # Memory spills are VGPRs to scratch. (SGPR spills go to VGPR lanes, not memory: allowed.)
    spilled = [name for name, u in usage if u["VGPRs Spill"] or u["ScratchSize"]]
    assert not spilled, spilled[:10]


def test_hip_kernels_carry_code_only_for_their_own_wavefront(hip_asm):
    """Each rmsnorm instantiation is real code on the target of its width and a trap stub on the other."""
    rms = [(name, u["VGPRs"]) for name, u in hip_resource_usage(hip_asm)
           if re.search(r"rmsnorm(_backward)?_kernelILi", name)]
    assert rms, "no rmsnorm kernel in the code objects' metadata"
    for width in (32, 64):
        of_width = [v for name, v in rms if f"ILi{width}E" in name]
        # once per target: real on one, a stub on the other
        assert len(of_width) % 2 == 0 and sum(v == 0 for v in of_width) == len(of_width) // 2, (width, of_width)


def test_hip_multi_query_kernel_uses_mfma_on_cdna_only(hip_asm):
    """The device assembly: MFMA (f16 and bf16) in the wave64 multi-query kernels for gfx90a; none for
    gfx1030, whose kernels are plain arithmetic."""
    asm = {arch: hip_asm["batch_attention", arch] for arch in HIP_ARCHS}
    for mnemonic in ("v_mfma_f32_16x16x16f16", "v_mfma_f32_16x16x16bf16_1k"):
        assert mnemonic in asm["gfx90a"], mnemonic
    assert "v_mfma" not in asm["gfx1030"]
    for arch in asm:
        assert "multi_query_attention_kernel" in asm[arch] and "decode_attention_kernel" in asm[arch]


def hip_launch_bounds(hip_asm, arch):
    """{mangled kernel: .max_flat_workgroup_size} from the code object metadata (amdhsa.kernels), what
    __launch_bounds__ became on AMD."""
    bounds = {}
    for (_, a), asm in hip_asm.items():
        if a != arch:
            continue
        metadata = asm.split("amdhsa.kernels:", 1)[1]  # a kernel's keys in order: the size, then its name
        for size, name in re.findall(r"\.max_flat_workgroup_size:\s+(\d+)\s+\.name:\s+(\S+)", metadata):
            bounds[name] = int(size)
    return bounds


@pytest.mark.parametrize("arch", HIP_ARCHS)
def test_every_hip_launch_fits_its_kernels_launch_bounds(hip_asm, tmp_path_factory, arch):
    """The same for the HIP launchers on an emulated gfx90a (wave64) and gfx1030 (wave32), against the
    AMD code objects' maximum work-group sizes."""
    import test_emulated_kernels as emulated

    lib = emulated.build(tmp_path_factory, "hip")
    assert lib.emu_set_device(arch.encode())
    every_kernel_and_path(lib)
    launched = launches_and_bounds(lib, hip_launch_bounds(hip_asm, arch))
    assert {f for f in FAMILIES if any(is_family(f, name) for name in launched)} == set(FAMILIES)
    assert over_bounds(launched) == {}


# ---------------------------------------------------------------- CPU-only extension


def test_cpu_only_build_registers_and_runs_every_op(tmp_path):
    """FLASHKERN_BUILD_BACKEND=cpu: the extension a machine without a GPU toolchain builds (here without
    the emulate backends, which the main build has: the same build steps, minutes more)."""
    env = {**os.environ, "FLASHKERN_BUILD_BACKEND": "cpu", "FLASHKERN_BUILD_EMULATE": "0", "MAX_JOBS": "2"}
    lib = tmp_path / "lib"
    build = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-lib", str(lib), "--build-temp", str(tmp_path / "tmp")],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )
    assert build.returncode == 0, (build.stdout + build.stderr)[-5000:]
    shutil.copytree(ROOT / "python" / "flashkern", lib / "flashkern", dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.so"))
    script = (
        "import torch, flashkern\n"
        "from torch.library import opcheck\n"
        "assert flashkern.info()['built_backend'] == 'cpu', flashkern.info()\n"
        "x = torch.randn(5, 16); w = torch.randn(16)\n"
        "torch.testing.assert_close(flashkern.rmsnorm(x, w), flashkern.ref.rmsnorm(x, w))\n"
        "torch.testing.assert_close(flashkern.silu_and_mul(x), flashkern.ref.act_and_mul(x, 'silu'))\n"
        "opcheck(torch.ops.flashkern.rmsnorm.default, (x.requires_grad_(), w, 1e-6, 0.0))\n"
        "assert all(r['passed'] for r in flashkern.check())\n"
        "print('cpu-only ok')\n"
    )
    run = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(lib)},
                         cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0 and "cpu-only ok" in run.stdout, run.stdout + run.stderr
