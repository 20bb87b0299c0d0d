"""Prefill and append attention: the ragged and paged prefill wrappers and single_prefill_with_kv_cache
against attention written here from scratch in float64 with explicit per-query key sets (causal,
sliding windows, soft-capping, custom and packed masks, sinks), on every device (the CPU runs the
plan through the reference, the emulate backends through the kernels' own code, a GPU through the
kernels). Decode and the cascade with window_left / logits_soft_cap; bad input raising in plan()."""

import numpy as np
import pytest
import torch
from conftest import assert_close, emulated, poisoned, rand, requires_gpu
from paged_kv import i32, paged, random_kv, rounded

import flashkern
from flashkern import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
    single_decode_with_kv_cache,
    single_prefill_with_kv_cache,
)
from flashkern.tolerances import tolerance


def workspace(device, mib=32):
    return torch.empty(mib << 20, dtype=torch.uint8, device=device)


def visible_keys(qo_len, kv_len, causal=False, window_left=-1, mask=None):
    """Per query i (token i + kv_len - qo_len), the keys it may see, as indices."""
    position = torch.arange(qo_len)[:, None] + (kv_len - qo_len)
    j = torch.arange(kv_len)[None, :]
    if mask is not None:
        seen = torch.as_tensor(mask, dtype=torch.bool).reshape(qo_len, kv_len).clone()
    else:
        seen = j <= position if causal else torch.ones(qo_len, kv_len, dtype=torch.bool)
    if window_left >= 0:
        seen &= j >= position - window_left
    return [torch.nonzero(row).flatten() for row in seen]


def attend(q, k, v, keys, sm_scale, cap=None, sinks=None):
    """float64 attention of one query q [qo_heads, D] over the keys `keys` of k, v [n, kv_heads, D]."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    group = q.shape[0] // k.shape[1]
    k, v = k[keys].repeat_interleave(group, 1), v[keys].repeat_interleave(group, 1)
    logits = torch.einsum("hd,lhd->hl", q, k) * sm_scale
    if cap:
        logits = cap * torch.tanh(logits / cap)
    if sinks is not None:
        logits = torch.cat([logits, sinks.double().cpu()[:, None]], 1)
        v = torch.cat([v, torch.zeros_like(v[:1])])
    if logits.shape[1] == 0:
        return torch.zeros_like(q), torch.full(q.shape[:1], float("-inf"), dtype=torch.float64)
    return torch.einsum("hl,lhd->hd", torch.softmax(logits, -1), v), torch.logsumexp(logits, -1)


def expected_batch(q, kvs, qo_lens, causal=False, window_left=-1, masks=None, cap=None, sinks=None, sm_scale=None):
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    outs, lses, row = [], [], 0
    for b, ((k, v), n) in enumerate(zip(kvs, qo_lens)):
        for i, keys in enumerate(visible_keys(n, k.shape[0], causal, window_left, None if masks is None else masks[b])):
            o, s = attend(q[row + i], k, v, keys, sm_scale, cap, sinks)
            outs.append(o)
            lses.append(s)
        row += n
    return torch.stack(outs), torch.stack(lses)


def check(out, lse, expected, dtype):
    assert_close(out, expected[0], dtype)
    torch.testing.assert_close(lse.double().cpu(), expected[1], **tolerance(torch.float32))


def ragged(kvs, dtype, device, kv_layout="NHD"):
    k = torch.cat([k for k, _ in kvs]).to(device=device, dtype=dtype)
    v = torch.cat([v for _, v in kvs]).to(device=device, dtype=dtype)
    if kv_layout == "HND":
        k, v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    return k, v


def indptr(lengths):
    return i32([0] + np.cumsum(lengths).tolist())


def run_ragged(device, qo_lens, kv_lens, kv_heads, group, head_dim, dtype, seed=0, kv_layout="NHD", masks=None,
               packed=False, **options):
    kvs = random_kv(kv_lens, kv_heads, head_dim, seed)
    q = rand((sum(qo_lens), kv_heads * group, head_dim), dtype, device, seed=seed + 100)
    k, v = ragged(kvs, dtype, device, kv_layout)
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(workspace(device), kv_layout)
    mask_args = {}
    if masks is not None:
        flat = torch.cat([torch.as_tensor(m, dtype=torch.bool).reshape(-1) for m in masks])
        mask_args = {"packed_custom_mask": packed_bits(masks)} if packed else {"custom_mask": flat}
    wrapper.plan(indptr(qo_lens), indptr(kv_lens), kv_heads * group, kv_heads, head_dim, q_data_type=dtype,
                 **mask_args, **options)
    out, lse = poisoned(q.shape, dtype, device), poisoned(q.shape[:2], torch.float32, device)
    wrapper.run(q, k, v, out=out, lse=lse)
    check(out, lse, expected_batch(q, rounded(kvs, dtype), qo_lens, options.get("causal", False),
                                   options.get("window_left", -1), masks, options.get("logits_soft_cap")), dtype)
    return wrapper


def packed_bits(masks):
    """FlashInfer's packed form, built with numpy: each request's bits, little-endian, from its own byte."""
    return torch.from_numpy(np.concatenate([np.packbits(np.asarray(m, dtype=bool).reshape(-1), bitorder="little")
                                            for m in masks]))


# ragged, an empty request of each kind, more queries than keys (causal: its first 61 see nothing, as FlashInfer)
QO_KV = [(7, 7), (129, 300), (1, 17), (0, 5), (64, 64), (3, 0), (70, 9)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ragged_prefill(device, causal, group, dtype):
    run_ragged(device, [n for n, _ in QO_KV], [m for _, m in QO_KV], 2, group, 128, dtype, causal=causal)


@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_head_dims_and_layouts(device, head_dim, kv_layout):
    run_ragged(device, [70, 1], [99, 40], 1, 8, head_dim, torch.bfloat16, seed=1, kv_layout=kv_layout, causal=True)


@pytest.mark.parametrize("qo_len", [1, 7, 64, 129, 1000])
def test_lengths(device, qo_len):
    """qo_len against kv_len from qo_len to 4099, causal (the long ones split over the device). The
    emulated kernels take the 1000-query case at kv_len 1000 only (27 s a backend otherwise)."""
    lengths = {qo_len} if qo_len == 1000 and emulated(device) else {qo_len, qo_len + 13, 4099}
    for kv_len in sorted(lengths):
        run_ragged(device, [qo_len], [kv_len], 1, 2, 64, torch.float16, seed=qo_len, causal=True)


@pytest.mark.parametrize("window_left", [0, 17, 1024])
@pytest.mark.parametrize("causal", [False, True])
def test_sliding_window(device, window_left, causal):
    run_ragged(device, [40, 100, 1], [40, 1500, 300], 2, 3, 64, torch.bfloat16, seed=2, causal=causal,
               window_left=window_left)


@pytest.mark.parametrize("cap", [30.0, 50.0])
def test_soft_cap(device, cap):
    """Large logits (q scaled up) so that the cap matters."""
    kvs = random_kv([90, 33], 2, 128, 3)
    q = rand((50, 4, 128), torch.float16, device, scale=8.0, seed=9)
    k, v = ragged(kvs, torch.float16, device)
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(workspace(device))
    wrapper.plan(i32([0, 40, 50]), i32([0, 90, 123]), 4, 2, 128, causal=True, logits_soft_cap=cap)
    out, lse = wrapper.run(q, k, v, return_lse=True)
    check(out, lse, expected_batch(q, rounded(kvs, torch.float16), [40, 10], True, cap=cap), torch.float16)
    plain = expected_batch(q, rounded(kvs, torch.float16), [40, 10], True)
    assert not torch.allclose(lse.double().cpu(), plain[1], atol=1e-2)  # the cap changed the result


def random_masks(qo_lens, kv_lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(n, m, generator=g) < 0.6 for n, m in zip(qo_lens, kv_lens)]


def tree_mask(parents, prefix):
    """A speculative-decoding tree after a prefix of `prefix` tokens: node i sees the prefix, itself
    and its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, prefix + n, dtype=torch.bool)
    mask[:, :prefix] = True
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, prefix + j] = True
            j = parents[j]
    return mask


@pytest.mark.parametrize("packed", [False, True])
def test_custom_masks(device, packed):
    qo_lens, kv_lens = [5, 33, 1, 70], [9, 33, 20, 130]
    masks = random_masks(qo_lens, kv_lens, 4)
    masks[1][3] = False  # a query that sees nothing: 0 and LSE -inf
    run_ragged(device, qo_lens, kv_lens, 2, 4, 64, torch.float16, seed=5, masks=masks, packed=packed, causal=True)


def test_tree_mask_paged(device):
    """Tree attention for speculative verification over a paged cache (page size 16)."""
    parents = [-1, 0, 0, 1, 1, 2, 5]
    prefix = [23, 40]
    masks = [tree_mask(parents, p) for p in prefix]
    kvs = random_kv([p + len(parents) for p in prefix], 2, 128, 6)
    cache, kv_indptr, kv_indices, last = paged(kvs, 16, "NHD", torch.bfloat16, device, seed=6)
    q = rand((2 * len(parents), 8, 128), torch.bfloat16, device, seed=7)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace(device))
    wrapper.plan(i32([0, 7, 14]), kv_indptr, kv_indices, last, 8, 2, 128, 16, packed_custom_mask=packed_bits(masks),
                 q_data_type=torch.bfloat16)
    out, lse = wrapper.run(q, cache, return_lse=True)
    check(out, lse, expected_batch(q, rounded(kvs, torch.bfloat16), [7, 7], masks=masks), torch.bfloat16)


def test_flashinfer_run_keywords_of_its_trtllm_kernels(device):
    """FlashInfer's paged prefill run() has use_fp16_softmax and uses_spcompress: taken as None or False (they
    were refused even as None); a value flashkern cannot honour is a ValueError, out untouched."""
    kvs = random_kv([30, 9], 2, 64, 8)
    cache, kv_indptr, kv_indices, last = paged(kvs, 16, "NHD", torch.float16, device, seed=8)
    q = rand((6, 4, 64), torch.float16, device, seed=9)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace(device))
    wrapper.plan(i32([0, 4, 6]), kv_indptr, kv_indices, last, 4, 2, 64, 16, causal=True, q_data_type=torch.float16)
    want = wrapper.run(q, cache)
    for value in (None, False):
        got = wrapper.run(q, cache, use_fp16_softmax=value, uses_spcompress=value)
        assert torch.equal(got, want)
    out = torch.zeros_like(want)
    for name in ("use_fp16_softmax", "uses_spcompress"):
        with pytest.raises(ValueError, match=f"{name}=True is not supported by flashkern"):
            wrapper.run(q, cache, out=out, **{name: True})
        assert not out.any()


def test_packing_matches_numpy():
    masks = random_masks([3, 5, 1], [7, 2, 9], 8)
    flat = torch.cat([m.reshape(-1) for m in masks])
    ours = flashkern.prefill.pack_mask_segments("test", flat, torch.tensor([21, 10, 9]))
    assert torch.equal(ours, packed_bits(masks))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_prefill(device, page_size, kv_layout, causal):
    qo_lens, kv_lens = [17, 1, 64, 0, 30], [40, 1, 200, 9, 7]  # 30 queries over 7 keys: causal, 23 see none
    kvs = random_kv(kv_lens, 2, 64, 8)
    cache, kv_indptr, kv_indices, last = paged(kvs, page_size, kv_layout, torch.float16, device, seed=8)
    q = rand((sum(qo_lens), 6, 64), torch.float16, device, seed=9)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace(device), kv_layout)
    wrapper.plan(indptr(qo_lens), kv_indptr, kv_indices, last, 6, 2, 64, page_size, causal=causal)
    out, lse = poisoned(q.shape, torch.float16, device), poisoned(q.shape[:2], torch.float32, device)
    wrapper.run(q, cache, out=out, lse=lse)
    check(out, lse, expected_batch(q, rounded(kvs, torch.float16), qo_lens, causal), torch.float16)


def test_sinks_and_output_dtype(device):
    kvs = random_kv([50, 20], 1, 64, 10)
    q = rand((30, 4, 64), torch.float16, device, seed=11)
    k, v = ragged(kvs, torch.float16, device)
    sinks = torch.tensor([0.5, -1.0, 3.0, float("-inf")], device=device)
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(workspace(device))
    wrapper.plan(i32([0, 20, 30]), i32([0, 50, 70]), 4, 1, 64, causal=True, o_data_type=torch.bfloat16)
    out, lse = wrapper.run(q, k, v, return_lse=True, sinks=sinks)
    assert out.dtype == torch.bfloat16
    check(out, lse, expected_batch(q, rounded(kvs, torch.float16), [20, 10], True, sinks=sinks), torch.bfloat16)


def test_long_prefill_needs_no_slots(device):
    """An unsplit prefill writes every query directly: no partial states, no merge."""
    wrapper = run_ragged(device, [300], [300], 1, 4, 64, torch.float16, seed=12, causal=True, disable_split_kv=True)
    info = wrapper._core._plan_info
    assert info["slots"] == 0 and info["grid"][3] == 0
    tiles = -(-300 * 4 // 64)
    assert sum(info["counts"]) == tiles  # one item per row tile: nothing past the diagonal


def test_causal_skips_tiles_past_the_diagonal(device):
    """Split causally, the first row tile's items stop at its own diagonal."""
    wrapper = run_ragged(device, [1000], [1000], 1, 1, 64, torch.float16, seed=13, causal=True, fixed_split_size=64)
    info = wrapper._core._plan_info
    tiles = -(-1000 // 64)
    assert sum(info["counts"]) == sum(min(t + 1, -(-1000 // 64)) for t in range(tiles))  # a triangle, not a square


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_single_prefill(device, dtype, kv_layout):
    if dtype in (torch.float32, torch.float64) and str(device) != "cpu":
        pytest.skip("float32/float64 run the same reference on every device")
    kvs = random_kv([77], 2, 64, 14)
    q = rand((30, 4, 64), dtype, device, seed=15)
    k, v = ragged(kvs, dtype, device, kv_layout)
    out, lse = single_prefill_with_kv_cache(q, k, v, causal=True, kv_layout=kv_layout, window_left=40,
                                            logits_soft_cap=20.0, return_lse=True)
    check(out, lse, expected_batch(q, rounded(kvs, dtype), [30], True, 40, cap=20.0), dtype)
    mask = random_masks([30], [77], 16)[0]
    out = flashkern.single_prefill_with_kv_cache_return_lse(q, k, v, custom_mask=mask, kv_layout=kv_layout)[0]
    assert_close(out, expected_batch(q, rounded(kvs, dtype), [30], masks=[mask])[0], dtype)


def test_single_prefill_head_dim_512(device):
    """head_dim 512 (16-row tiles only), GQA 16:1: causal with a window and a soft cap, then a custom mask."""
    kvs = random_kv([90], 1, 512, 20)
    q = rand((21, 16, 512), torch.float16, device, seed=21)
    k, v = ragged(kvs, torch.float16, device)
    out, lse = single_prefill_with_kv_cache(q, k, v, causal=True, window_left=40, logits_soft_cap=20.0,
                                            return_lse=True)
    check(out, lse, expected_batch(q, rounded(kvs, torch.float16), [21], True, 40, cap=20.0), torch.float16)
    mask = random_masks([21], [90], 22)[0]
    out = single_prefill_with_kv_cache(q, k, v, custom_mask=mask)
    assert_close(out, expected_batch(q, rounded(kvs, torch.float16), [21], masks=[mask])[0], torch.float16)


@pytest.mark.parametrize("causal", [False, True])
def test_flashinfer_head_dim_512_paged_prefill_case(device, causal):
    """FlashInfer's paged-prefill test at head_dim 512 as its callers write it (test_batch_prefill_kernels.py):
    2 requests of 17 queries over 97 keys, 4 q and 4 KV heads, pages of 16, N(0, 1) values in float16; run()
    into caller buffers equals run()'s own, and each request equals single_prefill_with_kv_cache (FlashInfer's
    oracle, at its 1e-3) and float64 attention."""
    batch, kv_len, qo_len, page_size, heads, d = 2, 97, 17, 16, 4, 512
    pages = -(-kv_len // page_size)
    g = torch.Generator().manual_seed(27)
    q = torch.randn(batch * qo_len, heads, d, generator=g).half().to(device)
    cache = torch.randn(batch * pages, 2, page_size, heads, d, generator=g).half().to(device)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace(device))
    wrapper.plan(i32([b * qo_len for b in range(batch + 1)]), i32([b * pages for b in range(batch + 1)]),
                 i32(list(range(batch * pages))), i32([(kv_len - 1) % page_size + 1] * batch), heads, heads, d,
                 page_size, causal=causal, q_data_type=torch.float16, kv_data_type=torch.float16)
    o, lse = wrapper.run(q, cache, return_lse=True)
    o_buffer, lse_buffer = poisoned(o.shape, o.dtype, device), poisoned(lse.shape, lse.dtype, device)
    wrapper.run(q, cache, out=o_buffer, lse=lse_buffer, return_lse=True)
    torch.testing.assert_close(o_buffer, o, rtol=0, atol=0)
    torch.testing.assert_close(lse_buffer, lse, rtol=0, atol=0)
    kvs = []
    for b in range(batch):
        k, v = (cache[b * pages : (b + 1) * pages, i].flatten(0, 1)[:kv_len] for i in (0, 1))
        o_single = single_prefill_with_kv_cache(q[b * qo_len : (b + 1) * qo_len], k, v, causal=causal)
        torch.testing.assert_close(o[b * qo_len : (b + 1) * qo_len], o_single, rtol=1e-3, atol=1e-3)
        kvs.append((k.double().cpu(), v.double().cpu()))
    check(o, lse, expected_batch(q, kvs, [qo_len] * batch, causal), torch.float16)


@pytest.mark.parametrize("window_left", [-1, 3])
def test_single_prefill_more_queries_than_keys(device, window_left):
    """Causal, 40 queries over 12 keys: query i is token i - 28, so the first 28 see no key (0, lse -inf)."""
    kvs = random_kv([12], 2, 64, 18)
    q = rand((40, 8, 64), torch.bfloat16, device, seed=19)
    k, v = ragged(kvs, torch.bfloat16, device)
    out, lse = single_prefill_with_kv_cache(q, k, v, causal=True, window_left=window_left, return_lse=True)
    expected = expected_batch(q, rounded(kvs, torch.bfloat16), [40], True, window_left)
    check(out, lse, expected, torch.bfloat16)
    assert bool((lse[:28] == float("-inf")).all()) and bool((out[:28] == 0).all())


def test_decode_window_and_soft_cap(device):
    lengths = [50, 1, 300]
    kvs = random_kv(lengths, 2, 64, 17)
    cache, kv_indptr, kv_indices, last = paged(kvs, 16, "NHD", torch.float16, device, seed=17)
    q = rand((3, 8, 64), torch.float16, device, scale=4.0, seed=18)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace(device))
    wrapper.plan(kv_indptr, kv_indices, last, 8, 2, 64, 16, window_left=20, logits_soft_cap=30.0)
    out, lse = wrapper.run(q, cache, return_lse=True)
    check(out, lse, expected_batch(q, rounded(kvs, torch.float16), [1, 1, 1], False, 20, cap=30.0), torch.float16)
    with pytest.raises(ValueError, match="window_left"):
        wrapper.run(q, cache, window_left=5)
    k, v = ragged(kvs[2:], torch.float16, device)
    out = single_decode_with_kv_cache(q[2], k, v, window_left=7, logits_soft_cap=30.0)
    assert_close(out[None], expected_batch(q[2:], rounded(kvs[2:], torch.float16), [1], False, 7, cap=30.0)[0],
                 torch.float16)


def test_cascade_soft_cap_and_many_queries(device):
    """A shared prefix and per-request causal appends, soft-capped, against attention over the
    concatenated keys; a window in a cascade is refused."""
    prefix, own, qo_lens = 70, [20, 33], [5, 12]
    kvs = random_kv([prefix] + own, 2, 64, 19)
    cache, kv_indptr, kv_indices, last = paged(kvs, 16, "NHD", torch.float16, device, seed=19)
    q = rand((sum(qo_lens), 4, 64), torch.float16, device, scale=4.0, seed=20)
    wrapper = MultiLevelCascadeAttentionWrapper(2, workspace(device))
    pages = kv_indptr.tolist()
    top = (i32([0, 17]), i32([0, pages[1]]), kv_indices[: pages[1]], last[:1])
    own_pages = (i32([0, 5, 17]), kv_indptr[1:] - pages[1], kv_indices[pages[1]:], last[1:])
    levels = list(zip(top, own_pages))
    wrapper.plan(*[list(x) for x in levels], 4, 2, 64, 16, causal=True, logits_soft_cap=25.0)
    out, lse = wrapper.run(q, cache, return_lse=True)
    joined = [(torch.cat([kvs[0][0], k]), torch.cat([kvs[0][1], v])) for k, v in kvs[1:]]
    check(out, lse, expected_batch(q, rounded(joined, torch.float16), qo_lens, True, cap=25.0), torch.float16)
    with pytest.raises(ValueError, match="window_left"):
        wrapper.plan(*[list(x) for x in levels], 4, 2, 64, 16, causal=True, window_left=10)


def test_bad_input():
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(workspace("cpu"))
    with pytest.raises(ValueError, match="custom_mask"):
        wrapper.plan(i32([0, 2]), i32([0, 3]), 4, 2, 64, custom_mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="packed_custom_mask"):
        wrapper.plan(i32([0, 2]), i32([0, 3]), 4, 2, 64, packed_custom_mask=torch.ones(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="qo_indptr"):
        wrapper.plan(i32([0, 2, 4]), i32([0, 3]), 4, 2, 64)
    with pytest.raises(ValueError, match="head_dim_vo"):
        wrapper.plan(i32([0, 2]), i32([0, 3]), 4, 2, 64, head_dim_vo=128)
    with pytest.raises(ValueError, match="head_dim"):
        wrapper.plan(i32([0, 2]), i32([0, 3]), 4, 2, 96)
    with pytest.raises(ValueError, match="window_left"):
        wrapper.plan(i32([0, 2]), i32([0, 3]), 4, 2, 64, window_left=-2)
    with pytest.raises(ValueError, match="pos_encoding_mode"):
        wrapper.plan(i32([0, 2]), i32([0, 3]), 4, 2, 64, pos_encoding_mode="ROPE_LLAMA")
    with pytest.raises(ValueError, match="logits_soft_cap"):
        wrapper.plan(i32([0, 2]), i32([0, 3]), 4, 2, 64, logits_soft_cap=-1.0)
    wrapper.plan(i32([0, 2]), i32([0, 3]), 4, 2, 64)
    q, k = torch.zeros(2, 4, 64, dtype=torch.float16), torch.zeros(2, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="pages"):  # k holds 2 tokens, the plan 3
        wrapper.run(q, k, k)
    with pytest.raises(ValueError, match="o_indptr"):
        wrapper.plan(i32([0, 2]), i32([0, 3]), 4, 2, 64, o_indptr=i32([0, 2]))


def masked_plan(device):
    """A ragged plan with a custom mask and a soft cap, its inputs."""
    qo_lens, kv_lens = [5, 9], [12, 30]
    kvs = random_kv(kv_lens, 2, 64, 21)
    q = rand((14, 4, 64), torch.float16, device, seed=22)
    k, v = ragged(kvs, torch.float16, device)
    masks = random_masks(qo_lens, kv_lens, 23)
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(workspace(device))
    wrapper.plan(indptr(qo_lens), indptr(kv_lens), 4, 2, 64, custom_mask=torch.cat([m.reshape(-1) for m in masks]),
                 logits_soft_cap=10.0)
    return wrapper, q, k, v


def test_opcheck(device):
    from torch.library import opcheck

    wrapper, q, k, v = masked_plan(device)
    info = wrapper._core._plan_info
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device=device)
    opcheck(torch.ops.flashkern.batch_attention.default,
            (q, k[:, None], v[:, None], info["kv_indices"], wrapper._core._workspace, out, lse, info["grid"],
             info["sm_scale"], None, 1.0, False, info["custom_mask"], info["logits_soft_cap"]))


def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    wrapper, q, k, v = masked_plan(device)
    expected = wrapper.run(q, k, v)
    compiled = torch.compile(lambda q, k, v: wrapper.run(q, k, v, return_lse=True), fullgraph=True,
                             backend="aot_eager")
    out, lse = compiled(q, k, v)
    torch.testing.assert_close(out, expected)
    assert torch.isfinite(lse).all()


@requires_gpu
def test_cuda_graph_replay_after_replan():
    """Capture a paged prefill's run() once; a later plan() with other lengths is what a replay computes."""
    kv_heads, group, head_dim, page_size = 2, 4, 64, 16
    bufs = dict(qo_indptr_buf=torch.empty(3, dtype=torch.int32, device="cuda"),
                paged_kv_indptr_buf=torch.empty(3, dtype=torch.int32, device="cuda"),
                paged_kv_indices_buf=torch.empty(512, dtype=torch.int32, device="cuda"),
                paged_kv_last_page_len_buf=torch.empty(2, dtype=torch.int32, device="cuda"))
    wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace("cuda"), use_cuda_graph=True, **bufs)
    q = torch.zeros(40, kv_heads * group, head_dim, dtype=torch.float16, device="cuda")
    pool = torch.zeros(256, 2, page_size, kv_heads, head_dim, dtype=torch.float16, device="cuda")  # the graph's cache
    for seed, (qo_lens, kv_lens) in enumerate((([10, 30], [100, 300]), ([25, 15], [40, 2000]))):
        kvs = random_kv(kv_lens, kv_heads, head_dim, seed)
        cache, kv_indptr, kv_indices, last = paged(kvs, page_size, "NHD", torch.float16, "cuda", extra_pages=0)
        pool[: cache.shape[0]] = cache
        wrapper.plan(indptr(qo_lens), kv_indptr, kv_indices, last, kv_heads * group, kv_heads, head_dim, page_size,
                     causal=True)
        q.copy_(rand(q.shape, torch.float16, "cuda", seed=seed + 50))
        if seed == 0:
            wrapper.run(q, pool)  # warm-up outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = wrapper.run(q, pool)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, expected_batch(q, rounded(kvs, torch.float16), qo_lens, True)[0], torch.float16)


def test_gqa_group_over_128_spans_three_tiles(device):
    """130 q heads a KV head: a query's rows touch three 64-row tiles, split over two chunks; the
    workspace_size() of the plan is enough (items_per_state grows with the heads)."""
    kvs = random_kv([300], 1, 64, 24)
    q = rand((5, 130, 64), torch.float16, device, seed=25)
    k, v = ragged(kvs, torch.float16, device)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace(device, 0))
    cache = (k[:, None], v[:, None])
    args = (i32([0, 5]), i32([0, 300]), torch.arange(300, dtype=torch.int32), i32([1]), 130, 1, 64, 1)
    needed, _ = wrapper.workspace_size(*args, causal=True, fixed_split_size=128)
    wrapper.reset_workspace_buffer(torch.empty(needed, dtype=torch.uint8, device=device))
    wrapper.plan(*args, causal=True, fixed_split_size=128)
    out, lse = wrapper.run(q, cache, return_lse=True)
    check(out, lse, expected_batch(q, rounded(kvs, torch.float16), [5], True), torch.float16)


def test_fixed_buffers(device):
    """use_cuda_graph=True: plan() copies the page tables and the packed mask into the caller's fixed
    buffers and the kernels read those (the same answers); a missing buffer is refused."""
    qo_lens, kv_lens = [6, 20], [30, 45]
    kvs = random_kv(kv_lens, 2, 64, 26)
    cache, kv_indptr, kv_indices, last = paged(kvs, 16, "NHD", torch.float16, device, seed=26)
    q = rand((26, 4, 64), torch.float16, device, seed=27)
    masks = random_masks(qo_lens, kv_lens, 28)
    buffers = dict(qo_indptr_buf=torch.zeros(3, dtype=torch.int32, device=device),
                   paged_kv_indptr_buf=torch.zeros(3, dtype=torch.int32, device=device),
                   paged_kv_indices_buf=torch.zeros(64, dtype=torch.int32, device=device),
                   paged_kv_last_page_len_buf=torch.zeros(2, dtype=torch.int32, device=device),
                   custom_mask_buf=torch.zeros(256, dtype=torch.uint8, device=device))
    wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace(device), use_cuda_graph=True, **buffers)
    assert wrapper.is_cuda_graph_enabled
    wrapper.plan(indptr(qo_lens), kv_indptr, kv_indices, last, 4, 2, 64, 16, packed_custom_mask=packed_bits(masks))
    assert torch.equal(buffers["paged_kv_indices_buf"][: kv_indices.numel()].cpu(), kv_indices)
    assert wrapper._core._plan_info["custom_mask"] is buffers["custom_mask_buf"]
    out, lse = wrapper.run(q, cache, return_lse=True)
    check(out, lse, expected_batch(q, rounded(kvs, torch.float16), qo_lens, masks=masks), torch.float16)
    ragged_wrapper = BatchPrefillWithRaggedKVCacheWrapper(
        workspace(device), use_cuda_graph=True, qo_indptr_buf=buffers["qo_indptr_buf"],
        kv_indptr_buf=torch.zeros(3, dtype=torch.int32, device=device))
    ragged_wrapper.plan(indptr(qo_lens), indptr(kv_lens), 4, 2, 64, causal=True)
    k, v = ragged(kvs, torch.float16, device)
    assert_close(ragged_wrapper.run(q, k, v), expected_batch(q, rounded(kvs, torch.float16), qo_lens, True)[0],
                 torch.float16)
    with pytest.raises(ValueError, match="custom_mask_buf"):
        ragged_wrapper.plan(indptr(qo_lens), indptr(kv_lens), 4, 2, 64, packed_custom_mask=packed_bits(masks))
    with pytest.raises(ValueError, match="use_cuda_graph=True needs paged_kv_indices_buf"):
        BatchPrefillWithPagedKVCacheWrapper(workspace(device), use_cuda_graph=True, qo_indptr_buf=buffers["qo_indptr_buf"],
                                            paged_kv_indptr_buf=buffers["paged_kv_indptr_buf"],
                                            paged_kv_last_page_len_buf=buffers["paged_kv_last_page_len_buf"])
