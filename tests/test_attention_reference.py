"""The pure-torch references for paged-KV decode and cascade decode (the oracles the GPU kernels
will be tested against): page-table arithmetic, layouts, GQA, empty requests, cascade = attention
over the concatenated prefix and suffix."""

import pytest
import torch
from conftest import rand

from flashkern import ref


def paged(kvs, page_size, kv_layout, extra_pages=3, seed=0):
    """Scatter per-request K/V [length, kv_heads, D] into a shuffled paged cache; returns the cache
    (NHD/HND 5-D) and the CSR page table."""
    g = torch.Generator().manual_seed(seed)
    counts = [-(-k.shape[0] // page_size) for k, _ in kvs]
    total = sum(counts) + extra_pages
    kv_heads, head_dim = kvs[0][0].shape[1:]
    cache = rand((total, 2, page_size, kv_heads, head_dim), torch.float64, "cpu", seed=seed + 1)  # garbage elsewhere
    order = torch.randperm(total, generator=g).tolist()
    indptr, indices, last = [0], [], []
    for (k, v), n in zip(kvs, counts):
        pages = [order.pop() for _ in range(n)]
        for i, page in enumerate(pages):
            rows = slice(i * page_size, min((i + 1) * page_size, k.shape[0]))
            cache[page, 0, : rows.stop - rows.start] = k[rows]
            cache[page, 1, : rows.stop - rows.start] = v[rows]
        indices += pages
        indptr.append(len(indices))
        last.append(k.shape[0] - (n - 1) * page_size if n else 0)
    if kv_layout == "HND":
        cache = cache.transpose(2, 3).contiguous()
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return cache, i32(indptr), i32(indices), i32(last)


def brute_force(q, k, v):
    group = q.shape[0] // k.shape[1]
    logits = torch.einsum("hd,lhd->hl", q, k.repeat_interleave(group, 1)) / q.shape[-1] ** 0.5
    return torch.einsum("hl,lhd->hd", torch.softmax(logits, -1), v.repeat_interleave(group, 1)), torch.logsumexp(logits, -1)


@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("group", [1, 5, 7, 8])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_batch_decode_reference(page_size, group, kv_layout):
    kv_heads, head_dim, lengths = 2, 64, [1, 17, 37, 0, 130]
    kvs = [(rand((n, kv_heads, head_dim), torch.float64, "cpu", seed=10 + i),
            rand((n, kv_heads, head_dim), torch.float64, "cpu", seed=20 + i)) for i, n in enumerate(lengths)]
    cache, indptr, indices, last = paged(kvs, page_size, kv_layout)
    q = rand((len(lengths), kv_heads * group, head_dim), torch.float64, "cpu", seed=30)
    o, lse = ref.batch_decode(q, cache, indptr, indices, last, kv_layout)
    for b, (k, v) in enumerate(kvs):
        if k.shape[0] == 0:
            assert (o[b] == 0).all() and (lse[b] == float("-inf")).all()
            continue
        eo, e_lse = brute_force(q[b], k, v)
        torch.testing.assert_close(o[b], eo)
        torch.testing.assert_close(lse[b], e_lse)
    k_cache, v_cache = (cache[:, 0], cache[:, 1])
    o_tuple, _ = ref.batch_decode(q, (k_cache, v_cache), indptr, indices, last, kv_layout)
    torch.testing.assert_close(o_tuple, o)


def test_cascade_reference_is_attention_over_prefix_and_suffix():
    kv_heads, group, head_dim, page_size = 2, 4, 64, 16
    prefix_len, suffix_lens = 70, [5, 0, 33, 16]  # one request with an empty suffix
    prefix = (rand((prefix_len, kv_heads, head_dim), torch.float64, "cpu", seed=1),
              rand((prefix_len, kv_heads, head_dim), torch.float64, "cpu", seed=2))
    suffixes = [(rand((n, kv_heads, head_dim), torch.float64, "cpu", seed=3 + i),
                 rand((n, kv_heads, head_dim), torch.float64, "cpu", seed=13 + i)) for i, n in enumerate(suffix_lens)]
    cache, indptr, indices, last = paged([prefix, *suffixes], page_size, "NHD", seed=5)
    batch = len(suffix_lens)
    q = rand((batch, kv_heads * group, head_dim), torch.float64, "cpu", seed=40)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    # level 0: one group (the whole batch) sharing the prefix's pages; level 1: one group per request
    level0 = (i32([0, batch]), indptr[:2], indices[: indptr[1]], last[:1])
    level1 = (i32(list(range(batch + 1))), indptr[1:] - indptr[1], indices[indptr[1] :], last[1:])
    o, lse = ref.cascade_decode(q, cache, [level0[0], level1[0]], [level0[1], level1[1]], [level0[2], level1[2]],
                                [level0[3], level1[3]])
    for b, (k, v) in enumerate(suffixes):
        eo, e_lse = brute_force(q[b], torch.cat([prefix[0], k]), torch.cat([prefix[1], v]))
        torch.testing.assert_close(o[b], eo)
        torch.testing.assert_close(lse[b], e_lse)


def test_decode_reference_natural_log_and_scale():
    q = rand((4, 32), torch.float64, "cpu", seed=50)
    k, v = rand((9, 4, 32), torch.float64, "cpu", seed=51), rand((9, 4, 32), torch.float64, "cpu", seed=52)
    o, lse = ref.decode_attention(q, k, v, sm_scale=0.3)
    logits = torch.einsum("hd,lhd->hl", q, k) * 0.3
    torch.testing.assert_close(lse, torch.log(torch.exp(logits).sum(-1)))  # natural log, not base 2
    torch.testing.assert_close(o, torch.einsum("hl,lhd->hd", torch.softmax(logits, -1), v))
