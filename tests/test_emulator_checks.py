"""The emulator's GPU checks (csrc/include/flashkern/emulate.h) over the kernels' own code, and proof
that each one bites:
  racecheck    tests/test_emulated_kernels.py with the kernels built under ThreadSanitizer: any
               shared- or global-memory access pair that no __syncthreads orders is a failure
  memcheck     the same under AddressSanitizer: every buffer the kernels get is an exact allocation
               (tests/test_emulated_kernels.py: exact), shared memory too
  mutants      a kernel with one GPU bug each, which the matching check must catch: a __syncthreads
               dropped (TSan, and the seeded schedule without it), a read past a row (ASan), the
               shared-memory opt-in skipped and 1025 threads launched (the launch limits)
Each run is a pytest of tests/test_emulated_kernels.py in a subprocess (a sanitizer's runtime must be
loaded first), with its own schedule seed. Each is one test, so pytest-xdist spreads them over the
cores with the rest of the suite; conftest.py hands them out first, being the longest.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import ROTATION, SHARE, missing_tool, rotating_index, subprocess_limit

ROOT = Path(__file__).resolve().parent.parent
CXX = shutil.which("g++")


@pytest.fixture(autouse=True)
def _needs_gxx():
    if CXX is None:
        missing_tool("g++")


def runtime(name):
    """The sanitizer runtime to preload (libstdc++ with ASan: its __cxa_throw must be found at start)."""
    libs = [subprocess.run([CXX, f"-print-file-name=lib{name}.so"], capture_output=True, text=True).stdout.strip()]
    if name == "asan":
        libs.append(subprocess.run([CXX, "-print-file-name=libstdc++.so"], capture_output=True, text=True).stdout.strip())
    return " ".join(libs)


SANITIZERS = {  # FK_EMU_SANITIZER -> environment of the run; the exit code tells a report from a failed test
    "thread": lambda: {"LD_PRELOAD": runtime("tsan"), "TSAN_OPTIONS": "halt_on_error=1:exitcode=66"},
    "address": lambda: {"LD_PRELOAD": runtime("asan"), "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:exitcode=67"},
}
EXIT_CODE = {"thread": 66, "address": 67}


def emulated_tests(selection=None, sanitizer=None, seed=1, source_root=None, tmp=None, marker=None, workers=1, env_extra=None):
    """Starts tests/test_emulated_kernels.py (-m marker, -k selection) in a subprocess, on `workers`
    pytest-xdist workers (a sanitizer's report then fails the run as a crashed worker); returns the Popen
    (stdout: the log)."""
    env = {**os.environ, "FK_EMU_SEED": str(seed), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("LD_PRELOAD", None)
    env.update(env_extra or {})
    for name in [k for k in env if k.startswith("PYTEST_XDIST")]:  # its own run, not this worker's
        env.pop(name)
    if sanitizer:
        env.update(SANITIZERS[sanitizer](), FK_EMU_SANITIZER=sanitizer)
    if source_root:
        env["FK_EMU_SOURCE_ROOT"] = str(source_root)
    # -s: a sanitizer's report goes to stderr as it halts the process, past pytest's capture
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--basetemp", str(tmp),
               str(ROOT / "tests" / "test_emulated_kernels.py")]
    if marker:
        command += ["-m", marker]
    if selection:
        command += ["-k", selection]
    if workers > 1:
        command += ["-n", str(workers)]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture
def scratch():
    """A directory for one run's copy of the sources, its build and its pytest, removed after (gigabytes over
    the module, which tmp_path would keep)."""
    tmp = Path(tempfile.mkdtemp(prefix="flashkern-emulator-"))
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


def finish(run, alone_seconds=300):
    log, _ = run.communicate(timeout=subprocess_limit(alone_seconds))
    return run.returncode, log


# ---------------------------------------------------------------- every kernel under each sanitizer


# What the ASan run leaves out of the emulated-kernel module: the wave32 launchers (CI time: the kernels'
# indexing at 32 lanes a warp is the CUDA build's) and the batch-invariance tests (no kernel path of their own).
# Of the rest it runs one test in three, a share that rotates with the code (CI time; conftest.SHARE), so that
# every test runs under ASan across commits; a whole suite's run runs the other two thirds plain, and leaves the
# ASan run's third out of its own (conftest.py): each test runs once a commit, one way or the other.
ASAN_LEAVES_OUT = ("hip-wave32", "batch_invariant")
# The TSan tour: every kernel and path on the CUDA launchers each commit, and on one of the two HIP widths, rotating
# (CI time: a TSan thread for every GPU thread makes each tour minutes long).
TSAN_LEAVES_OUT = ("hip-wave64", "hip-wave32")[rotating_index("tsan-hip", 2)]


def covered_by_asan(item):
    """An emulated-kernel test that the ASan run runs (the same function selects them there: conftest.RunOnce)."""
    return (item.path.name == "test_emulated_kernels.py" and not any(name in item.nodeid for name in ASAN_LEAVES_OUT)
            and rotating_index(f"asan {item.name}", SHARE["asan"]) == 0)


def sanitized(sanitizer, tmp):
    """The emulated-kernel module under ASan, the tests covered_by_asan (conftest.RunOnce selects them in that run);
    under TSan the tests marked for it (every kernel and path, small: TSan pays for a thread per GPU thread per
    block), but for TSAN_LEAVES_OUT."""
    seed = {"address": 3, "thread": 2}[sanitizer]
    # the ASan run on two workers of its own (CI time: the longest run of the suite), so that it is not the last
    # test left; TSan in one process
    if sanitizer == "address":
        run = emulated_tests(sanitizer=sanitizer, seed=seed, tmp=tmp, workers=2, env_extra={"FK_EMU_ASAN_SHARE": "1"})
    else:
        run = emulated_tests(f"not {TSAN_LEAVES_OUT}", sanitizer, seed, tmp=tmp, marker="tsan")
    return finish(run)


@pytest.mark.parametrize("sanitizer", ["thread", "address"])
def test_kernels_under_sanitizer(sanitizer, scratch):
    code, log = sanitized(sanitizer, scratch)
    assert code == 0, log[-6000:]
    assert re.search(r"\d+ passed", log), log[-2000:]


# ---------------------------------------------------------------- mutants

# (file under csrc/, the line as it is, the line as mutated, the check, the tests to run, what must be said)
MUTANTS = {
    # the barrier between the decode kernel's sub-warps writing their parts and the merge reading them
    "missing_syncthreads_race": (
        "include/flashkern/kernels/decode_attention.cuh",
        "    __syncthreads();\n    merge_parts_and_store", "    merge_parts_and_store",
        "thread", "test_batch_attention_kernels and cuda-2-128-1", r"ThreadSanitizer: data race",
    ),
    "missing_syncthreads_schedule": (
        "include/flashkern/kernels/decode_attention.cuh",
        "    __syncthreads();\n    merge_parts_and_store", "    merge_parts_and_store",
        None, "test_batch_attention_kernels and cuda-2-128-1", r"Mismatched elements|AssertionError",
    ),
    # the one-barrier row reduction writing the same scratch half every row: a fast warp's partial for the
    # next row overwrites one that a slow warp is still summing
    "row_sum_one_scratch_half": (
        "include/flashkern/reduce.h",
        "sum_impl<kN, false>(v, scratch + (call & 1) * kN * kMaxWarps);", "sum_impl<kN, false>(v, scratch);",
        "thread", "test_rmsnorm_rows_over_the_grid", r"ThreadSanitizer: data race",
    ),
    # the in-register rmsnorm's partial last vector one element longer: a read past the row
    "rmsnorm_tail_past_the_row": (
        "include/flashkern/kernels/rmsnorm.cuh",
        "const int tail = int(p.cols % kVec);", "const int tail = int(p.cols % kVec) + 1;",
        "address", "test_rmsnorm_kernel_tails and False-bfloat16", r"AddressSanitizer: heap-buffer-overflow",
    ),
    # a partial vector at the end of a row reads one element more
    "read_past_a_row": (
        "include/flashkern/kernels/rmsnorm.cuh",
        "return rest <= 0 ? 0 : (rest < kVec ? int(rest) : kVec);",
        "return rest <= 0 ? 0 : (rest < kVec ? int(rest) + 1 : kVec);",
        "address", "test_rmsnorm_kernel_tails and False-float16", r"AddressSanitizer: heap-buffer-overflow",
    ),
    # softmax: a chunk's scalar tail reads one element past the chunk (past the row, for the last)
    "softmax_tail_past_the_row": (
        "include/flashkern/kernels/softmax.cuh",
        "for (int64_t i = tail + threadIdx.x; i < b; i += kThreads) {\n    const float y[1]",
        "for (int64_t i = tail + threadIdx.x; i <= b; i += kThreads) {\n    const float y[1]",
        "address", "test_softmax_kernel and float32-20001", r"AddressSanitizer: heap-buffer-overflow",
    ),
    # softmax's two block reductions back to back: without the barrier before the second writes the
    # shared scratch, a thread overwrites the maxima others are still reading
    "softmax_reduction_race": (
        "include/flashkern/kernels/block_reduce.cuh",
        "  __syncthreads();  // a previous call's readers are done with scratch\n  if (lane == 0) {",
        "  if (lane == 0) {",
        "thread", "test_softmax_kernel and cuda and bfloat16-4099", r"ThreadSanitizer: data race",
    ),
    # KV compaction in place: without the barrier a thread overwrites a kept position that another
    # thread of the same chunk has yet to read
    "kv_compact_overwrites_before_read": (
        "include/flashkern/kernels/kv_compress.cuh",
        "    __syncthreads();  // every source of the chunk is read before any destination of it is written\n", "",
        "thread", "test_kv_compact_kernel and cuda and 128-16 and False", r"ThreadSanitizer: data race",
    ),
    # KV scores that forget the final lse (exp(logit) instead of exp(logit - lse)): wrong probabilities
    "kv_scores_without_lse": (
        "include/flashkern/kernels/kv_compress.cuh",
        "sum += expf(logit - lse);", "sum += expf(logit);",
        None, "test_kv_scores_kernel and cuda and float16-4-128", r"Mismatched elements|AssertionError",
    ),
    # scores from the attention's logits without the final lse: partial, unnormalized weights
    "kv_scores_from_logits_without_lse": (
        "include/flashkern/kernels/kv_compress.cuh",
        "sum += exp2f(logit[h * p.logits_stride] - lse[h] * kLog2e);",
        "sum += exp2f(logit[h * p.logits_stride]);",
        None, "test_attention_logits_epilogue and cuda and 2-128-1", r"Mismatched elements|AssertionError",
    ),
    # a K tile staged through store16, a global store (st.global on CUDA): a GPU faults on the shared address
    "global_store_to_shared_memory": (
        "include/flashkern/kernels/kv_compress.cuh",
        "      k_tile[tile_key * kPitch + c] = make_uint4(x.w[0], x.w[1], x.w[2], x.w[3]);",
        "      store16(&k_tile[tile_key * kPitch + c], make_uint4(x.w[0], x.w[1], x.w[2], x.w[3]));",
        None, "test_kv_scores_kernel and cuda and float16-4-128", r"store16 \(a global store",
    ),
    # an fp8 cache: the thread's chunks dequantized after the barrier that the other warps read them behind
    "fp8_dequantize_after_the_barrier": (
        "include/flashkern/kernels/multi_query_attention.cuh",
        "        pipe.dequantize(it);  // fp8 codes into the stage, last read by tile it - kStages, before the last "
        "barrier\n        __syncthreads();",
        "        __syncthreads();\n        pipe.dequantize(it);",
        "thread", "test_batch_attention_kernels_fp8 and cuda and 8-256", r"ThreadSanitizer: data race",
    ),
    # an fp8 cache's v_scale applied twice, and e5m2 decoded as e4m3: wrong values
    "fp8_v_scale_twice": (
        "include/flashkern/kernels/attention_tiles.cuh",
        "    f.scale *= v_scale;", "    f.scale *= v_scale * v_scale;",
        None, "test_batch_attention_kernels_fp8 and cuda and 1-128", r"Mismatched elements|AssertionError",
    ),
    "fp8_e5m2_as_e4m3": (
        "include/flashkern/kernels/attention_tiles.cuh",
        "    if (format == int(Fp8::e5m2)) return uint16_t(b << 8);",
        "    if (false) return uint16_t(b << 8);",
        None, "test_batch_attention_kernels_fp8 and cuda and 4-64", r"Mismatched elements|AssertionError",
    ),
    # the all-reduce's flag protocol (kernels/allreduce.cuh), each mutant a GPU failure seen in the field:
    # a plain load of the flag where an acquire is needed (a peer's data read before it is visible)
    "allreduce_missing_acquire": (
        "include/flashkern/kernels/allreduce.cuh",
        "int32_t(poll_acquire_system(mine) - count)", "int32_t(*const_cast<const volatile uint32_t*>(mine) - count)",
        "thread", "test_allreduce_kernels_flag_protocol and not hip", r"ThreadSanitizer: data race",
    ),
    # one region for every call: a rank stages the next message where a slower peer still reads this one
    "allreduce_one_region": (
        "include/flashkern/kernels/allreduce.cuh",
        "const int parity = int(calls & 1u);", "const int parity = 0;",
        "thread", "test_allreduce_kernels_flag_protocol and not hip", r"ThreadSanitizer: data race",
    ),
    # the signal stored in this rank's own flags instead of the peer's: the peer waits for ever
    "allreduce_signal_in_the_wrong_buffer": (
        "include/flashkern/kernels/allreduce.cuh",
        "comm_at(p, peer, CommLayout::flag(int(blockIdx.x), p.rank))",
        "comm_at(p, p.rank, CommLayout::flag(int(blockIdx.x), p.rank))",
        None, "test_allreduce_kernels_1000_calls and 2-True", r"flashkern emulation: a flag waited for longer",
    ),
    # the dependent launch allowed before the last store (the NaNs of an early PDL trigger)
    "allreduce_dependent_launch_first": (
        "include/flashkern/kernels/allreduce.cuh",
        "  pdl_wait();  // the previous call on this stream has ended: its workspace reads included\n",
        "  pdl_wait();\n  pdl_launch_dependents();\n",
        None, "test_allreduce_kernels_1000_calls and 2-True", r"signalled after pdl_launch_dependents",
    ),
    # a launch grid that depends on the rank: a block waits for a peer block that never runs (a hang)
    "allreduce_grid_depends_on_rank": (
        "include/flashkern/kernels/allreduce.cuh",
        "const dim3 grid(unsigned(p.blocks)),", "const dim3 grid(unsigned(p.blocks + p.rank)),",
        None, "test_allreduce_kernels_1000_calls and 2-True", r"flashkern emulation: a flag waited for longer",
    ),
    # appending: a position one page past its request's pages accepted (its slot is the next request's page)
    "append_past_the_pages": (
        "include/flashkern/kernels/page.cuh",
        "  if (n >= count) return {-1, 0};", "  if (n > count) return {-1, 0};",
        None, "test_append_paged_kv_kernel and cuda-NHD-16-3-64-float8_e4m3fn", r"AssertionError",
    ),
    # head_dim 512: the 4 warps of a 16-row tile each accumulating the first 128 dims, not their own
    "dim_split_warps_share_their_dims": (
        "include/flashkern/kernels/multi_query_attention.cuh",
        "    Warp tile(lane, wd * S::kOutDims);", "    Warp tile(lane, 0);",
        None, "test_batch_attention_kernels and cuda-1-512", r"Mismatched elements|AssertionError",
    ),
    # batch invariance: the invariant plan's chunk taken from the batch's work over the device's blocks, as a
    # default plan's is, so a request's split follows the other requests
    "invariant_split_follows_the_batch": (
        "include/flashkern/attention_plan.h",
        "const int64_t share = s.invariant ? 1 :", "const int64_t share = false ? 1 :",
        None, "test_attention_kernels_are_batch_invariant and cuda-decode-8", r"bits changed",
    ),
    "no_shared_memory_opt_in": (
        "include/flashkern/kernels/batch_attention.cuh",
        "const gpuError_t e = gpuSetMaxDynamicShared(kKernel, bytes);", "const gpuError_t e = gpuSuccess;",
        None, "own_shared_memory", r"invalid argument",
    ),
    "1025_threads": (
        "include/flashkern/kernels/batch_attention.cuh",
        "dim3(kMergeBlock), 0, stream,", "dim3(1025), 0, stream,",
        None, "test_batch_attention_kernels and cuda-24-128", r"invalid configuration argument",
    ),
}


def mutant_run(mutant, tmp):
    path, line, mutated, sanitizer, selection, _ = MUTANTS[mutant]
    source = tmp / "src"
    shutil.copytree(ROOT / "csrc", source / "csrc")
    shutil.copytree(ROOT / "tests" / "emu", source / "tests" / "emu")
    text = (source / "csrc" / path).read_text()
    if text.count(line) != 1:
        return None, f"the mutation site of {mutant} is not in {path} once"
    (source / "csrc" / path).write_text(text.replace(line, mutated))
    return finish(emulated_tests(selection, sanitizer, seed=4, source_root=source, tmp=tmp / "run"))


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_mutant_is_caught(mutant, scratch):
    if (sorted(MUTANTS).index(mutant) + ROTATION) % SHARE["mutant"]:  # each a rebuild under its sanitizer: 20-40 s
        pytest.skip(f"one mutant in {SHARE['mutant']} a commit, rotating (CI time; FLASHKERN_TEST_EMULATE_SAMPLE=1 "
                    "runs all)")
    sanitizer, expected = MUTANTS[mutant][3], MUTANTS[mutant][5]
    code, log = mutant_run(mutant, scratch)
    assert code is not None, log
    # a failed test, a sanitizer's report or the emulator's own abort (a fault on a GPU)
    caught = r"\d+ (passed|failed)|Sanitizer|flashkern emulation: "
    assert code != 0 and re.search(caught, log), f"{mutant} was not caught:\n{log[-4000:]}"
    if sanitizer:
        assert code == EXIT_CODE[sanitizer], log[-4000:]
    assert re.search(expected, log), f"{mutant}: no {expected!r} in\n{log[-4000:]}"
