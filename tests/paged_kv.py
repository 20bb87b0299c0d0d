"""Paged KV caches for the attention tests: per-request keys and values scattered over shuffled
pages, NaN in every slot no request owns (a kernel that reads one shows it), the CSR page table,
and attention computed from scratch in float64 as the oracle."""

import torch
from conftest import rand

I32 = torch.int32


def i32(values):
    return torch.tensor(values, dtype=I32)


def random_kv(lengths, kv_heads, head_dim, seed=0):
    """[(k, v)] per request, float64 [length, kv_heads, head_dim]."""
    return [(rand((n, kv_heads, head_dim), torch.float64, "cpu", seed=seed + 2 * i),
             rand((n, kv_heads, head_dim), torch.float64, "cpu", seed=seed + 2 * i + 1)) for i, n in enumerate(lengths)]


def paged(kvs, page_size, kv_layout="NHD", dtype=torch.float64, device="cpu", extra_pages=3, seed=0):
    """The requests' K/V in a shuffled paged cache [pages, 2, page_size, kv_heads, D] (NHD) or
    [pages, 2, kv_heads, page_size, D] (HND); returns (cache, kv_indptr, kv_indices, kv_last_page_len)
    with the page table as CPU int32 tensors."""
    g = torch.Generator().manual_seed(seed)
    counts = [-(-k.shape[0] // page_size) for k, _ in kvs]
    total = sum(counts) + extra_pages
    kv_heads, head_dim = kvs[0][0].shape[1:]
    cache = torch.full((total, 2, page_size, kv_heads, head_dim), float("nan"), dtype=torch.float64)
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
    return cache.to(device=device, dtype=dtype), i32(indptr), i32(indices), i32(last)


def attention(q, k, v, sm_scale=None, sinks=None):
    """One query per q head over one key set, float64: q [qo_heads, D], k and v [n, kv_heads, D]
    (grouped-query) -> (o [qo_heads, D], lse [qo_heads]); no keys: (0, -inf). sinks [qo_heads]: one
    more logit per head, of value zero, in the softmax and the lse (GPT-OSS)."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    group = q.shape[0] // k.shape[1]
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    logits = torch.einsum("hd,lhd->hl", q, k.repeat_interleave(group, 1)) * sm_scale
    values = v.repeat_interleave(group, 1)
    if sinks is not None:
        logits = torch.cat([logits, sinks.double().cpu()[:, None]], 1)
        values = torch.cat([values, torch.zeros_like(values[:1])])
    if logits.shape[1] == 0:
        return torch.zeros_like(q), torch.full(q.shape[:1], float("-inf"), dtype=torch.float64)
    o = torch.einsum("hl,lhd->hd", torch.softmax(logits, -1), values)
    return o, torch.logsumexp(logits, -1)


def rounded(kvs, dtype):
    """The requests' K/V as the kernels see them: rounded to dtype, back in float64."""
    return [(k.to(dtype).double(), v.to(dtype).double()) for k, v in kvs]


def causal_expected(q, kvs, q_len, sinks=None, sm_scale=None):
    """float64 attention of q [batch * q_len, heads, D]: token i of request b (kv_len keys) sees the keys
    up to kv_len - q_len + i."""
    expected = []
    for row in range(q.shape[0]):
        b, i = divmod(row, q_len)
        k, v = kvs[b]
        visible = max(k.shape[0] - q_len + 1 + i, 0)
        expected.append(attention(q[row], k[:visible], v[:visible], sm_scale, sinks))
    return expected
