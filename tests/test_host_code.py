"""The host-device code of csrc/include/flashkern, compiled for the host and checked on the CPU:
16-bit float conversions (bit-exact against torch), launch planning, row indexing and the
activation math. The same functions run inside the kernels."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import missing_tool

import flashkern.ref.activation as ref_act

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        missing_tool("a host C++ compiler")
    so = tmp_path_factory.mktemp("host") / "libfkhost.so"
    subprocess.run(
        [cxx, "-std=c++17", "-O2", "-shared", "-fPIC", "-Wall", "-Werror", f"-I{ROOT / 'csrc' / 'include'}",
         str(ROOT / "tests" / "host" / "host_code.cpp"), "-o", str(so)],
        check=True,
    )
    return ctypes.CDLL(str(so))


def ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def call_convert(lib, name, values, out_dtype):
    values = np.ascontiguousarray(values)
    out = np.empty(values.shape, dtype=out_dtype)
    getattr(lib, name)(ptr(values), ptr(out), ctypes.c_int64(values.size))
    return out


def all_16bit_patterns():
    return np.arange(65536, dtype=np.uint32).astype(np.uint16)


@pytest.mark.parametrize("fmt,torch_dtype", [("half", torch.float16), ("bf16", torch.bfloat16)])
def test_16bit_to_float_exhaustive(lib, fmt, torch_dtype):
    bits = all_16bit_patterns()
    ours = call_convert(lib, f"fk_{fmt}_to_float", bits, np.float32)
    theirs = torch.from_numpy(bits.view(np.int16)).view(torch_dtype).float().numpy()
    nan = np.isnan(theirs)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(ours[~nan].view(np.uint32), theirs[~nan].view(np.uint32))  # bit-exact, signed zeros too


def float_probes():
    """Every 16-bit value, the midpoints between neighbours (ties), their neighbours, edges and random bits."""
    rng = np.random.default_rng(0)
    random_bits = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65519.99, 65520.0, 65536.0, 2.0**-24, 2.0**-25, 2.0**-26,
         3 * 2.0**-26, 2.0**-14, 1e-40, -1e-40, 3.4e38, -3.4e38, 1.0 + 2.0**-11, 1.0 + 2.0**-8],
        dtype=np.float32,
    )
    half_values = torch.from_numpy(all_16bit_patterns().view(np.int16)).view(torch.float16).float().numpy()
    bf16_values = torch.from_numpy(all_16bit_patterns().view(np.int16)).view(torch.bfloat16).float().numpy()
    pts = []
    for v in (half_values, bf16_values):
        v = np.sort(v[np.isfinite(v)])
        mid = (v[:-1].astype(np.float64) + v[1:].astype(np.float64)) / 2
        mid32 = mid.astype(np.float32)
        pts += [v, mid32, np.nextafter(mid32, np.float32(np.inf)), np.nextafter(mid32, np.float32(-np.inf))]
    return np.concatenate([edges, random_bits] + pts).astype(np.float32)


@pytest.mark.parametrize("fmt,torch_dtype", [("half", torch.float16), ("bf16", torch.bfloat16)])
def test_float_to_16bit_round_to_nearest_even(lib, fmt, torch_dtype):
    x = float_probes()
    ours = call_convert(lib, f"fk_float_to_{fmt}", x, np.uint16)
    theirs = torch.from_numpy(x).to(torch_dtype).view(torch.int16).numpy().view(np.uint16)
    ours_f = torch.from_numpy(ours.view(np.int16)).view(torch_dtype).float().numpy()
    nan = np.isnan(x)
    assert np.isnan(ours_f[nan]).all(), "NaN must stay NaN"
    mismatch = np.flatnonzero(ours[~nan] != theirs[~nan])
    assert mismatch.size == 0, f"{mismatch.size} values differ, e.g. {x[~nan][mismatch[:5]]}"


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]  # numeric.h's Fp8


@pytest.mark.parametrize("fmt", range(4), ids=[str(d).split(".")[1] for d in FP8])
def test_fp8_to_float_exhaustive(lib, fmt):
    bits = np.arange(256, dtype=np.uint8)
    ours = np.empty(256, dtype=np.float32)
    lib.fk_fp8_to_float(ptr(bits), ptr(ours), ctypes.c_int64(256), ctypes.c_int(fmt))
    theirs = torch.from_numpy(bits).view(FP8[fmt]).float().numpy()
    nan = np.isnan(theirs)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(ours[~nan].view(np.uint32), theirs[~nan].view(np.uint32))  # bit-exact, signed zeros too


@pytest.mark.parametrize("fmt", range(4), ids=[str(d).split(".")[1] for d in FP8])
def test_float_to_fp8_saturates_and_rounds_to_nearest_even(lib, fmt):
    """Bit for bit torch's x.clamp(-max, max).to(fp8): every fp8 value, the midpoints between neighbours (ties)
    and their neighbours, values past the range, inf, subnormals, NaN and random fp32 bits."""
    dtype = FP8[fmt]
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float().numpy()
    v = np.unique(values[np.isfinite(values)])
    mid = ((v[:-1].astype(np.float64) + v[1:]) / 2).astype(np.float32)
    top = float(torch.finfo(dtype).max)
    rng = np.random.default_rng(fmt)
    x = np.concatenate([v, mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf)),
                        np.array([top * 1.01, -top * 1.5, 1e30, np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, 1e-30,
                                  -1e-45, float(torch.finfo(dtype).tiny) / 3], dtype=np.float32),
                        rng.integers(0, 2**32, size=1 << 18, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        rng.standard_normal(1 << 16).astype(np.float32) * top / 4]).astype(np.float32)
    ours = np.empty(x.shape, dtype=np.uint8)
    lib.fk_float_to_fp8(ptr(x), ptr(ours), ctypes.c_int64(x.size), ctypes.c_int(fmt))
    theirs = torch.from_numpy(x).clamp(-top, top).to(dtype).view(torch.uint8).numpy()
    nan = np.isnan(x)
    assert np.isnan(torch.from_numpy(ours[nan]).view(dtype).float().numpy()).all(), "NaN must stay NaN"
    mismatch = np.flatnonzero(ours[~nan] != theirs[~nan])
    assert mismatch.size == 0, f"{mismatch.size} values differ, e.g. {x[~nan][mismatch[:5]]} -> " \
                               f"{ours[~nan][mismatch[:5]]}, torch {theirs[~nan][mismatch[:5]]}"


LIMITS = {0: "rmsnorm", 1: "rmsnorm_backward"}


@pytest.mark.parametrize("limits", LIMITS)
def test_plan_rows_invariants(lib, limits):
    lim = np.empty(5, dtype=np.int64)
    lib.fk_plan_limits(ctypes.c_int(limits), ptr(lim))
    max_threads, max_vecs, target_block, min_block, max_blocks = (int(v) for v in lim)
    out = np.empty(6, dtype=np.int64)
    cols_list = [1, 2, 7, 8, 64, 111, 128, 769, 4096, 5125, 8192, 16384, 32768, 65536, 1 << 20]
    for rows in [1, 2, 3, 37, 989, 100000, 2**30 + 1, 2**40]:
        for cols in cols_list:
            for vec in (1, 4, 8):
                lib.fk_plan_rows(ctypes.c_int64(rows), ctypes.c_int64(cols), ctypes.c_int(vec), ctypes.c_int(limits), ptr(out))
                tpr, rpb, vpt, in_regs, block, blocks = (int(v) for v in out)
                row_vecs = -(-cols // vec)
                ctx = f"rows={rows} cols={cols} vec={vec}: {out.tolist()}"
                assert tpr & (tpr - 1) == 0 and 1 <= tpr <= max_threads, ctx
                assert block == tpr * rpb and min_block <= block <= max(max_threads, min_block), ctx
                assert rpb == 1 or block <= max(target_block, min_block), ctx
                assert vpt * tpr >= row_vecs and (vpt - 1) * tpr < row_vecs, ctx  # covers the row, no empty vector slot
                assert bool(in_regs) == (vpt <= max_vecs), ctx
                assert (blocks - 1) * rpb < rows, ctx  # no empty block
                assert blocks * rpb >= rows or blocks == max_blocks, ctx  # every row, or capped grid that loops
                if row_vecs <= max_threads * max_vecs:
                    assert in_regs, f"a row that fits in registers must be kept there: {ctx}"


def test_plan_rows_examples(lib):
    out = np.empty(6, dtype=np.int64)

    def plan(rows, cols, vec, limits=0):
        lib.fk_plan_rows(ctypes.c_int64(rows), ctypes.c_int64(cols), ctypes.c_int(vec), ctypes.c_int(limits), ptr(out))
        return out.tolist()

    assert plan(1, 4096, 8) == [128, 1, 4, 1, 128, 1]  # one decode row of Llama-8B: 128 threads, 4 vectors each
    assert plan(1000, 128, 8) == [4, 64, 4, 1, 256, 16]  # per-head q/k norm: 64 rows per 256-thread block
    assert plan(1, 64, 8) == [2, 32, 4, 1, 64, 1]  # one short row: still a whole wavefront per block
    assert plan(3, 32768, 8) == [512, 1, 8, 1, 512, 3]  # 32K bf16 still fits in registers
    assert plan(3, 65536, 8)[3] == 0  # 64K does not: streamed twice
    assert plan(2**40, 8, 8)[5] == 2**20  # the grid stops at kMaxBlocks; blocks loop over the rest


def layouts():
    """(tensor, collapses to two levels?): views of an arange, so an element's value is its storage index."""
    base = torch.arange(4 * 5 * 6 * 8).reshape(4, 5, 6, 8)
    return [
        (base.reshape(120, 8), True),
        (base.reshape(120, 8)[:, :3], True),
        (base[:, 1:4], True),  # dims 1 and 2 merge: two levels
        (base[1:2, :, 2:3], True),  # size-1 dimensions drop out
        (base.reshape(4, 30, 8).transpose(0, 1), True),
        (base.reshape(20, 6, 8)[:, 1:5], True),  # [tokens, heads, head_dim] in a fused qkv buffer
        (base.transpose(0, 1), False),  # three levels: the glue makes a contiguous copy
        (base.permute(2, 0, 1, 3), True),  # [6, 4, 5]: 4 and 5 merge
        (base.permute(0, 2, 1, 3), False),
    ]


@pytest.mark.parametrize("index", range(9))
def test_row_offsets_match_torch_strides(lib, index):
    t, collapses = layouts()[index]
    lead = t.shape[:-1]
    rows = int(np.prod(lead))
    sizes = np.array(lead, dtype=np.int64)
    strides = np.array(t.stride()[:-1], dtype=np.int64)
    out = np.empty(rows, dtype=np.int64)
    ok = lib.fk_row_offsets(ptr(sizes), ptr(strides), ctypes.c_int(len(lead)), ctypes.c_int64(rows), ptr(out))
    assert bool(ok) == collapses
    if collapses:
        expected = (t[..., 0].flatten() - t.storage_offset()).numpy()
        assert np.array_equal(out, expected)


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_activation_math(lib, act):
    x = np.concatenate([np.linspace(-30, 30, 20001), [-1e4, -100, -88.8, 88.8, 100, 1e4, 0.0]]).astype(np.float32)
    f, df = np.empty_like(x), np.empty_like(x)
    lib.fk_activation(ctypes.c_int(["silu", "gelu", "gelu_tanh"].index(act)), ptr(x), ptr(f), ptr(df), ctypes.c_int64(x.size))
    xt = torch.from_numpy(x).double()
    torch.testing.assert_close(torch.from_numpy(f).double(), ref_act.activation(act, xt), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.from_numpy(df).double(), ref_act.activation_derivative(act, xt), atol=1e-5, rtol=1e-5)


def test_merge_weights(lib):
    """The two-state merge the kernels use, against float64 logaddexp; -inf (empty) and NaN exactly."""
    rng = np.random.default_rng(1)
    s_a = np.concatenate([rng.normal(0, 30, 10000), [-np.inf, -np.inf, 5.0, np.nan, 1e30, -80.0]]).astype(np.float32)
    s_b = np.concatenate([rng.normal(0, 30, 10000), [-np.inf, 3.0, -np.inf, 1.0, 1e30, 80.0]]).astype(np.float32)
    out = np.empty((s_a.size, 3), dtype=np.float32)
    lib.fk_merge_weights(ptr(s_a), ptr(s_b), ptr(out), ctypes.c_int64(s_a.size))
    a, b, s = out[:, 0].astype(np.float64), out[:, 1].astype(np.float64), out[:, 2].astype(np.float64)
    with np.errstate(invalid="ignore"):
        exact = np.logaddexp(s_a.astype(np.float64), s_b.astype(np.float64))
    finite = np.isfinite(exact)
    np.testing.assert_allclose(s[finite], exact[finite], rtol=1e-6, atol=1e-5)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, NaN rows: not compared
        weight_a = 1.0 / (1.0 + np.exp(s_b.astype(np.float64) - s_a.astype(np.float64)))  # no cancellation at 1e30
    np.testing.assert_allclose(a[finite], weight_a[finite], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose((a + b)[finite], 1.0, rtol=1e-6)
    n = s_a.size - 6
    assert list(out[n]) == [0.0, 0.0, -np.inf]  # both empty: zero weights, still empty
    assert list(out[n + 1]) == [0.0, 1.0, 3.0] and list(out[n + 2]) == [1.0, 0.0, 5.0]  # one empty: exact
    assert np.isnan(out[n + 3]).all()  # NaN stays NaN


def test_final_state(lib):
    """A query's state finished with its head's sink (a key of value zero): the output factor
    exp(s - lse) * out_scale and lse = logaddexp(s, sink); no sink (-inf) leaves the state alone;
    an empty state takes the sink's lse and a zero output; NaN stays NaN; a +inf sink gives 0 and +inf."""
    rng = np.random.default_rng(3)
    s = np.concatenate([rng.normal(0, 20, 5000), [-np.inf, -np.inf, 2.0, np.nan, 1.0, 3.0]]).astype(np.float32)
    sink = np.concatenate([rng.normal(0, 20, 5000), [1.5, -np.inf, -np.inf, 0.0, np.nan, np.inf]]).astype(np.float32)
    out = np.empty((s.size, 2), dtype=np.float32)
    lib.fk_final_state(ptr(s), ptr(sink), ctypes.c_float(0.5), ptr(out), ctypes.c_int64(s.size))
    s64, sink64 = s[:5000].astype(np.float64), sink[:5000].astype(np.float64)
    np.testing.assert_allclose(out[:5000, 1], np.logaddexp(s64, sink64), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(out[:5000, 0], 0.5 / (1.0 + np.exp(sink64 - s64)), rtol=1e-5, atol=1e-7)
    n = 5000
    assert list(out[n]) == [0.0, 1.5] and list(out[n + 1]) == [0.5, -np.inf] and list(out[n + 2]) == [0.5, 2.0]
    assert np.isnan(out[n + 3]).all() and np.isnan(out[n + 4]).all()
    assert list(out[n + 5]) == [0.0, np.inf]  # an infinite sink takes all the weight


def test_visible(lib):
    """Query i of an item sees the tokens i + first <= j <= i + last within the chunk (causal: last is
    the diagonal; a window: first); kNoDiagonal (2^30) and -kNoDiagonal leave the chunk whole,
    without overflow, for every query index the planner allows (< 2^30); sees_chunk: the range is
    not empty."""
    i = np.array([0, 1, 5, 2**30 - 1], dtype=np.int32)
    out = np.empty((i.size, 3), dtype=np.int32)

    def visible(kv_begin, kv_end, first, last):
        lib.fk_visible(kv_begin, kv_end, first, last, ptr(i), ptr(out), ctypes.c_int64(i.size))
        return out.tolist()

    no = 2**30
    assert visible(64, 128, -no, 100) == [[64, 101, 1], [64, 102, 1], [64, 106, 1], [64, 128, 1]]
    assert visible(64, 128, -no, -3) == [[64, -2, 0], [64, -1, 0], [64, 3, 0], [64, 128, 1]]  # before the chunk
    assert visible(0, 2**30 - 1, -no, no) == [[0, 2**30 - 1, 1]] * 4
    # a window of 10 behind a diagonal of 60: query i sees [i + 50, i + 60]
    assert visible(64, 128, 50, 60) == [[64, 61, 0], [64, 62, 0], [64, 66, 1], [128, 128, 0]]
    assert visible(0, 64, 50, no)[:3] == [[50, 64, 1], [51, 64, 1], [55, 64, 1]]  # a window without causality


def test_divmod(lib):
    """The page/slot split of every token position: n / d and n % d by multiply-high, for n < 2^31."""
    rng = np.random.default_rng(2)
    n = np.concatenate([np.arange(5000), 2**31 - 1 - np.arange(5000), rng.integers(0, 2**31, 200000)]).astype(np.uint32)
    q, r = np.empty_like(n), np.empty_like(n)
    for d in [1, 2, 3, 7, 15, 16, 17, 100, 127, 128, 129, 1000, 4096, 65535, 131072, 1000003, 2**30 - 1, 2**31 - 1]:
        lib.fk_divmod(ctypes.c_uint32(d), ptr(n), ptr(q), ptr(r), ctypes.c_int64(n.size))
        assert np.array_equal(q, n // d) and np.array_equal(r, n % d), d


@pytest.mark.parametrize("tile", [1, 4, 16, 64])
def test_online_softmax(lib, tile):
    """Tile-by-tile base-2 online softmax against float64 logsumexp and softmax: masked (-inf) logits,
    a fully masked tile first, large magnitudes, all masked, NaN."""
    rng = np.random.default_rng(3)
    cases = [
        rng.normal(0, 3, 1000),
        np.concatenate([np.full(70, -np.inf), rng.normal(0, 1, 50), [-np.inf] * 3]),  # masked first tiles
        rng.normal(0, 1, 257) * 80,  # logits far apart
        np.full(10, -np.inf),  # an empty state
    ]
    out = np.empty(3, dtype=np.float32)
    for x in cases:
        x = x.astype(np.float32)
        w = np.empty_like(x)
        lib.fk_online_softmax(ptr(x), ctypes.c_int64(x.size), ctypes.c_int64(tile), ptr(out), ptr(w))
        x64 = x.astype(np.float64)
        if np.isneginf(x64).all():
            assert out[1] == 0 and out[2] == -np.inf and (w == 0).all()
            continue
        lse = np.logaddexp.reduce(x64)
        np.testing.assert_allclose(out[2], lse, rtol=1e-6, atol=1e-5)
        np.testing.assert_allclose(w, np.exp(x64 - lse), rtol=1e-5, atol=1e-7)
    for x in ([0.5, np.nan, 1.0], [np.nan, np.nan], [-np.inf, np.nan, -np.inf]):  # also where every max skips it
        x = np.array(x, dtype=np.float32)
        lib.fk_online_softmax(ptr(x), ctypes.c_int64(x.size), ctypes.c_int64(tile), ptr(out),
                              ptr(np.empty(x.size, np.float32)))
        assert np.isnan(out[2]), f"a NaN logit makes the state NaN: {x} -> {out}"


# Random123's known-answer vectors for Philox4x32-10 (its tests/kat_vectors): counter, key, result.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", PHILOX_KAT)
def test_philox_known_answers(lib, counter, key, expected):
    out = np.zeros(4, dtype=np.uint32)
    lib.fk_philox(ptr(np.array(counter, dtype=np.uint32)), ctypes.c_uint32(key[0]), ctypes.c_uint32(key[1]), ptr(out))
    assert tuple(int(x) for x in out) == expected


def test_sampling_uniforms(lib):
    """The kernels' uniforms: in [0, 1), multiples of 2^-24, uniform (mean and a 16-bin histogram),
    other rows and offsets give other streams."""
    n = 1 << 16
    out = np.zeros(n, dtype=np.float32)
    lib.fk_uniforms(ctypes.c_uint64(12345), ctypes.c_uint64(0), ctypes.c_uint32(3), ptr(out), ctypes.c_int64(n))
    assert out.min() >= 0 and out.max() < 1
    assert np.all(out * 2**24 == np.floor(out * 2**24))
    assert abs(out.mean() - 0.5) < 5 * (1 / 12 / n) ** 0.5
    counts = np.histogram(out, bins=16, range=(0, 1))[0]
    assert ((counts - n / 16) ** 2 / (n / 16)).sum() < 50  # chi-square, 15 dof: p < 1e-4 above 44
    other = np.zeros(n, dtype=np.float32)
    for seed, offset, row in ((12345, 0, 4), (12345, 1, 3), (12346, 0, 3)):
        lib.fk_uniforms(ctypes.c_uint64(seed), ctypes.c_uint64(offset), ctypes.c_uint32(row), ptr(other),
                        ctypes.c_int64(n))
        assert (other != out).mean() > 0.99
