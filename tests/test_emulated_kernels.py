"""The GPU kernels' own code, run on the CPU: csrc/cuda/*.cu compiled by g++ with -DFK_EMULATE
(csrc/include/flashkern/emulate.h: blocks in turn, a block's threads as host threads, real shared
memory, barriers and shuffles) and called through tests/emu/emu_ops.cpp on torch CPU tensors,
against the float64 references. This checks each kernel's indexing, tails, vector paths, launch
planning and reductions where no GPU exists; it does not check the hardware memory model, timing
or the conversion instructions."""

import ctypes
import hashlib
import math
import os
import re
import shutil
import subprocess
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import FLOAT_DTYPES, assert_close, missing_tool, rand, tolerance
from filelock import FileLock

from flashkern import ref
from flashkern.rope_scaling import cos_sin_cache, theta_inv_freq

ROOT = Path(__file__).resolve().parent.parent
DTYPE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ACT = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
I64 = ctypes.POINTER(ctypes.c_int64)
# FK_EMU_SANITIZER=thread|address builds the emulated kernels with that sanitizer; the process must have
# its runtime preloaded (tests/test_emulator_checks.py runs this module so).
SANITIZER = os.environ.get("FK_EMU_SANITIZER")
SOURCE_ROOT = Path(os.environ.get("FK_EMU_SOURCE_ROOT", ROOT))  # a mutated copy of csrc/ and tests/emu/
SANITIZER_FLAGS = [f"-fsanitize={SANITIZER}", "-g", "-fno-omit-frame-pointer"] if SANITIZER else []


def build(tmp_path_factory, backend, source_root=SOURCE_ROOT):
    """The emulated kernel library from csrc/cuda/*.cu (warp 32) or csrc/hip/*.hip (wave64/wave32 launchers)
    under source_root, loaded from its own copy of the file: each instance keeps its own emulator state
    (the device, the launches). Compiled once per session: pytest-xdist's workers share the build (a lock on
    the session's temporary root), so that one compiles while the others wait for it."""
    cxx = shutil.which("g++")
    if cxx is None:
        missing_tool("g++")
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the directory every worker's basetemp is in
    digest = hashlib.sha1(f"{backend} {source_root} {SANITIZER}".encode()).hexdigest()[:12]
    out = root / f"emu-{backend}-{digest}"
    library = out / "libfkemu.so"
    with FileLock(str(out) + ".lock"):
        if not library.exists():
            compile_library(out, backend, source_root, cxx)
    so = tmp_path_factory.mktemp(f"emu-{backend}") / "libfkemu.so"
    shutil.copyfile(library, so)
    return declare(ctypes.CDLL(str(so)))


def compile_library(out, backend, source_root, cxx):
    out.mkdir(parents=True, exist_ok=True)
    # hidden: the emulator's state is the library's own, however many are loaded
    flags = ["-std=c++20", "-O1", "-fPIC", "-fvisibility=hidden", "-DFK_EMULATE", "-Icsrc/include", *SANITIZER_FLAGS]
    if backend == "hip":
        flags.append("-DFK_EMULATE_HIP")  # matrix_unit(): MFMA on wave64, plain arithmetic on wave32
    pattern = "*.cu" if backend == "cuda" else "*.hip"
    sources = sorted((source_root / "csrc" / backend).glob(pattern)) + [source_root / "tests" / "emu" / "emu_ops.cpp"]
    # ccache, with paths relative to source_root: the sanitizer runs and mutants of
    # tests/test_emulator_checks.py (each its own copy of csrc/) rebuild only what their change touches
    launcher = [ccache] if (ccache := shutil.which("ccache")) else []
    env = {**os.environ, "CCACHE_BASEDIR": str(source_root), "CCACHE_NOHASHDIR": "1"}

    def compile_one(src):
        obj = out / (src.stem + ".o")
        subprocess.run([*launcher, cxx, *flags, "-x", "c++", "-c", str(src.relative_to(source_root)), "-o", str(obj)],
                       check=True, cwd=source_root, env=env)
        return str(obj)

    with ThreadPoolExecutor(2) as pool:
        objects = list(pool.map(compile_one, sources))
    partial = out / "libfkemu.so.partial"  # renamed when whole: a library that exists is complete
    subprocess.run([cxx, "-shared", *SANITIZER_FLAGS, *objects, "-o", str(partial)], check=True)
    partial.rename(out / "libfkemu.so")


def declare(lib):
    """The argument and result types of tests/emu/emu_ops.cpp's functions."""
    P, L, I, F, D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_double
    signatures = {  # tests/emu/emu_ops.cpp
        "emu_rmsnorm": [P, P, P, P, L, L, I64, I64, I64, I, I, F, F],
        "emu_rmsnorm_backward": [P, P, P, P, P, L, L, L, I, I, F, F],
        "emu_act_mul": [P, P, P, L, L, I64, I, I],
        "emu_act_mul_backward": [P, P, P, P, P, L, L, L, I, I],
        "emu_rope": [P, P, P, P, P, I, P, P, L, L, I, I, I, I, I64, I, I, I, I],
        "emu_merge_states": [P, P, P, P, P, P, P, L, I, I, I, I],
        "emu_batch_attention": [P, P, P, I64, P, P, I64, L, P, ctypes.POINTER(ctypes.c_int32), I, P, P, P,
                                ctypes.POINTER(ctypes.c_int), I, I, I, I, I, F, I, P, F, I, P, L, F, P, L],
        "emu_launch_probe": [I, I, I, I],
        "emu_plan_attention": [I64, I, I64, P, L, I64],
        "emu_sampling": [P, P, P, L, L, P, L, I, L, F, F, L, P],
        "emu_renorm": [P, P, L, L, I, I, L, F],
        "emu_softmax": [P, P, L, L, L, I, P, F, P],
        "emu_speculative": [P, P, P, P, P, I, P, P, P, L, I, L, I, I, L],
        "emu_grad_norm": [P, P, P, P, P, I64, ctypes.POINTER(ctypes.c_int), L, F, I, F, I],
        "emu_adamw": [P, P, P, P, P, P, I64, ctypes.POINTER(ctypes.c_int), L, P, D, D, D, F, D, P, I, P, I],
        "emu_kv_scores": [P, P, I64, P, P, I64, P, P, P, P, L, L, I, I, I, I, I, I, F, F, F, I, I, I, P, L],
        "emu_kv_select": [P, P, P, P, P, P, I, I, I, I, I, I],
        "emu_kv_compact": [P, P, I64, I64, P, P, P, P, P, P, P, I, I, I, I, I],
        "emu_append_paged_kv": [P, P, I64, I64, P, P, I64, I64, P, P, P, P, P, P, F, F, L, L, L, I, I, I, I, I, I],
        "emu_allreduce": [I, P, P, P, P, P, P, I, I64, P, L, I, I, F, F, L, I, I, I64, L],
    }
    lib.emu_set_device.argtypes, lib.emu_set_device.restype = [ctypes.c_char_p], ctypes.c_bool
    lib.emu_set_seed.argtypes, lib.emu_set_seed.restype = [ctypes.c_uint64], None
    lib.emu_launches.argtypes, lib.emu_launches.restype = [], ctypes.c_char_p
    for name, argtypes in signatures.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = ctypes.c_char_p
    lib.emu_softmax_chunks.argtypes, lib.emu_softmax_chunks.restype = [L], L
    lib.emu_comm_workspace_bytes.argtypes, lib.emu_comm_workspace_bytes.restype = [L], L
    return lib


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return build(tmp_path_factory, "cuda")


@pytest.fixture(scope="module")
def emu_wave64(tmp_path_factory):
    """The HIP launchers on an emulated wave64 (CDNA) device: the kWarp = 64 reductions."""
    lib = build(tmp_path_factory, "hip")
    assert lib.emu_set_device(b"gfx90a")
    return lib


_libc = ctypes.CDLL(None)
_libc.malloc.argtypes, _libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
_libc.free.argtypes, _libc.free.restype = [ctypes.c_void_p], None
_staged = {}  # (address, shape, strides, dtype) of a caller's tensor -> (it, its exact copy), until ok()


def exact(t):
    """t copied into a malloc that ends where t's last element does, with t's strides and its address
    modulo 16 (so kernels choose the same vector path): under AddressSanitizer (FK_EMU_SANITIZER=address)
    an access past it is reported, as one past a view into a larger torch tensor is not."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    lead = t.data_ptr() % 16
    nbytes = lead + span * t.element_size()
    address = _libc.malloc(nbytes)
    buffer = (ctypes.c_uint8 * nbytes).from_address(address)
    weakref.finalize(buffer, _libc.free, address)
    copy = torch.frombuffer(buffer, dtype=torch.uint8)[lead:].view(t.dtype).as_strided(t.shape, t.stride())
    return copy.copy_(t)


def ptr(t):
    """The address the kernel gets for t: its exact copy (one per tensor and call, so an in-place
    argument passed twice is one buffer); ok() copies every copy back into its tensor."""
    if t is None:
        return None
    if t.numel() == 0:
        return ctypes.c_void_p(t.data_ptr())
    key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
    if key not in _staged:
        _staged[key] = (t, exact(t))
    return ctypes.c_void_p(_staged[key][1].data_ptr())


def i64s(*values):
    return (ctypes.c_int64 * len(values))(*values)


def layout(t):
    """RowLayout of a 2-D tensor, or of [tokens, heads, dim] as two levels."""
    if t.dim() == 2:
        return i64s(t.stride(0), 0, 1)
    return i64s(t.stride(0), t.stride(1), t.shape[1])


def ok(error):
    """A launch's result: no error, and what the kernels wrote copied back (see ptr)."""
    for t, copy in _staged.values():
        t.copy_(copy)
    _staged.clear()
    assert error is None, error.decode()


def nan_like(t):
    return torch.full_like(t, float("nan"))


# ---------------------------------------------------------------- rmsnorm


# Rows held 4 vectors a thread (4096; 12000: 3 of 4 used) and 8 (16-bit with an fp32 weight: the weight after the reduction)
# at 20000 columns, 2 fused (4096, 5125), streamed (40000), scalar (7, 769, 5125).
@pytest.mark.parametrize("rows,cols", [(1, 1), (37, 7), (37, 769), (4, 4096), (3, 5125), (2, 12000), (3, 20000),
                                       (2, 40000)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("weight_fp32", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_kernel(emu, rows, cols, dtype, weight_fp32, residual):
    x = rand((rows, cols), dtype, "cpu", seed=1)
    res = rand((rows, cols), dtype, "cpu", seed=2)
    w = rand((cols,), torch.float32 if weight_fp32 else dtype, "cpu", seed=3)
    check_rmsnorm(emu, x, res if residual else None, w, x if residual else nan_like(x))


def check_rmsnorm(emu, x, res, w, out):
    """The rmsnorm kernel on x (fused with res unless None: in place, out is x) against float64."""
    x_in, res_in = x.clone(), None if res is None else res.clone()
    rows, cols = x.numel() // x.shape[-1], x.shape[-1]
    ok(emu.emu_rmsnorm(ptr(out), ptr(x), None if res is None else ptr(res), ptr(w), rows, cols, layout(out), layout(x),
                       layout(x if res is None else res), DTYPE[x.dtype], DTYPE[w.dtype], ctypes.c_float(1e-6),
                       ctypes.c_float(0.0)))
    if res is not None:
        expected_y, expected_res = ref.fused_add_rmsnorm(x_in.double(), res_in.double(), w.double())
        assert_close(res, expected_res, x.dtype)
        assert_close(out, expected_y, x.dtype)
    else:
        assert_close(out, ref.rmsnorm(x_in.double(), w.double(), 1e-6), x.dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rmsnorm_kernel_layouts(emu, dtype):
    """Strided rows, a misaligned start (scalar path), 16-byte rows that end in a partial vector (wide path
    with a tail), and [tokens, heads, head_dim] views of a qkv buffer."""
    base = rand((37, 4096 + 24), dtype, "cpu", seed=4)
    for cols, x_at, out_at in ((4096, 8, 3), (4096, 1, 3), (4093, 8, 0)):
        x, out = base[:, x_at : x_at + cols], nan_like(base)[:, out_at : out_at + cols]
        w = rand((cols,), dtype, "cpu", seed=5)
        ok(emu.emu_rmsnorm(ptr(out), ptr(x), None, ptr(w), 37, cols, layout(out), layout(x), layout(x), DTYPE[dtype],
                           DTYPE[dtype], ctypes.c_float(1e-6), ctypes.c_float(1.0)))
        assert_close(out, ref.rmsnorm(x.double(), w.double(), 1e-6, 1.0), dtype)
    qkv = rand((9, 12 * 64), dtype, "cpu", seed=6)
    q = qkv[:, : 8 * 64].view(9, 8, 64)
    w = rand((64,), dtype, "cpu", seed=7)
    out = nan_like(q)
    ok(emu.emu_rmsnorm(ptr(out), ptr(q), None, ptr(w), 72, 64, layout(out), layout(q), layout(q), DTYPE[dtype],
                       DTYPE[dtype], ctypes.c_float(1e-6), ctypes.c_float(0.0)))
    assert_close(out, ref.rmsnorm(q.double(), w.double(), 1e-6), dtype)


def test_rmsnorm_rows_over_the_grid(emu):
    """More rows than resident blocks (the emulated device holds 8): each block walks rows, a row spanning
    warps, so the one-barrier reduction alternates its scratch halves (a mutant that does not is a TSan
    race); held in registers, plain and fused."""
    test_rmsnorm_kernel(emu, 24, 4096, torch.bfloat16, weight_fp32=False, residual=False)
    test_rmsnorm_kernel(emu, 24, 4096, torch.bfloat16, weight_fp32=False, residual=True)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_kernel_tails(emu, dtype, residual):
    """16-byte rows whose last vector is partial, on every in-register path (the tail's own element-wise
    loads and stores) and streamed: rows padded to a 16-byte stride (exact allocations: under ASan a read
    past the last row's end is reported)."""
    for cols in (4093, 12003, 20003, 40003):
        stride = (cols + 15) // 16 * 16
        x = rand((3, stride), dtype, "cpu", seed=8)[:, :cols]
        res = rand((3, stride), dtype, "cpu", seed=9)[:, :cols]
        w = rand((cols,), dtype, "cpu", seed=10)
        out = x if residual else torch.full((3, stride), float("nan"), dtype=dtype)[:, :cols]  # 16-byte rows too
        check_rmsnorm(emu, x, res if residual else None, w, out)


@pytest.mark.parametrize("rows,cols", [(1, 1), (37, 769), (300, 128), (2, 20000)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_rmsnorm_backward_kernel(emu, rows, cols, dtype, eps):
    x, dy = rand((rows, cols), dtype, "cpu", seed=8), rand((rows, cols), dtype, "cpu", seed=9)
    w = rand((cols,), torch.float32, "cpu", seed=10)
    dx, dw = nan_like(x), nan_like(w)
    ok(emu.emu_rmsnorm_backward(ptr(dx), ptr(dw), ptr(dy), ptr(x), ptr(w), rows, cols, cols, DTYPE[dtype],
                                DTYPE[w.dtype], ctypes.c_float(eps), ctypes.c_float(0.0)))
    edx, edw = ref.rmsnorm_backward(dy.double(), x.double(), w.double(), eps)
    assert_close(dx, edx, dtype)
    scale = max(1.0, edw.abs().max().item())
    assert_close(dw / scale, edw / scale, torch.float32)


@pytest.mark.parametrize("rows,cols", [(1, 1), (37, 769), (3, 5125), (2, 40000), (300, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_kernels_wave64(emu_wave64, rows, cols, dtype):
    test_rmsnorm_kernel(emu_wave64, rows, cols, dtype, weight_fp32=False, residual=False)
    test_rmsnorm_kernel(emu_wave64, rows, cols, dtype, weight_fp32=True, residual=True)
    test_rmsnorm_backward_kernel(emu_wave64, rows, cols, dtype, eps=1e-6)


# ---------------------------------------------------------------- act_mul / act_and_mul


@pytest.mark.parametrize("rows,cols", [(1, 1), (37, 7), (37, 769), (5, 4096)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("act", sorted(ACT))
def test_act_mul_kernels(emu, rows, cols, dtype, act):
    x = rand((rows, 2 * cols), dtype, "cpu", scale=2.0, seed=11)  # act_and_mul's layout: the halves of one row
    gate, up = x[:, :cols], x[:, cols:]
    out = nan_like(x[:, :cols].contiguous())
    ok(emu.emu_act_mul(ptr(out), ptr(gate), ptr(up), rows, cols, i64s(cols, 2 * cols, 2 * cols), DTYPE[dtype], ACT[act]))
    assert_close(out, ref.act_and_mul(x.double(), act), dtype)
    dy = rand((rows, cols), dtype, "cpu", seed=12)
    dx = nan_like(x)
    ok(emu.emu_act_mul_backward(ptr(dx[:, :cols]), ptr(dx[:, cols:]), ptr(dy), ptr(gate), ptr(up), rows, cols,
                                2 * cols, DTYPE[dtype], ACT[act]))
    assert_close(dx, ref.act_and_mul_backward(dy.double(), x.double(), act), dtype)


# ---------------------------------------------------------------- rope


def rope_call(emu, q, k, positions, freqs, interleave, inverse=False, in_place=False):
    q_out, k_out = (q, k) if in_place else (nan_like(q), nan_like(k))
    cache = freqs.dim() == 2
    strides = i64s(*q_out.stride()[:2], *k_out.stride()[:2], *q.stride()[:2], *k.stride()[:2])
    rotary_dim = freqs.shape[1] if cache else 2 * freqs.shape[0]
    ok(emu.emu_rope(ptr(q_out), ptr(k_out), ptr(q), ptr(k), ptr(positions), int(positions.dtype == torch.int64),
                    None if cache else ptr(freqs), ptr(freqs) if cache else None, freqs.shape[0] if cache else 0,
                    q.shape[0], q.shape[1], k.shape[1], q.shape[2], rotary_dim, strides, int(interleave), int(inverse),
                    int(in_place), DTYPE[q.dtype]))
    return q_out, k_out


@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 96), (72, 68), (10, 6)])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("table", ["inv_freq", "cache"])
def test_rope_kernel(emu, head_dim, rotary_dim, interleave, dtype, table):
    q, k = rand((9, 4, head_dim), dtype, "cpu", seed=13), rand((9, 2, head_dim), dtype, "cpu", seed=14)
    positions = torch.tensor([0, 1, 7, 100, 4000, 3, 99, 12345, 5], dtype=torch.int32)
    inv_freq = theta_inv_freq(rotary_dim, 1e4)
    freqs = cos_sin_cache(inv_freq, 20000) if table == "cache" else inv_freq
    q_out, k_out = rope_call(emu, q, k, positions, freqs, interleave)
    eq, ek = ref.rope(q.double(), k.double(), positions, freqs, interleave)
    assert_close(q_out, eq, dtype)
    assert_close(k_out, ek, dtype)
    back = rope_call(emu, q_out, k_out, positions.long(), freqs, interleave, inverse=True)
    assert_close(back[0], ref.rope(q_out.double(), k_out.double(), positions, freqs, interleave, inverse=True)[0], dtype)


@pytest.mark.parametrize("interleave", [False, True])
def test_rope_kernel_in_place_on_fused_qkv(emu, interleave):
    for offset in (0, 1):  # aligned (16-byte path) and misaligned (scalar path)
        flat = rand((offset + 9 * 12 * 64,), torch.bfloat16, "cpu", seed=15)
        qkv = flat[offset:].view(9, 12 * 64)
        q, k = qkv[:, : 8 * 64].view(9, 8, 64), qkv[:, 8 * 64 : 10 * 64].view(9, 2, 64)
        v_before = qkv[:, 10 * 64 :].clone()
        positions = torch.arange(9) * 17
        inv_freq = theta_inv_freq(64, 1e4)
        eq, ek = ref.rope(q.double(), k.double(), positions, inv_freq, interleave)
        rope_call(emu, q, k, positions, inv_freq, interleave, in_place=True)
        assert_close(q, eq, torch.bfloat16)
        assert_close(k, ek, torch.bfloat16)
        assert torch.equal(qkv[:, 10 * 64 :], v_before)


def test_rope_kernel_cache_out_of_range_is_nan(emu):
    q, k = rand((2, 1, 64), torch.float32, "cpu", seed=16), rand((2, 1, 64), torch.float32, "cpu", seed=17)
    cache = cos_sin_cache(theta_inv_freq(32, 1e4), 10)
    q_out, _ = rope_call(emu, q, k, torch.tensor([3, 10]), cache, False)
    assert not q_out[0].isnan().any()
    assert q_out[1, :, :32].isnan().all() and torch.equal(q_out[1, :, 32:], q[1, :, 32:])


# ---------------------------------------------------------------- merge_states


@pytest.mark.parametrize("n,heads,head_dim", [(1, 3, 7), (2, 40, 128), (7, 2, 256)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("with_other", [False, True])
def test_merge_states_kernel(emu, n, heads, head_dim, dtype, with_other):
    tokens = 5
    v = rand((tokens, n, heads, head_dim), dtype, "cpu", seed=18)
    s = rand((tokens, n, heads), torch.float32, "cpu", seed=19) * 4
    s[1] = float("-inf")  # token 1: empty in the stacked states
    v_other = rand((tokens, heads, head_dim), dtype, "cpu", seed=20) if with_other else None
    s_other = rand((tokens, heads), torch.float32, "cpu", seed=21) if with_other else None
    v_out, s_out = torch.full((tokens, heads, head_dim), float("nan"), dtype=dtype), torch.full((tokens, heads), 7.0)
    ok(emu.emu_merge_states(ptr(v_out), ptr(s_out), ptr(v), ptr(s), ptr(v_other), ptr(s_other), None, tokens, n, heads,
                            head_dim, DTYPE[dtype]))
    all_v, all_s = v, s
    if with_other:
        all_v, all_s = torch.cat([v, v_other[:, None]], 1), torch.cat([s, s_other[:, None]], 1)
    ev, es = ref.merge_states(all_v.double(), all_s.double())
    assert_close(v_out, ev, dtype)
    torch.testing.assert_close(s_out.double(), es, atol=1e-5, rtol=1e-5)


def test_merge_states_kernel_in_place_with_mask(emu):
    tokens, heads, head_dim = 6, 4, 64
    v = rand((tokens, heads, head_dim), torch.float16, "cpu", seed=22)
    s = rand((tokens, heads), torch.float32, "cpu", seed=23)
    v_other, s_other = rand((tokens, heads, head_dim), torch.float16, "cpu", seed=24), rand((tokens, heads), torch.float32, "cpu", seed=25)
    mask = torch.tensor([True, False, True, True, False, True])
    ev, es = ref.merge_state(v.double(), s.double(), v_other.double(), s_other.double())
    v0, s0 = v.clone(), s.clone()
    ok(emu.emu_merge_states(ptr(v), ptr(s), ptr(v), ptr(s), ptr(v_other), ptr(s_other), ptr(mask), tokens, 1, heads,
                            head_dim, DTYPE[torch.float16]))
    assert_close(v[mask], ev[mask], torch.float16)
    torch.testing.assert_close(s[mask].double(), es[mask], atol=1e-5, rtol=1e-5)
    assert torch.equal(v[~mask], v0[~mask]) and torch.equal(s[~mask], s0[~mask])


# ---------------------------------------------------------------- batch attention (decode, multi-query, merge)
# The planner's real plans (the wrappers' plan() on CPU tensors) run through the kernels; the
# three builds cover the three warp tiles: CUDA (mma.sync + ldmatrix), HIP wave64 (MFMA), HIP
# wave32 (plain arithmetic, 8-row warps).


@pytest.fixture(scope="module")
def emu_wave32(tmp_path_factory):
    """The HIP launchers on an emulated wave32 (RDNA) device."""
    lib = build(tmp_path_factory, "hip")
    assert lib.emu_set_device(b"gfx1030")
    return lib


@pytest.fixture(params=["cuda", "hip-wave64", "hip-wave32"])
def attention_lib(request):
    return request.getfixturevalue({"cuda": "emu", "hip-wave64": "emu_wave64", "hip-wave32": "emu_wave32"}[request.param])


FP8_FORMAT = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1, torch.float8_e4m3fnuz: 2, torch.float8_e5m2fnuz: 3}


def run_attention(lib, wrapper, q, paged_kv_cache, grid=None, kv_indices=None, sinks=None, out_scale=1.0, logits=None,
                  k_scale=None, v_scale=None):
    """The kernels on the wrapper's plan: (out, lse), both NaN before the launch; out in the plan's o_data_type;
    logits: [batch, qo_heads, L] float32 for the kv_scores epilogue; an fp8 cache with k_scale / v_scale
    [kv_heads] float32 (or None)."""
    from flashkern._paged_attention import kv_cache_views

    core, info = wrapper._core, wrapper._core._plan_info
    k, v = kv_cache_views("emu", paged_kv_cache, core._kv_layout)
    out, lse = torch.full(q.shape, float("nan"), dtype=info["o_dtype"]), torch.full(q.shape[:2], float("nan"))
    ws = core._workspace
    _, _, _, s_at, v_at = flashkern_C().workspace_layout(ws.numel(), q.shape[0], q.shape[1], q.shape[2])
    indices = kv_indices if kv_indices is not None else info["kv_indices"]
    pointers = (ctypes.c_void_p * len(indices))(*[ptr(t) for t in indices])
    entries = (ctypes.c_int32 * len(indices))(*[t.numel() for t in indices])
    grid = (ctypes.c_int * 4)(*(grid or info["grid"]))
    mask = info["custom_mask"]
    # the plan's words and the partial states the plan uses, each its own exact buffer
    states = info["slots"] * q.shape[1]
    plan = ws[: 4 * info["words"]]
    partial_s, partial_v = ws[s_at : s_at + 4 * states], ws[v_at : v_at + 4 * states * q.shape[2]]
    ok(lib.emu_batch_attention(ptr(out), ptr(lse), ptr(q), i64s(*q.stride()[:2]), ptr(k), ptr(v),
                               i64s(*k.stride()[:3], *v.stride()[:3]), k.shape[0], pointers, entries, len(indices),
                               ptr(plan), ptr(partial_s), ptr(partial_v), grid,
                               q.shape[0], q.shape[1], k.shape[2], q.shape[2], k.shape[1],
                               ctypes.c_float(info["sm_scale"]), DTYPE[q.dtype], ptr(sinks), ctypes.c_float(out_scale),
                               DTYPE[out.dtype], ptr(mask), 0 if mask is None else mask.numel(),
                               ctypes.c_float(info["logits_soft_cap"]), ptr(logits),
                               0 if logits is None else logits.shape[2], FP8_FORMAT.get(k.dtype, -1), ptr(k_scale),
                               ptr(v_scale)))
    return out, lse


def flashkern_C():
    from flashkern import _C

    return _C


def check_attention(out, lse, expected_o, expected_lse, dtype):
    assert_close(out, expected_o, dtype)
    torch.testing.assert_close(lse.double(), expected_lse.double(), atol=1e-5, rtol=1e-5)


def decode_plan(lengths, page_size, kv_heads, group, head_dim, dtype, kv_layout="NHD", seed=0, min_chunk=64,
                kv_dtype=None):
    from paged_kv import paged, random_kv

    import flashkern

    kv_dtype = kv_dtype or dtype
    cache, indptr, indices, last = paged(random_kv(lengths, kv_heads, head_dim, seed), page_size, kv_layout, kv_dtype,
                                         seed=seed)
    q = rand((len(lengths), kv_heads * group, head_dim), dtype, "cpu", seed=seed + 1)
    wrapper = flashkern.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(16 << 20, dtype=torch.uint8), kv_layout)
    wrapper._core._min_chunk = min_chunk
    wrapper.plan(indptr, indices, last, kv_heads * group, kv_heads, head_dim, page_size, q_data_type=dtype,
                 kv_data_type=kv_dtype)
    wrapper._test_tables = (indptr, indices, last)
    expected = ref.batch_decode(q.double(), cache.double(), indptr, indices, last, kv_layout)
    return wrapper, q, cache, expected


# (group, head_dim, page_size, dtype): every decode group, the 16-row tile (5..16 heads), the 64-row tile;
# head_dim 512 (16-row tiles only, the output dims split over warps) with 1 to 32 heads a group
ATTENTION_CASES = [
    (1, 64, 16, torch.float16), (2, 128, 1, torch.bfloat16), (3, 256, 16, torch.float16), (4, 128, 128, torch.bfloat16),
    (5, 128, 16, torch.float16), (8, 64, 1, torch.bfloat16), (16, 256, 16, torch.bfloat16), (7, 128, 128, torch.float16),
    (24, 128, 16, torch.bfloat16), (32, 64, 16, torch.float16), (32, 256, 3, torch.bfloat16),
    (1, 512, 16, torch.float16), (4, 512, 1, torch.bfloat16), (32, 512, 16, torch.float16),
]


@pytest.mark.parametrize("group,head_dim,page_size,dtype", ATTENTION_CASES)
def test_batch_attention_kernels(attention_lib, group, head_dim, page_size, dtype):
    """Odd lengths, an empty request and one split into chunks that the merge kernel combines."""
    wrapper, q, cache, (eo, e_lse) = decode_plan([1, 37, 0, 300], page_size, 2, group, head_dim, dtype)
    assert wrapper._core._plan_info["grid"][3] == 1  # something to merge
    check_attention(*run_attention(attention_lib, wrapper, q, cache), eo, e_lse, dtype)


# (group, head_dim, page_size, dtype, fp8 format): the decode kernel, the 16-row and the 64-row tiles
FP8_CASES = [
    (1, 128, 16, torch.float16, torch.float8_e4m3fn), (4, 64, 1, torch.bfloat16, torch.float8_e5m2),
    (8, 256, 16, torch.bfloat16, torch.float8_e4m3fn), (32, 128, 3, torch.float16, torch.float8_e5m2),
    (2, 128, 16, torch.bfloat16, torch.float8_e4m3fnuz), (24, 64, 16, torch.float16, torch.float8_e5m2fnuz),
    (24, 256, 5, torch.float16, torch.float8_e4m3fn), (2, 512, 16, torch.bfloat16, torch.float8_e4m3fn),
    (16, 512, 5, torch.float16, torch.float8_e5m2),
]


@pytest.mark.parametrize("group,head_dim,page_size,dtype,fp8", FP8_CASES)
def test_batch_attention_kernels_fp8(request, attention_lib, group, head_dim, page_size, dtype, fp8):
    """An fp8 cache (NaN in its unused slots) with per-head k_scale and v_scale: the kernels equal float64
    attention over the dequantized values. The fnuz formats are AMD's: the CUDA launcher refuses them."""
    nvidia = request.node.callspec.params["attention_lib"] == "cuda"
    check_fp8_attention(attention_lib, nvidia, group, head_dim, page_size, dtype, fp8)


def check_fp8_attention(lib, nvidia, group, head_dim, page_size, dtype, fp8, one_block=False):
    """one_block: a grid of one block per kernel, which loops over the items (the staging across items)."""
    wrapper, q, cache, _ = decode_plan([1, 37, 0, 300], page_size, 2, group, head_dim, dtype, kv_dtype=fp8)
    k_scale, v_scale = torch.tensor([0.75, 1.5]), torch.tensor([1.25, 0.5])
    if nvidia and "fnuz" in str(fp8):
        with pytest.raises(AssertionError, match="fp8 format"):
            run_attention(lib, wrapper, q, cache, k_scale=k_scale, v_scale=v_scale)
        return
    assert wrapper._core._plan_info["grid"][3] == 1  # something to merge
    scale = torch.stack([k_scale, v_scale]).double()[None, :, None, :, None]  # [pages, K/V, slot, head, D]
    eo, e_lse = ref.batch_decode(q.double(), cache.double() * scale, *wrapper._test_tables, "NHD")
    grid = [1 if c else 0 for c in wrapper._core._plan_info["counts"]] + [1] if one_block else None
    check_attention(*run_attention(lib, wrapper, q, cache, k_scale=k_scale, v_scale=v_scale, grid=grid), eo, e_lse,
                    dtype)


@pytest.mark.parametrize("kv_layout,tuple_cache", [("HND", False), ("NHD", True)])
def test_batch_attention_kernels_layouts(emu, kv_layout, tuple_cache):
    for group in (4, 8):
        wrapper, q, cache, (eo, e_lse) = decode_plan([20, 129], 16, 2, group, 128, torch.float16, kv_layout, seed=3)
        kv = (cache[:, 0], cache[:, 1]) if tuple_cache else cache
        check_attention(*run_attention(emu, wrapper, q, kv), eo, e_lse, torch.float16)


def test_batch_attention_kernels_loop_over_items(attention_lib):
    """A fixed grid smaller than the plan (what a captured graph launches): blocks loop over items."""
    for group, head_dim in ((2, 64), (5, 64), (32, 64), (5, 512)):
        wrapper, q, cache, (eo, e_lse) = decode_plan([70, 1, 200, 9, 150], 16, 1, group, head_dim, torch.bfloat16,
                                                     seed=4)
        counts = wrapper._core._plan_info["counts"]
        assert max(counts) > 2
        check_attention(*run_attention(attention_lib, wrapper, q, cache, grid=[2 if c else 0 for c in counts] + [1]),
                        eo, e_lse, torch.bfloat16)
    for group, head_dim in ((4, 128), (8, 256), (32, 256)):  # an fp8 cache: the decode kernel, 16- and 64-row tiles
        check_fp8_attention(attention_lib, False, group, head_dim, 16, torch.float16, torch.float8_e4m3fn, True)


@pytest.mark.parametrize("bad_page", ["past_the_end", "minus_one", "past_the_page_table"])
def test_batch_attention_kernels_page_outside_the_cache(attention_lib, bad_page):
    """A page table naming a page the cache does not have (a stale plan, or -1 padding in a graph's
    page-table buffer), or shorter than the plan's (a plan made for other page tables): that request's
    output is NaN, the others are right, and nothing past the page table is read (ASan)."""
    for group in (4, 8, 32):
        wrapper, q, cache, (eo, e_lse) = decode_plan([40, 40, 40], 16, 1, group, 64, torch.float16, seed=5)
        bad = wrapper._core._plan_info["kv_indices"][0].clone()  # 3 pages a request
        if bad_page == "past_the_page_table":
            bad, failing = bad[:-1].clone(), 2  # request 2's last page is missing
        else:
            bad[3], failing = cache.shape[0] + 5 if bad_page == "past_the_end" else -1, 1  # request 1's second page
        out, lse = run_attention(attention_lib, wrapper, q, cache, kv_indices=[bad])
        assert out[failing].isnan().all() and lse[failing].isnan().all()
        keep = torch.tensor([i for i in range(3) if i != failing])
        check_attention(out[keep], lse[keep], eo[keep], e_lse[keep], torch.float16)


def test_batch_attention_kernels_each_raise_their_own_shared_memory_limit(emu):
    """The ten multi-query kernels that need more than 48 KB of shared memory (16- and 64-row tiles at
    head_dim 128 and 256, the 16-row tile at 512, fp16 and bf16) each get their own opt-in: all run in one
    process. The emulator, as a GPU, refuses a launch above 48 KB without the kernel's own cudaFuncSetAttribute."""
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim in (128, 256, 512):
            for group in (8, 32) if head_dim < 512 else (8,):  # 8 rows: the 16-row tile; 32 rows: the 64-row tile
                wrapper, q, cache, (eo, e_lse) = decode_plan([37, 5], 16, 1, group, head_dim, dtype, seed=9)
                counts = wrapper._core._plan_info["counts"]
                assert counts[1 if group == 8 else 2] > 0
                check_attention(*run_attention(emu, wrapper, q, cache), eo, e_lse, dtype)


# (threads, grid y, dynamic shared bytes, opt-in bytes or -1): what a GPU answers
LAUNCH_LIMITS = [
    ((1024, 3, 48 * 1024, -1), None),
    ((1025, 1, 0, -1), "invalid configuration argument"),
    ((32, 65536, 0, -1), "invalid configuration argument"),
    ((0, 1, 0, -1), "invalid configuration argument"),
    ((128, 1, 48 * 1024 + 16, -1), "invalid argument"),  # above 48 KB without the opt-in
    ((128, 1, 100 * 1024, 100 * 1024), None),
    ((128, 1, 100 * 1024, 64 * 1024), "invalid argument"),  # above what the kernel was allowed
    ((128, 1, 227 * 1024 + 16, 228 * 1024), "invalid argument"),  # above sm_90's maximum: the opt-in fails
]


@pytest.mark.parametrize("launch,error", LAUNCH_LIMITS)
def test_emulator_refuses_what_a_gpu_refuses(emu, launch, error):
    """A probe kernel (tests/emu/emu_ops.cpp) on the emulated sm_90: each refusal with CUDA's error string,
    and a kernel that was allowed runs on every thread."""
    result = emu.emu_launch_probe(*launch)
    assert result == (error.encode() if error else None)
    assert emu.emu_launch_probe(128, 1, 0, -1) is None  # and the error is not left for the next launch


def test_batch_attention_kernels_nan_is_not_hidden(attention_lib):
    """NaN reaches the output however the maxima treat it: a bad page in every chunk of a split request,
    and a NaN q (every logit NaN), for both kernels."""
    for group in (4, 8):
        wrapper, q, cache, (eo, e_lse) = decode_plan([400, 30, 30], 16, 1, group, 64, torch.float16, seed=8)
        assert wrapper._core._plan_info["chunk"] < 400  # request 0 is split
        bad = wrapper._core._plan_info["kv_indices"][0].clone()
        bad[:25] = cache.shape[0] + 1  # all of request 0's pages
        q = q.clone()
        q[1, 0] = float("nan")
        out, lse = run_attention(attention_lib, wrapper, q, cache, kv_indices=[bad])
        assert out[0].isnan().all() and lse[0].isnan().all()
        assert out[1, 0].isnan().all() and lse[1, 0].isnan()
        check_attention(out[2], lse[2], eo[2], e_lse[2], torch.float16)


@pytest.mark.parametrize("group,head_dim", [(1, 128), (5, 128), (5, 512)])
def test_cascade_kernels(attention_lib, group, head_dim):
    """A 300-token prefix shared by 20 requests (rows straddle 64-row tiles for group 5, 16-row ones at
    head_dim 512) and their suffixes."""
    from paged_kv import i32, paged, random_kv

    import flashkern

    batch, kv_heads = 20, 2
    suffixes = [(7 * b) % 41 for b in range(batch)]  # some empty
    kvs = random_kv([300] + suffixes, kv_heads, head_dim, seed=6)
    cache, indptr, indices, last = paged(kvs, 16, "NHD", torch.bfloat16, seed=6)
    levels = ([i32([0, batch]), i32(list(range(batch + 1)))], [indptr[:2], indptr[1:] - indptr[1]],
              [indices[: indptr[1]], indices[indptr[1] :]], [last[:1], last[1:]])
    q = rand((batch, kv_heads * group, head_dim), torch.bfloat16, "cpu", seed=7)
    wrapper = flashkern.MultiLevelCascadeAttentionWrapper(2, torch.zeros(16 << 20, dtype=torch.uint8))
    wrapper._core._min_chunk = 64
    wrapper.plan(*levels, kv_heads * group, kv_heads, head_dim, 16, q_data_type=torch.bfloat16)
    eo, e_lse = ref.cascade_decode(q.double(), cache.double(), *levels)
    check_attention(*run_attention(attention_lib, wrapper, q, cache), eo, e_lse, torch.bfloat16)


@pytest.mark.parametrize("group,q_len", [(1, 3), (4, 4), (8, 4), (5, 13)])
def test_batch_attention_kernels_causal_queries(attention_lib, group, q_len):
    """q_len_per_req: each request's last q_len tokens as queries, causal among themselves, on the
    16-row tiles (q_len * group <= 16) and the 64-row ones (rows of one query straddling two tiles for
    group 5): a request of exactly q_len tokens, a split one (queries that see no key: the causal prefill
    with more queries than keys)."""
    from paged_kv import causal_expected, paged, random_kv, rounded

    import flashkern

    lengths, dtype = [q_len, 37, q_len + 1, 300], torch.float16
    kvs = random_kv(lengths, 2, 64, seed=40)
    cache, indptr, indices, last = paged(kvs, 16, "NHD", dtype, seed=40)
    q = rand((len(lengths) * q_len, 2 * group, 64), dtype, "cpu", seed=41)
    wrapper = flashkern.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(16 << 20, dtype=torch.uint8))
    wrapper._core._min_chunk = 64
    wrapper.plan(indptr, indices, last, 2 * group, 2, 64, 16, q_data_type=dtype, q_len_per_req=q_len)
    assert wrapper._core._plan_info["chunk"] < 300
    expected = causal_expected(q, rounded(kvs, dtype), q_len)
    check_attention(*run_attention(attention_lib, wrapper, q, cache), torch.stack([o for o, _ in expected]),
                    torch.stack([s for _, s in expected]), dtype)


@pytest.mark.parametrize("group", [2, 8, 32])  # the decode kernel, the 16-row and 64-row tiles
def test_batch_attention_kernels_sinks_out_dtype_and_scale(attention_lib, group):
    """How a query's attention is finished, where each writer does it (a query with one state, the
    merge of a split one, a request without keys): the head's sink, out_scale, and out in the other
    16-bit type (o_data_type)."""
    from paged_kv import attention, paged, random_kv, rounded

    import flashkern

    lengths, dtype = [29, 0, 400], torch.bfloat16
    kvs = random_kv(lengths, 1, 128, seed=42)
    cache, indptr, indices, last = paged(kvs, 16, "NHD", dtype, seed=42)
    q = rand((len(lengths), group, 128), dtype, "cpu", seed=43)
    sinks = rand((group,), torch.float32, "cpu", seed=44) * 4
    wrapper = flashkern.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(16 << 20, dtype=torch.uint8))
    wrapper._core._min_chunk = 64
    wrapper.plan(indptr, indices, last, group, 1, 128, 16, q_data_type=dtype, o_data_type=torch.float16)
    assert wrapper._core._plan_info["grid"][3] == 1  # request 2 is split and merged
    out, lse = run_attention(attention_lib, wrapper, q, cache, sinks=sinks, out_scale=0.5)
    assert out.dtype == torch.float16
    expected = [attention(q[b], k, v, sinks=sinks) for b, (k, v) in enumerate(rounded(kvs, dtype))]
    check_attention(out, lse, 0.5 * torch.stack([o for o, _ in expected]), torch.stack([s for _, s in expected]),
                    torch.float16)


# 16-row tiles, 64-row tiles with queries straddling two, 64-row; head_dim 512: 16-row tiles, queries straddling two
@pytest.mark.parametrize("group,head_dim", [(2, 64), (5, 64), (8, 64), (5, 512)])
def test_prefill_kernels_masks(attention_lib, group, head_dim):
    """Prefill (ragged KV: one-token pages, the identity page table) through every tile shape: causal
    with a sliding window and a soft cap, split; a custom mask (random, a row that sees nothing)."""
    from test_prefill import expected_batch, indptr, random_masks, ragged

    from paged_kv import random_kv, rounded

    import flashkern

    dtype = torch.float16
    for qo_lens, kv_lens, options in (([6, 40], [6, 300], dict(causal=True, window_left=17, logits_soft_cap=30.0)),
                                      ([7, 3], [20, 9], dict(masks=True))):
        kvs = random_kv(kv_lens, 2, head_dim, seed=45)
        q = rand((sum(qo_lens), 2 * group, head_dim), dtype, "cpu", scale=3.0, seed=46)
        masks = None
        if options.pop("masks", False):
            masks = random_masks(qo_lens, kv_lens, 47)
            masks[0][2] = False
            options["custom_mask"] = torch.cat([m.reshape(-1) for m in masks])
        wrapper = flashkern.BatchPrefillWithRaggedKVCacheWrapper(torch.zeros(16 << 20, dtype=torch.uint8))
        wrapper._core._min_chunk = 64
        wrapper.plan(indptr(qo_lens), indptr(kv_lens), 2 * group, 2, head_dim, q_data_type=dtype, **options)
        k, v = ragged(kvs, dtype, "cpu")
        out, lse = run_attention(attention_lib, wrapper, q, (k[:, None], v[:, None]))
        eo, e_lse = expected_batch(q, rounded(kvs, dtype), qo_lens, options.get("causal", False),
                                   options.get("window_left", -1), masks, options.get("logits_soft_cap"))
        check_attention(out, lse, eo, e_lse, dtype)


def test_decode_kernel_window_and_soft_cap(attention_lib):
    """The decode kernel (one query, GQA group <= 4): a window trims the chunk's start, split or not."""
    from test_prefill import expected_batch

    from paged_kv import paged, random_kv, rounded

    import flashkern

    lengths, dtype = [300, 5, 70], torch.bfloat16
    kvs = random_kv(lengths, 2, 128, seed=48)
    cache, kv_indptr, kv_indices, last = paged(kvs, 16, "NHD", dtype, seed=48)
    q = rand((3, 4, 128), dtype, "cpu", scale=3.0, seed=49)
    wrapper = flashkern.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(16 << 20, dtype=torch.uint8))
    wrapper._core._min_chunk = 64
    wrapper.plan(kv_indptr, kv_indices, last, 4, 2, 128, 16, q_data_type=dtype, window_left=100, logits_soft_cap=20.0)
    assert wrapper._core._plan_info["counts"][0] > 3  # the long request is split, its first chunks skipped
    eo, e_lse = expected_batch(q, rounded(kvs, dtype), [1, 1, 1], False, 100, cap=20.0)
    check_attention(*run_attention(attention_lib, wrapper, q, cache), eo, e_lse, dtype)


# ---------------------------------------------------------------- sampling, renormalization, speculative
# Direct launches on every build (warp 32, wave64, wave32): the kept sets of ref.sampling.kept, the
# renormalization bit for bit in its kept tokens, the tree walk against ref.sampling.speculative.

FILTER = {"none": 0, "top_k": 1, "top_p": 2, "min_p": 3, "top_k_top_p": 4}
RENORM = {"top_k_probs": 0, "top_p_probs": 1, "top_k_logits": 2}


def sampling_rows(rows, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2, 1)
    p[:, 2:7] = p[:, 2:3]  # a tie run
    if rows > 1:
        p[1] = 1.0 / vocab  # flat: rounds of ties
    return (p / p.sum(1, keepdim=True)).float()


@pytest.mark.parametrize("filter", list(FILTER))
@pytest.mark.parametrize("vocab", [1024, 1031])  # 16-byte vectors; a scalar row with a tail
def test_sampling_kernel(attention_lib, filter, vocab, rows=3):
    lib = attention_lib
    probs = sampling_rows(rows, vocab, seed=vocab)
    indices = (torch.tensor([0, 1, 2, 2, 0], dtype=torch.int32) % rows)[: rows + 2]  # rows sampled twice
    out, valid = torch.full((indices.shape[0],), -7, dtype=torch.int32), torch.zeros(indices.shape[0], dtype=torch.bool)
    top_k, top_p, min_p = 6, 0.6, 0.2
    ok(lib.emu_sampling(ptr(out), ptr(valid), ptr(probs), ctypes.c_int64(rows), ctypes.c_int64(vocab), ptr(indices),
                        ctypes.c_int64(indices.shape[0]), FILTER[filter], ctypes.c_int64(top_k), ctypes.c_float(top_p),
                        ctypes.c_float(min_p), ctypes.c_int64(11), None))
    n = indices.shape[0]
    keep = ref.sampling.kept(probs[indices.long()],
                             top_k=torch.full((n,), top_k) if "top_k" in filter else None,
                             top_p=torch.full((n,), top_p) if "top_p" in filter else None,
                             min_p=torch.full((n,), min_p) if filter == "min_p" else None)
    assert valid.all()
    assert keep[torch.arange(n), out.long()].all(), out


@pytest.mark.parametrize("kind", list(RENORM))
@pytest.mark.parametrize("dtype,vocab", [(torch.float32, 1027), (torch.bfloat16, 1024), (torch.float16, 2053)])
def test_renorm_kernel(attention_lib, kind, dtype, vocab, rows=3):
    lib = attention_lib
    probs = sampling_rows(rows, vocab, seed=3).to(dtype)
    x = torch.log(probs.float()).to(dtype) if kind == "top_k_logits" else probs
    out = torch.full_like(x, float("nan"))
    ok(lib.emu_renorm(ptr(out), ptr(x), ctypes.c_int64(rows), ctypes.c_int64(vocab), DTYPE[dtype], RENORM[kind],
                      ctypes.c_int64(4), ctypes.c_float(0.5)))
    expected = ref.sampling.renorm(x, kind, top_k=torch.full((rows,), 4), top_p=torch.full((rows,), 0.5))
    if kind == "top_k_logits":
        assert torch.equal(out, expected)
    else:
        assert torch.equal(out > 0, expected > 0)
        torch.testing.assert_close(out.double(), expected.double(), atol=1e-6 if dtype == torch.float32 else 1e-2,
                                   rtol=1e-5 if dtype == torch.float32 else 1e-2)


# (dtype, vocab, row stride, offset of the first row in elements): a row of one chunk, exactly one, the
# chunks of a 32K vocabulary, a tail past them, 16-bit rows whose starts fall anywhere (a scalar head),
# rows one element into their buffer (input and output disagree on alignment: the scalar write path)
SOFTMAX_CASES = [(torch.float32, 111, 111, 0), (torch.bfloat16, 4096, 4096, 0), (torch.float16, 32000, 32000, 0),
                 (torch.float32, 20001, 20001, 0), (torch.bfloat16, 4099, 4099, 0), (torch.float32, 1030, 1031, 1),
                 (torch.float16, 16390, 16400, 3)]


def run_softmax(lib, x, temperature=None, t=1.0):
    """x: a [rows, vocab] view (last dimension contiguous) -> the kernel's probabilities."""
    rows, vocab = x.shape
    out = torch.full((rows, vocab), float("nan"), dtype=torch.float32)
    partial = torch.full((max(rows * lib.emu_softmax_chunks(vocab), 1), 2), float("nan"))  # ops.h: softmax_chunks
    ok(lib.emu_softmax(ptr(out), ptr(x), ctypes.c_int64(rows), ctypes.c_int64(vocab), ctypes.c_int64(x.stride(0)),
                       DTYPE[x.dtype], None if temperature is None else ptr(temperature), ctypes.c_float(t),
                       ptr(partial)))
    return out


@pytest.mark.parametrize("dtype,vocab,stride,offset", SOFTMAX_CASES)
def test_softmax_kernel(attention_lib, dtype, vocab, stride, offset, rows=3):
    """Every path: one and several chunks, 16-byte bodies with scalar heads and tails, the scalar write;
    -inf logits, a row of -inf only and a NaN (NaN rows, as torch.softmax), per-row temperatures."""
    g = torch.Generator().manual_seed(vocab)
    buf = (torch.randn(offset + rows * stride, generator=g, dtype=torch.float64) * 3).to(dtype)
    x = buf[offset:].as_strided((rows, vocab), (stride, 1))
    x[0, ::7] = float("-inf")
    t = torch.tensor([0.7, 1.0, 2.5])[:rows]
    out = run_softmax(attention_lib, x, t)
    expected = ref.sampling.softmax(x, t)
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=1e-5)
    x[1] = float("-inf")
    x[2, vocab // 2] = float("nan")
    out = run_softmax(attention_lib, x, None, 0.5)
    torch.testing.assert_close(out[0].double(), ref.sampling.softmax(x[:1], 0.5)[0], atol=1e-6, rtol=1e-5)
    assert out[1:].isnan().all()


@pytest.mark.parametrize("mode", ["greedy", "sample", "sample_no_draft", "chain"])
def test_speculative_kernel(attention_lib, mode, batch=3, vocab=1031):
    """Greedy: the reference walk exactly. Sampling: a path of the tree, candidates' tokens along it,
    the emitted token in the vocabulary, counts consistent (the distribution: tests/test_speculative.py)."""
    lib = attention_lib
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3], dtype=torch.int32)
    nodes = parents.shape[0] if mode != "chain" else 4
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(batch, nodes, vocab, generator=g) * 3
    target = torch.softmax(logits, -1) if mode != "greedy" else logits
    draft = torch.softmax(torch.randn(batch, nodes, vocab, generator=g) * 3, -1) if mode in ("sample", "chain") else None
    first = 1 if mode == "chain" else 0
    cand = torch.randint(0, vocab, (batch, nodes - first), generator=g, dtype=torch.int32)
    cand[:, 1 - first] = torch.argmax(target[:, 0], -1)  # the first child matches greedily / is likely
    tokens, path = torch.full((batch, nodes), -7, dtype=torch.int32), torch.full((batch, nodes - 1), -7, dtype=torch.int32)
    accepted, independent = torch.full((batch,), -7, dtype=torch.int32), torch.full((batch,), -7, dtype=torch.int32)
    par = None if mode == "chain" else parents[:nodes]
    ok(lib.emu_speculative(ptr(tokens), ptr(path), ptr(accepted), ptr(independent), ptr(cand), first, ptr(par),
                           ptr(target), ptr(draft), ctypes.c_int64(batch), nodes, ctypes.c_int64(vocab),
                           DTYPE[torch.float32], 0 if mode == "greedy" else 1, ctypes.c_int64(2)))
    if mode == "greedy":
        e_tokens, e_path, e_accepted, _ = ref.sampling.speculative(target, None, cand, first, par, "greedy", None)
        assert torch.equal(tokens, e_tokens) and torch.equal(path, e_path) and torch.equal(accepted, e_accepted)
        return
    chain = list(range(-1, nodes - 1))
    for b in range(batch):
        k = int(accepted[b])
        u = 0
        for i in range(k):  # each accepted node is a child of the one before
            c = int(path[b, i])
            assert (chain if par is None else par.tolist())[c] == u
            assert tokens[b, i] == cand[b, c - first]
            u = c
        assert 0 <= tokens[b, k] < vocab
        assert (tokens[b, k + 1:] == -1).all() and (path[b, k:] == -1).all()
        assert independent[b] == 0 if mode != "chain" else 0 <= independent[b] <= nodes - 1


# ---------------------------------------------------------------- the training step
# The multi-tensor norm and AdamW on every build against ref.optim: ragged sizes (one element, a
# scalar tail, more than one chunk), 16-byte vectors and an unaligned tensor's scalar path, mixed dtypes.

NORM_KIND = {2.0: 0, 1.0: 1, 3.0: 2, float("inf"): 3}
OPTIM_SIZES = [1, 7, 4097, 65536 + 3]


def optim_tensors(dtypes, seed, scale=1.0):
    """Gradients of OPTIM_SIZES (the third a view one element into its buffer: unaligned)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (n, dtype) in enumerate(zip(OPTIM_SIZES, dtypes)):
        t = (torch.randn(n + 1, generator=g) * scale).to(dtype)
        out.append(t[1:] if i == 2 else t[:n])
    return out


def pointers(tensors):
    return (ctypes.c_void_p * len(tensors))(*[ptr(t).value if t is not None else None for t in tensors])


def optim_shape(tensors):
    return (i64s(*[t.numel() for t in tensors]), (ctypes.c_int * len(tensors))(*[DTYPE[t.dtype] for t in tensors]),
            ctypes.c_int64(len(tensors)))


@pytest.mark.parametrize("norm_type,per_tensor", [(2.0, False), (1.0, True), (3.0, False), (float("inf"), True)])
def test_grad_norm_kernel(attention_lib, norm_type, per_tensor):
    lib = attention_lib
    grads = optim_tensors([torch.float32, torch.bfloat16, torch.float16, torch.float32], seed=1)
    n = len(grads)
    total, norms, found_inf = torch.full((), float("nan")), torch.full((n,), float("nan")), torch.full((), 7.0)
    coef = torch.full((n if per_tensor else 1,), float("nan"))
    ok(lib.emu_grad_norm(ptr(total), ptr(norms), ptr(coef), ptr(found_inf), pointers(grads), *optim_shape(grads),
                         ctypes.c_float(norm_type), NORM_KIND[norm_type], ctypes.c_float(5.0), int(per_tensor)))
    e_total, e_norms, e_coef, e_inf = ref.optim.grad_norm(grads, norm_type, 5.0, per_tensor)
    torch.testing.assert_close(total, e_total, rtol=2e-6, atol=0)
    torch.testing.assert_close(norms, e_norms, rtol=2e-6, atol=0)
    torch.testing.assert_close(coef, e_coef, rtol=2e-6, atol=0)
    assert float(found_inf) == float(e_inf) == 0.0
    grads[3][70000 - 65536 + 1] = float("nan") if norm_type != 1.0 else float("inf")  # in the second chunk
    ok(lib.emu_grad_norm(ptr(total), ptr(norms), None, ptr(found_inf), pointers(grads), *optim_shape(grads),
                         ctypes.c_float(norm_type), NORM_KIND[norm_type], ctypes.c_float(0.0), 0))
    assert not torch.isfinite(total) and float(found_inf) == 1.0
    assert torch.isfinite(norms[:3]).all() and not torch.isfinite(norms[3])


def adamw_state(dtypes, master, seed=2):
    g = torch.Generator().manual_seed(seed)
    params = optim_tensors(dtypes, seed)
    grads = optim_tensors(dtypes, seed + 1, scale=0.1)
    m = [torch.randn(t.numel(), generator=g) * 0.01 for t in params]
    v = [torch.rand(t.numel(), generator=g) * 1e-4 for t in params]
    masters = [p.float() + torch.randn(p.numel(), generator=g) * 1e-3 if master and p.dtype != torch.float32
               else torch.empty(0) for p in params]
    steps = [torch.tensor(float(s)) for s in (0, 3, 10, 1)]
    return params, grads, m, v, masters, steps


MIXED = [torch.bfloat16, torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtypes,master,clip", [([torch.float32] * 4, False, None), (MIXED, False, "per_tensor"),
                                                (MIXED, True, "global")], ids=["fp32", "mixed", "mixed-master"])
def test_adamw_kernel(attention_lib, dtypes, master, clip):
    lib = attention_lib
    params, grads, m, v, masters, steps = adamw_state(dtypes, master)
    expected = [[t.clone() for t in ts] for ts in (params, m, v, masters, steps)]
    coef = {None: None, "global": torch.tensor([0.25]), "per_tensor": torch.tensor([1.0, 0.5, 0.125, 0.75])}[clip]
    lr = torch.tensor(3e-3)
    ok(lib.emu_adamw(pointers(params), pointers(grads), pointers(m), pointers(v),
                     pointers([t if t.numel() else None for t in masters]), pointers(steps), *optim_shape(params),
                     ptr(lr), 0.0, 0.9, 0.999, ctypes.c_float(1e-3), 0.1, ptr(coef),
                     int(clip == "per_tensor"), None, 0))  # eps 1e-3: comparable to sqrt(v_hat), so it counts
    e_params, e_m, e_v, e_masters, e_steps = expected
    ref.optim.adamw(e_params, grads, e_m, e_v, e_masters, e_steps, 3e-3, 0.9, 0.999, 1e-3, 0.1, False, coef,
                    clip == "per_tensor", None)
    for got, want in zip(params + m + v + masters + steps, e_params + e_m + e_v + e_masters + e_steps):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)  # fp32 arithmetic in torch's order
    before = [t.clone() for t in params + m + v + masters + steps]
    found_inf = torch.tensor(1.0)
    ok(lib.emu_adamw(pointers(params), pointers(grads), pointers(m), pointers(v),
                     pointers([t if t.numel() else None for t in masters]), pointers(steps), *optim_shape(params),
                     None, 1e-3, 0.9, 0.999, ctypes.c_float(1e-8), 0.1, None, 0, ptr(found_inf), 1))
    for got, want in zip(params + m + v + masters + steps, before):
        assert torch.equal(got, want)  # skipped: nothing written


# ---------------------------------------------------------------- KV-cache compression


def kv_case(lengths, kv_heads, head_dim, page_size, dtype, seed=0):
    """A shuffled paged cache (NaN in unowned slots) as (k, v) views [pages, page_size, kv_heads, D], its page table."""
    from paged_kv import paged, random_kv

    cache, indptr, indices, last = paged(random_kv(lengths, kv_heads, head_dim, seed), page_size, "NHD", dtype,
                                         seed=seed)
    return cache[:, 0], cache[:, 1], indptr, indices, last


def run_kv_scores(lib, scores, q, lse, k, qo_indptr, indptr, indices, last, causal=True, window_left=-1, cap=0.0,
                  scale=1.0, accumulate=False, logits=None, max_kv_len=None):
    """max_kv_len (sizes the grid): the longest request's by default; shorter, a block loops over key tiles."""
    lengths = [(int(indptr[b + 1] - indptr[b]) - 1) * k.shape[1] + int(last[b]) for b in range(len(last))]
    ok(lib.emu_kv_scores(ptr(scores), ptr(q), i64s(*q.stride()[:2]), ptr(lse), ptr(k), i64s(*k.stride()[:3]),
                         ptr(qo_indptr), ptr(indptr), ptr(indices), ptr(last), k.shape[0],
                         max(lengths) if max_kv_len is None else max_kv_len,
                         len(lengths), q.shape[1], k.shape[2], q.shape[2], k.shape[1], window_left,
                         ctypes.c_float(q.shape[2] ** -0.5), ctypes.c_float(cap), ctypes.c_float(scale), int(causal),
                         int(accumulate), DTYPE[q.dtype], ptr(logits), 0 if logits is None else logits.shape[2]))


@pytest.mark.parametrize("group,head_dim,page_size,qo_lens", [(1, 64, 1, [1, 1, 1]), (4, 128, 16, [64, 9, 1]),
                                                              (8, 256, 16, [33, 2, 70]), (3, 128, 5, [130, 1, 20])])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kv_scores_kernel(attention_lib, group, head_dim, page_size, qo_lens, dtype):
    """Decode (one query), windows (several 8-row chunks), prefill-long rows (a query per position, row
    skipping at the causal diagonal), key tiles with tails, against float64; accumulate on a second call,
    with a grid of one block a request and head (each loops over the key tiles, as under CUDA graphs)."""
    lengths, kv_heads = [150, 64, 70], 2
    k, v, indptr, indices, last = kv_case(lengths, kv_heads, head_dim, page_size, dtype)
    q = rand((sum(qo_lens), kv_heads * group, head_dim), dtype, "cpu", seed=7)
    qo_indptr = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32)
    lse = torch.empty(q.shape[:2])
    for b in range(len(lengths)):
        kk = k[indices[indptr[b] : indptr[b + 1]].long()].flatten(0, 1)[: lengths[b]]
        rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        logits = torch.einsum("nhd,lhd->nhl", q[rows].double(), kk.double().repeat_interleave(group, 1)) / head_dim**0.5
        n = rows.stop - rows.start
        logits = logits.masked_fill((torch.arange(lengths[b])[None, :] > torch.arange(n)[:, None] + lengths[b] - n)[:, None], float("-inf"))
        lse[rows] = torch.logsumexp(logits, -1).float()
    scores = torch.full((k.shape[0], kv_heads, page_size), float("nan"))
    run_kv_scores(attention_lib, scores, q, lse, k, qo_indptr, indptr, indices, last, scale=0.5)
    expected = torch.full_like(scores, float("nan"), dtype=torch.float64)
    ref.kv_compress.kv_scores(q.double(), lse.double(), k.double(), qo_indptr, indptr, indices, last, expected,
                              head_dim**-0.5, 0.5, True, -1, 0.0, False)
    owned = ~expected.isnan()
    assert torch.equal(scores.isnan(), ~owned)  # every owned slot written, no other
    torch.testing.assert_close(scores[owned].double(), expected[owned], atol=1e-6, rtol=1e-5)
    run_kv_scores(attention_lib, scores, q, lse, k, qo_indptr, indptr, indices, last, scale=0.5, accumulate=True,
                  max_kv_len=1)
    ref.kv_compress.kv_scores(q.double(), lse.double(), k.double(), qo_indptr, indptr, indices, last, expected,
                              head_dim**-0.5, 0.5, True, -1, 0.0, True)
    torch.testing.assert_close(scores[owned].double(), expected[owned], atol=1e-6, rtol=1e-5)


def test_kv_scores_kernel_window_and_soft_cap(attention_lib):
    lengths, kv_heads, group, head_dim = [90, 200], 1, 2, 64
    k, v, indptr, indices, last = kv_case(lengths, kv_heads, head_dim, 16, torch.float16, seed=3)
    q = rand((40, 2, head_dim), torch.float16, "cpu", seed=4)
    qo_indptr = torch.tensor([0, 7, 40], dtype=torch.int32)
    lse = rand((40, 2), torch.float32, "cpu", seed=5).abs() + 3  # any lse: the kernel trusts it
    lse[3] = float("-inf")  # a query that saw no key
    scores = torch.full((k.shape[0], kv_heads, 16), float("nan"))
    run_kv_scores(attention_lib, scores, q, lse, k, qo_indptr, indptr, indices, last, window_left=11, cap=3.0,
                  max_kv_len=70)  # two blocks for 200 keys: tiles the window leaves without a query between others
    expected = torch.full_like(scores, float("nan"), dtype=torch.float64)
    ref.kv_compress.kv_scores(q.double(), lse.double(), k.double(), qo_indptr, indptr, indices, last, expected,
                              head_dim**-0.5, 1.0, True, 11, 3.0, False)
    owned = ~expected.isnan()
    torch.testing.assert_close(scores[owned].double(), expected[owned], atol=1e-6, rtol=1e-5)


def quantized(shape, seed):
    """Multiples of 1/64: exact pooled sums, frequent ties."""
    return torch.randint(-64, 65, shape, generator=torch.Generator().manual_seed(seed)).float() / 64


@pytest.mark.parametrize("pool,window,keep_first", [(1, 0, 0), (5, 8, 2), (7, 40, 0)])
def test_kv_select_kernel(attention_lib, pool, window, keep_first):
    """Exact positions: the radix passes over ties, NaN, +-inf, the forced sinks and window, budgets of 1, of
    all but one key and of more than the keys (every key, then -1), a request without keys."""
    lengths, page_size, kv_heads = [700, 37, 5, 0, 300], 16, 3
    pages = sum(-(-n // page_size) for n in lengths) + 2
    perm = torch.randperm(pages, generator=torch.Generator().manual_seed(2)).tolist()
    indptr, indices, last = [0], [], []
    for n in lengths:
        c = -(-n // page_size)
        indices += [perm.pop() for _ in range(c)]
        indptr.append(len(indices))
        last.append(n - (c - 1) * page_size if c else 0)
    indptr, indices, last = (torch.tensor(x, dtype=torch.int32) for x in (indptr, indices, last))
    scores = quantized((pages, kv_heads, page_size), 3)
    scores[indices[0], 0, :3] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    budgets = [100, 36, 9, 2, 1]
    kept_indptr = torch.tensor([0] + torch.tensor(budgets).cumsum(0).tolist(), dtype=torch.int32)
    kept = torch.full((sum(budgets), kv_heads), -7, dtype=torch.int32)
    ok(attention_lib.emu_kv_select(ptr(kept), ptr(kept_indptr), ptr(scores), ptr(indptr), ptr(indices), ptr(last), len(lengths),
                         kv_heads, page_size, window, keep_first, pool))
    expected = ref.kv_compress.kv_select(scores, indptr, indices, last, kept_indptr, sum(budgets), window, keep_first,
                                         pool)
    assert torch.equal(kept, expected)


@pytest.mark.parametrize("head_dim,page_size", [(64, 1), (128, 16), (256, 3)])
@pytest.mark.parametrize("fresh", [False, True])
def test_kv_compact_kernel(attention_lib, head_dim, page_size, fresh):
    """Bitwise against the reference: in place (sources in the chunk being written) and to fresh pages, with
    scores, several chunks a request (kept 300 > the 32-128 positions of a chunk)."""
    lengths, kv_heads = [400, 50], 2
    k, v, indptr, indices, last = kv_case(lengths, kv_heads, head_dim, page_size, torch.bfloat16, seed=6)
    scores = quantized((k.shape[0], kv_heads, page_size), 4)
    budgets = [300, 50]
    kept_indptr = torch.tensor([0, 300, 350], dtype=torch.int32)
    kept = ref.kv_compress.kv_select(scores, indptr, indices, last, kept_indptr, 350, 4, 1, 1)
    need = [-(-b // page_size) for b in budgets]
    if fresh:
        extra = torch.full((sum(need), page_size, kv_heads, head_dim), float("nan"), dtype=k.dtype)
        cache = torch.cat([torch.stack([k, v], 1), torch.stack([extra, extra], 1)])
        k, v = cache[:, 0], cache[:, 1]
        scores = torch.cat([scores, torch.full((sum(need), kv_heads, page_size), float("nan"))])
        out_indices = torch.arange(k.shape[0] - sum(need), k.shape[0], dtype=torch.int32)
    else:
        out_indices = torch.cat([indices[indptr[b] : indptr[b] + need[b]] for b in range(2)])
    out_indptr = torch.tensor([0, need[0], sum(need)], dtype=torch.int32)
    ek, ev, es = k.clone(), v.clone(), scores.clone()
    ref.kv_compress.kv_compact(ek, ev, es, indptr, indices, kept, kept_indptr, out_indptr, out_indices)
    ok(attention_lib.emu_kv_compact(ptr(k), ptr(v), i64s(*k.stride()[:3]), i64s(*v.stride()[:3]), ptr(scores),
                                    ptr(indptr), ptr(indices), ptr(kept), ptr(kept_indptr), ptr(out_indptr),
                                    ptr(out_indices), 2, kv_heads, head_dim, page_size, DTYPE[k.dtype]))
    assert torch.equal(k.view(torch.int16), ek.view(torch.int16)) and torch.equal(v.view(torch.int16), ev.view(torch.int16))
    assert torch.equal(scores.nan_to_num(-9), es.nan_to_num(-9))


# kv_scores' epilogue: the decode kernel (groups 1-4) and the 16-row tiles (5-16) write the base-2 logit of each
# key a query sees, split requests included; window and soft cap on both kernels
EPILOGUE_CASES = [(g, d, ps, dt, w, cap) for g, d, ps, dt in ATTENTION_CASES if g <= 16
                  for w, cap in ((-1, 0.0), (100, 20.0))]


@pytest.mark.parametrize("group,head_dim,page_size,dtype,window_left,cap", EPILOGUE_CASES)
def test_attention_logits_epilogue(attention_lib, group, head_dim, page_size, dtype, window_left, cap):
    """The logits (NaN before) hold q.k * sm_scale (soft-capped) * log2 e at exactly the keys each query sees;
    kv_scores from them and the lse (nothing else read: NaN elsewhere) equals float64's probabilities."""
    from paged_kv import paged, random_kv, rounded

    import flashkern

    lengths, kv_heads = [1, 37, 0, 300], 2
    kvs = random_kv(lengths, kv_heads, head_dim, seed=60)
    cache, indptr, indices, last = paged(kvs, page_size, "NHD", dtype, seed=60)
    q = rand((len(lengths), kv_heads * group, head_dim), dtype, "cpu", scale=2.0, seed=61)
    wrapper = flashkern.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(16 << 20, dtype=torch.uint8))
    wrapper._core._min_chunk = 64
    wrapper.plan(indptr, indices, last, kv_heads * group, kv_heads, head_dim, page_size, q_data_type=dtype,
                 window_left=window_left, logits_soft_cap=cap or None)
    info = wrapper._core._plan_info
    assert info["grid"][2] == 0 and info["grid"][3] == 1  # no 64-row tiles; request 3 split and merged
    logits = torch.full((len(lengths), q.shape[1], max(lengths)), float("nan"))
    out, lse = run_attention(attention_lib, wrapper, q, cache, logits=logits)
    sm_scale, log2e = head_dim**-0.5, 1 / math.log(2)
    expected = torch.full(logits.shape, float("nan"), dtype=torch.float64)
    probs = torch.zeros(cache.shape[0], kv_heads, page_size, dtype=torch.float64)
    for b, (k, _) in enumerate(rounded(kvs, dtype)):
        n = lengths[b]
        x = torch.einsum("hd,nhd->hn", q[b].double(), k.repeat_interleave(group, 1)) * sm_scale
        x = cap * torch.tanh(x / cap) if cap else x
        seen = torch.arange(n) >= (n - 1 - window_left if window_left >= 0 else 0)
        expected[b, :, :n] = torch.where(seen, x * log2e, float("nan"))
        p = torch.exp(x - lse[b].double()[:, None]) * seen
        j = torch.arange(n)
        pages = indices[indptr[b] : indptr[b + 1]].long()
        probs[pages[j // page_size], :, j % page_size] = p.view(kv_heads, group, n).sum(1).t()
    torch.testing.assert_close(logits.double(), expected, atol=5e-4, rtol=1e-4, equal_nan=True)
    scores = torch.full(probs.shape, float("nan"))
    run_kv_scores(attention_lib, scores, q, lse, cache[:, 0], torch.arange(len(lengths) + 1, dtype=torch.int32),
                  indptr, indices, last, window_left=window_left, cap=cap, logits=logits)
    written = torch.zeros(probs.shape, dtype=torch.bool)
    for b, n in enumerate(lengths):
        j = torch.arange(n)
        written[indices[indptr[b] : indptr[b + 1]].long()[j // page_size], :, j % page_size] = True
    assert scores[~written].isnan().all()  # nothing past the requests' keys
    torch.testing.assert_close(scores[written].double(), probs[written], atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- appending to a paged KV cache

FP8_FORMAT = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1, torch.float8_e4m3fnuz: 2, torch.float8_e5m2fnuz: 3}


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, *FP8_FORMAT])
@pytest.mark.parametrize("layout,page_size,kv_heads,head_dim", [("NHD", 16, 3, 64), ("HND", 1, 1, 8),
                                                                ("HND", 5, 2, 256)])
def test_append_paged_kv_kernel(attention_lib, cache_dtype, layout, page_size, kv_heads, head_dim):
    """Bitwise against the reference over a cache of random bytes (what is not written stays): tokens in any
    order, strided input, per-head K scales and a V scale value; a token past its pages is skipped."""
    g = torch.Generator().manual_seed(1)
    lengths = [37, 1, 20]
    counts = [-(-n // page_size) for n in lengths]
    pages = sum(counts) + 2
    order = torch.randperm(pages, generator=g).int()
    indptr = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    indices = order[: sum(counts)].contiguous()
    b = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n, dtype=torch.int32) for n in lengths])
    perm = torch.randperm(b.shape[0], generator=g)
    b, pos = b[perm].contiguous(), pos[perm].contiguous()
    nnz = b.shape[0]
    dtype = torch.float16 if cache_dtype in FP8_FORMAT else cache_dtype
    kv = (torch.randn(nnz, 2, kv_heads, head_dim, generator=g) * 300).to(dtype)
    kv.view(-1)[:: 7] = float("nan")
    key, value = kv[:, 0], kv[:, 1]
    shape = (pages, 2, page_size, kv_heads, head_dim) if layout == "NHD" else (pages, 2, kv_heads, page_size, head_dim)
    cache = torch.randint(1, 256, (math.prod(shape) * torch.empty(0, dtype=cache_dtype).element_size(),),
                          generator=g, dtype=torch.uint8).view(cache_dtype).reshape(shape)
    k, v = cache[:, 0], cache[:, 1]
    if layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    fp8 = cache_dtype in FP8_FORMAT
    k_scale = torch.linspace(0.3, 3.0, kv_heads) if fp8 else None
    v_value = 0.7 if fp8 else 1.0
    b_run, pos_run = b.clone(), pos.clone()
    b_run[0], pos_run[0] = 0, (counts[0] + 1) * page_size - 1  # past request 0's pages: skipped
    ek, ev = k.clone(), v.clone()
    ref.page.append_paged_kv_cache(key[1:], value[1:], b[1:], pos[1:], ek, ev, indices, indptr, None, k_scale, None,
                                   1.0, v_value)
    ok(attention_lib.emu_append_paged_kv(ptr(k), ptr(v), i64s(*k.stride()[:3]), i64s(*v.stride()[:3]), ptr(key),
                                         ptr(value), i64s(*key.stride()[:2]), i64s(*value.stride()[:2]), ptr(b_run),
                                         ptr(pos_run), ptr(indptr), ptr(indices), ptr(k_scale), None, 1.0, v_value,
                                         pages, indices.shape[0], nnz, len(lengths), kv_heads, head_dim, page_size,
                                         DTYPE[dtype], FP8_FORMAT.get(cache_dtype, -1)))
    unit = torch.uint8 if fp8 else torch.int16
    assert torch.equal(k.view(unit), ek.view(unit)) and torch.equal(v.view(unit), ev.view(unit))


# ---------------------------------------------------------------- every kernel and path, once


@pytest.mark.tsan
def test_every_kernel_and_path(attention_lib):
    """One small case of each kernel and each of its paths, through each launcher build: what
    tests/test_emulator_checks.py runs under ThreadSanitizer (a TSan thread for every GPU thread of
    every block makes the whole module too slow there; ASan runs all of it)."""
    lib = attention_lib
    test_rmsnorm_kernel(lib, 37, 769, torch.bfloat16, weight_fp32=False, residual=True)  # scalar, fused
    test_rmsnorm_kernel(lib, 4, 4096, torch.float16, weight_fp32=True, residual=False)  # 16-byte vectors
    test_rmsnorm_kernel(lib, 2, 40000, torch.float32, weight_fp32=False, residual=False)  # streamed rows
    test_rmsnorm_rows_over_the_grid(lib)  # in registers, 2 and 4 vectors a thread, blocks walking rows
    test_rmsnorm_kernel(lib, 2, 12000, torch.bfloat16, weight_fp32=False, residual=True)  # fused, 4 a thread
    # many rows a block (dw combine); not the streamed backward: its dw reduction is a 1024-thread block
    # per 32 columns, hundreds of thousands of TSan threads
    test_rmsnorm_backward_kernel(lib, 300, 128, torch.bfloat16, 1e-6)
    test_act_mul_kernels(lib, 37, 7, torch.float16, "silu")  # scalar; small, as TSan pays per GPU thread
    test_act_mul_kernels(lib, 5, 4096, torch.bfloat16, "gelu")
    test_rope_kernel(lib, 128, 96, True, torch.bfloat16, "cache")
    test_rope_kernel(lib, 64, 64, False, torch.float32, "inv_freq")
    test_rope_kernel_in_place_on_fused_qkv(lib, False)
    test_merge_states_kernel(lib, 7, 2, 256, torch.float16, True)
    test_merge_states_kernel_in_place_with_mask(lib)
    # decode, 16-row, 64-row tiles, head_dim 512's dimension-split 16-row tile
    for group, head_dim, page_size in ((2, 128, 1), (8, 64, 16), (24, 128, 16), (2, 512, 16)):
        test_batch_attention_kernels(lib, group, head_dim, page_size, torch.bfloat16)
    for group, head_dim, fp8 in ((1, 64, torch.float8_e4m3fn), (8, 64, torch.float8_e5m2), (24, 64, torch.float8_e4m3fn),
                                 (24, 256, torch.float8_e5m2), (2, 512, torch.float8_e4m3fn)):
        # an fp8 cache: each kernel, the 16-token 64-row tile, head_dim 512
        check_fp8_attention(lib, False, group, head_dim, 16, torch.float16, fp8)
    test_batch_attention_kernels_loop_over_items(lib)
    test_batch_attention_kernels_page_outside_the_cache(lib, "minus_one")
    test_batch_attention_kernels_causal_queries(lib, 5, 13)
    test_batch_attention_kernels_sinks_out_dtype_and_scale(lib, 8)
    test_cascade_kernels(lib, 5, 128)
    test_prefill_kernels_masks(lib, 5, 128)
    test_decode_kernel_window_and_soft_cap(lib)
    test_sampling_kernel(lib, "top_k_top_p", 1031, rows=1)  # TSan pays per GPU thread: 1024 a block
    test_renorm_kernel(lib, "top_p_probs", torch.bfloat16, 1024, rows=1)
    test_speculative_kernel(lib, "sample", batch=1, vocab=1024)
    test_softmax_kernel(lib, torch.bfloat16, 4099, 4099, 0)  # two chunks: their pairs merged
    test_softmax_kernel(lib, torch.float32, 1030, 1031, 1)  # one chunk, scalar heads, the scalar write
    test_grad_norm_kernel(lib, 2.0, True)
    test_adamw_kernel(lib, MIXED, True, "global")
    test_kv_scores_kernel(lib, 4, 128, 16, [64, 9, 1], torch.float16)
    test_attention_logits_epilogue(lib, 2, 128, 1, torch.bfloat16, 100, 20.0)  # decode kernel
    test_attention_logits_epilogue(lib, 8, 64, 1, torch.bfloat16, -1, 0.0)  # 16-row tiles
    test_kv_select_kernel(lib, 5, 8, 2)
    test_kv_compact_kernel(lib, 128, 16, False)  # in place
    test_append_paged_kv_kernel(lib, torch.float8_e4m3fn, "NHD", 16, 3, 64)
    test_append_paged_kv_kernel(lib, torch.bfloat16, "HND", 1, 1, 8)


# ---------------------------------------------------------------- tensor-parallel all-reduce (+ add + RMSNorm)
# The ranks of a group run at once, each launch on its own host thread, over workspaces in this
# process standing for the peer-mapped symmetric memory (tests/emu/emu_ops.cpp: emu_allreduce).


def run_allreduce(lib, inputs, rows, two_shot, residuals=None, weight=None, workspaces=None, message_bytes=None,
                  blocks=3, threads=None, in_place=False, delays=None, eps=1e-6, offset=0.0, timeout_ns=0):
    """Every rank's all-reduce of inputs[r] ([sum(rows), cols] each, the calls' rows one after another),
    call c of rows[c] rows, one-shot or two-shot (two_shot[c]). With residuals (one per rank, the same
    values): residual += sum, then the norm. Returns the outputs per rank: [out] or [residual_out, norm_out]."""
    world, cols, dtype = len(inputs), inputs[0].shape[1], inputs[0].dtype
    message_bytes = message_bytes or max(rows) * cols * 2
    workspaces = workspaces or [torch.zeros(lib.emu_comm_workspace_bytes(message_bytes), dtype=torch.uint8)
                                for _ in range(world)]
    threads = threads or max(64, 1 << (cols // 8 // 4 - 1).bit_length())  # 4 vectors a thread at most
    if residuals is None:
        outs, norms = [nan_like(x) for x in inputs], [None] * world
    elif in_place:
        outs, norms = residuals, inputs
    else:
        outs, norms = [nan_like(x) for x in inputs], [nan_like(x) for x in inputs]
    array = lambda ts: (ctypes.c_void_p * world)(*[ptr(t) for t in ts])  # noqa: E731
    ok(lib.emu_allreduce(world, array(workspaces), array(inputs), None if residuals is None else array(residuals),
                         ptr(weight), array(outs), None if residuals is None else array(norms), len(rows), i64s(*rows),
                         (ctypes.c_uint8 * len(rows))(*two_shot), cols, DTYPE[dtype],
                         DTYPE[weight.dtype] if weight is not None else 0, ctypes.c_float(eps), ctypes.c_float(offset),
                         message_bytes, blocks, threads, i64s(*(delays or [0] * world)), timeout_ns))
    return [[o] if n is None else [o, n] for o, n in zip(outs, norms)]


def allreduce_expected(inputs, residual, weight, eps=1e-6):
    """float64: the sum over the ranks in rank order, then (residual) the add and the norm."""
    total = inputs[0].double()
    for x in inputs[1:]:
        total = total + x.double()
    if residual is None:
        return [total]
    s = total + residual.double()
    return [s, ref.rmsnorm(s, weight.double(), eps)]


def check_allreduce(results, expected, dtype):
    for rank in results:  # every rank the same bits
        for got, first in zip(rank, results[0]):
            assert torch.equal(got.view(torch.int16), first.view(torch.int16))
    for got, want in zip(results[0], expected):
        assert_close(got, want, dtype)


@pytest.mark.parametrize("tokens", [1, 7, 128])
@pytest.mark.parametrize("hidden", [1024, 4096, 7168])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("two_shot", [False, True])
def test_allreduce_add_rmsnorm_kernels(emu, tokens, hidden, world, two_shot):
    dtype = torch.bfloat16
    inputs = [rand((tokens, hidden), dtype, "cpu", seed=10 + r) for r in range(world)]
    residual = rand((tokens, hidden), dtype, "cpu", seed=9)
    weight = rand((hidden,), torch.float32, "cpu", seed=8)
    expected = allreduce_expected(inputs, residual, weight)
    results = run_allreduce(emu, inputs, [tokens], [two_shot], [residual.clone() for _ in range(world)], weight)
    check_allreduce(results, expected, dtype)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True])
def test_allreduce_kernels_each_launcher(attention_lib, world, dtype, in_place):
    """Both patterns through each launcher build (warp 32, wave64, wave32), a weight of the input's
    dtype and Gemma's offset, in place (residual_out = residual_in, norm_out = input) and not."""
    lib = attention_lib
    tokens, hidden = 13, 520  # a share that does not divide, a row of 65 vectors
    inputs = [rand((tokens, hidden), dtype, "cpu", seed=20 + r) for r in range(world)]
    expected = allreduce_expected(inputs, None, None)
    for two_shot in (False, True):
        results = run_allreduce(lib, [x.clone() for x in inputs], [tokens], [two_shot], threads=64)
        check_allreduce(results, expected, dtype)
    residual = rand((tokens, hidden), dtype, "cpu", seed=19)
    weight = rand((hidden,), dtype, "cpu", seed=18)
    s = allreduce_expected(inputs, None, None)[0] + residual.double()
    expected = [s, ref.rmsnorm(s, weight.double(), 1e-6, weight_offset=1.0)]
    for two_shot in (False, True):
        results = run_allreduce(lib, [x.clone() for x in inputs], [tokens], [two_shot],
                                [residual.clone() for _ in range(world)], weight, threads=128, in_place=in_place,
                                offset=1.0)
        check_allreduce(results, expected, dtype)


def random_calls(calls, world, cols, dtype, seed, special=False):
    """Per-rank inputs of `calls` calls of 1..9 rows each (one after another), and the calls' rows and
    engines (one-shot, two-shot, at random). special: -0.0 everywhere in one row, NaN in another."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(1, 10, (calls,), generator=g).tolist()
    two_shot = torch.randint(0, 2, (calls,), generator=g).tolist()
    inputs = [rand((sum(rows), cols), dtype, "cpu", seed=seed + 1 + r) for r in range(world)]
    if special:
        for x in inputs:
            x[0] = -0.0
            x[3, 5] = float("nan")
    return inputs, rows, two_shot


def check_calls(results, inputs, residual, weight, rows, dtype):
    at = 0
    for n in rows:  # every call's rows against its own reference
        part = slice(at, at + n)
        expected = allreduce_expected([x[part] for x in inputs], None if residual is None else residual[part], weight)
        for rank in results:
            for got, first in zip(rank, results[0]):
                assert torch.equal(got[part].view(torch.int16), first[part].view(torch.int16))
        for got, want in zip(results[0], expected):
            torch.testing.assert_close(got[part].double(), want, **tolerance(dtype), equal_nan=True)
            zero = want == 0  # -0.0 stays -0.0 (the all-reduce of a row of -0.0)
            assert torch.equal(torch.signbit(got[part][zero]), torch.signbit(want[zero]))
        at += n


def many_calls(lib, calls, world, norm, seed=0, delays=None, blocks=2, threads=64):
    """`calls` all-reduces in a row on the same workspaces, their shapes and engines mixed at random:
    the barrier counts and the alternating regions carried from call to call, as in a replayed graph."""
    dtype, cols = torch.bfloat16, 72
    inputs, rows, two_shot = random_calls(calls, world, cols, dtype, seed, special=True)
    residual = rand((sum(rows), cols), dtype, "cpu", seed=seed + 99) if norm else None
    weight = rand((cols,), torch.float32, "cpu", seed=seed + 98) if norm else None
    results = run_allreduce(lib, inputs, rows, two_shot, None if residual is None else
                            [residual.clone() for _ in range(world)], weight, blocks=blocks, threads=threads, delays=delays,
                            message_bytes=9 * cols * 2)
    check_calls(results, inputs, residual, weight, rows, dtype)


@pytest.mark.parametrize("world,norm", [(2, True), (4, False), (3, True)])
def test_allreduce_kernels_1000_calls(emu, world, norm):
    many_calls(emu, 1000, world, norm, seed=world)


def test_allreduce_kernels_ranks_far_apart(attention_lib):
    """One rank starts 0.3 s after another, one in between: the first ones wait, nothing is read early."""
    many_calls(attention_lib, 20, 3, True, seed=7, delays=[300_000, 0, 100_000])


def test_allreduce_kernels_grid_of_one_block(emu):
    many_calls(emu, 30, 2, True, seed=5, blocks=1)


def test_allreduce_kernels_give_up_on_a_peer_that_never_comes(emu):
    """A peer that does not call within the time limit (0.3 s here, 10 minutes in the op): the waiting rank
    says who waited for whom and traps, instead of spinning forever. In a process of its own (the trap)."""
    import sys

    script = "\n".join([
        "import ctypes, sys, torch",
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})",
        "import test_emulated_kernels as t",
        f"lib = t.declare(ctypes.CDLL({emu._name!r}))",
        "xs = [torch.randn(4, 64).bfloat16() for _ in range(2)]",
        "t.run_allreduce(lib, xs, [4], [0], delays=[0, 30_000_000], timeout_ns=300_000_000)",
    ])
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "FK_EMU_WATCHDOG_SECONDS": "20"})
    assert run.returncode != 0
    assert re.search(r"rank 0 block \d gave up waiting for rank 1 \(barrier 1\)", run.stderr), run.stderr[-2000:]


@pytest.mark.tsan
def test_allreduce_kernels_flag_protocol(emu):
    """What tests/test_emulator_checks.py runs under ThreadSanitizer, where a peer's read of data that no
    release / acquire pair ordered after its write is a race: 1000 calls in a row on two ranks (flag and
    region reuse, the engines and shapes mixed), and ranks starting far apart on each launcher build."""
    many_calls(emu, 1000, 2, True, seed=11, threads=32)  # a warp a block: TSan pays per GPU thread
    many_calls(emu, 40, 4, False, seed=12, delays=[0, 200_000, 0, 50_000])


@pytest.mark.tsan
def test_allreduce_kernels_flag_protocol_hip(emu_wave64, emu_wave32):
    for lib in (emu_wave64, emu_wave32):
        many_calls(lib, 40, 3, True, seed=13, delays=[100_000, 0, 0])


# ---------------------------------------------------------------- batch invariance (flashkern.invariance)
# tests/test_batch_invariance.py's batches run through the kernels, planned by the library's own planner
# (attention_plan.h as built, so that a mutant of it fails here: tests/test_emulator_checks.py).


def emu_planner(lib):
    """_C.plan_attention over the emulated library's planner (tests/emu/emu_ops.cpp: emu_plan_attention)."""

    def plan_attention(levels, batch, page_size, group, kv_heads, head_dim, cta_budget, min_chunk, item_capacity,
                       slot_capacity, names, indexed, out, out_words, invariant):
        flat = (ctypes.c_int64 * (9 * len(levels)))(*[int(x) for level in levels for x in level])
        shape = i64s(batch, page_size, group, kv_heads, head_dim, cta_budget, min_chunk, item_capacity, slot_capacity,
                     int(invariant))
        result = (ctypes.c_int64 * 7)()
        error = lib.emu_plan_attention(flat, len(levels), shape, out or None, out_words, result)
        if error:
            raise ValueError(error.decode())
        return result[0], tuple(result[1:4]), result[4], result[5], bool(result[6])

    return plan_attention


@pytest.fixture
def emu_plans(attention_lib, monkeypatch):
    """attention_lib, the wrappers planning with its planner."""
    monkeypatch.setattr(flashkern_C(), "plan_attention", emu_planner(attention_lib))
    return attention_lib


# decode: the decode kernel and the 16-row tile; prefill: 64-row tiles, mixed, a sliding window; head_dim 512's
# dimension split
@pytest.mark.parametrize("path,group,head_dim,window_left", [("decode", 1, 64, -1), ("decode", 8, 128, -1),
                                                             ("paged", 4, 64, -1), ("ragged", 2, 64, -1),
                                                             ("ragged", 4, 64, 40), ("ragged", 4, 512, -1)])
def test_attention_kernels_are_batch_invariant(emu_plans, path, group, head_dim, window_left):
    from test_batch_invariance import assert_same_bits, attention_batches

    def execute(wrapper, q, kv):
        return run_attention(emu_plans, wrapper, q, kv)

    wide = head_dim > 256  # 16-row tiles at 4x the work of 64-row ones: fewer, shorter requests
    assert_same_bits(attention_batches(path, group, head_dim, execute, others=(1, 6) if wide else (1, 24), seed=group,
                                       max_kv=50 if wide else 100, splits=[dict(), dict(fixed_split_size=4)],
                                       window_left=window_left))


@pytest.mark.parametrize("group", [1, 4])
def test_cascade_kernels_are_batch_invariant(emu_plans, group):
    from test_batch_invariance import test_cascade_is_batch_invariant as check

    check(group, execute=lambda wrapper, q, cache: run_attention(emu_plans, wrapper, q, cache))


@pytest.mark.parametrize("backend", ["emu", "emu_wave64"])  # wave32's row kernels index as CUDA's 32 lanes do
@pytest.mark.parametrize("cols", [7, 8200])  # a partial vector; a row streamed twice
def test_row_kernels_are_batch_invariant(request, backend, cols):
    """RMSNorm (plain and fused), SwiGLU, RoPE and softmax: a row alone and among 1 to 64 others (other grids
    and blocks of rows); sampling with a seed per row."""
    from test_batch_invariance import random_rows, rows_alone_and_in_batches

    lib, dtype, eps, no_offset = request.getfixturevalue(backend), torch.bfloat16, ctypes.c_float(1e-6), ctypes.c_float(0.0)
    w = rand((cols,), dtype, "cpu", seed=3)

    def norms(x, res):
        out, x, res = nan_like(x), x.clone(), res.clone()
        n = x.shape[0]
        ok(lib.emu_rmsnorm(ptr(out), ptr(x), None, ptr(w), n, cols, layout(out), layout(x), layout(x), DTYPE[dtype],
                           DTYPE[dtype], eps, no_offset))
        ok(lib.emu_rmsnorm(ptr(x), ptr(x), ptr(res), ptr(w), n, cols, layout(x), layout(x), layout(res),
                           DTYPE[dtype], DTYPE[dtype], eps, no_offset))
        return out, x, res

    def swiglu(x):
        out = nan_like(x[:, :cols].contiguous())
        ok(lib.emu_act_mul(ptr(out), ptr(x[:, :cols]), ptr(x[:, cols:]), x.shape[0], cols,
                           i64s(cols, 2 * cols, 2 * cols), DTYPE[dtype], ACT["silu"]))
        return out

    rows_alone_and_in_batches(norms, random_rows(cols, dtype, 2))
    rows_alone_and_in_batches(swiglu, random_rows(2 * cols, dtype))
    inv_freq = theta_inv_freq(128, 5e5)
    rows_alone_and_in_batches(
        lambda q, k, pos: rope_call(lib, q, k, pos[:, 0], inv_freq, interleave=cols == 7),
        lambda n, g: (torch.randn(n, 8, 128, generator=g).to(dtype), torch.randn(n, 2, 128, generator=g).to(dtype),
                      torch.randint(0, 1 << 16, (n, 1), generator=g, dtype=torch.int32)))

    def sample(probs, seeds):
        out, valid = torch.full((probs.shape[0],), -7, dtype=torch.int32), torch.zeros(probs.shape[0], dtype=torch.bool)
        ok(lib.emu_sampling(ptr(out), ptr(valid), ptr(probs), probs.shape[0], probs.shape[1], None, probs.shape[0],
                            FILTER["top_k_top_p"], 50, ctypes.c_float(0.9), no_offset, 0, ptr(seeds)))
        return out

    # rows on 16-byte boundaries: the batch-invariant mode asks for them (sampling.py: check_invariant_rows)
    vocab = cols + 1001 if cols % 8 else cols + 1000
    rows_alone_and_in_batches(lambda x: run_softmax(lib, x, t=0.7), random_rows(vocab, dtype))
    rows_alone_and_in_batches(sample, lambda n, g: (torch.softmax(torch.randn(n, vocab, generator=g) * 3, 1),
                                                    torch.randint(0, 1 << 62, (n,), generator=g)))
