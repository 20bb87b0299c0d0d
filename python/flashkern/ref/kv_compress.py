"""References of KV-cache compression: the CPU implementations of torch.ops.flashkern.kv_scores,
kv_select and kv_compact, and the test oracles.

Per request, on dense tensors in position order (keys [kv_len, kv_heads, D], scores [kv_len, kv_heads]):
- attention_probs: softmax(q k^T * sm_scale) of a request's queries (its last n tokens) over its keys,
  from the lse the attention kernels return (natural log): exp(logit - lse), with the causal and
  window masks and the soft cap of the attention kernels.
- key_scores: those probabilities summed over the queries and each GQA group's heads, times scale
  (SnapKV's vote is the mean: scale = 1 / (window * group size); H2O's running score: scale = 1).
- selection_keys / select: the kernels' order: the first keep_first and the last `window` positions
  above every score, then the scores (optionally average-pooled over the keys before the window,
  avg_pool1d with zero padding), a NaN below all, ties to the lower position; kept positions ascending.
- compact: the kept rows of each head, in order.
The paged functions below apply them request by request through the page tables.
"""

import math

import torch


def attention_probs(q, k, lse, sm_scale=None, causal=True, window_left=-1, logits_soft_cap=0.0):
    """q [n, qo_heads, D] (the request's last n tokens), k [kv_len, kv_heads, D], lse [n, qo_heads] ->
    probabilities [n, qo_heads, kv_len] in float64; a key a query does not see has 0."""
    n, qo_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[:2]
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    kk = k.double().repeat_interleave(qo_heads // kv_heads, dim=1)
    logits = torch.einsum("nhd,lhd->nhl", q.double(), kk) * sm_scale
    if logits_soft_cap:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    return probs_from_logits(logits, lse, causal, window_left)


def probs_from_logits(logits, lse, causal=True, window_left=-1):
    """Natural-log logits [n, qo_heads, kv_len] of a request's last n queries -> float64 probabilities
    exp(logit - lse), 0 where a query does not see the key (a logit there is never read)."""
    n, _, kv_len = logits.shape
    p = torch.exp(logits.double() - lse.double()[..., None])
    position = torch.arange(n)[:, None] + (kv_len - n)
    key = torch.arange(kv_len)[None, :]
    hidden = torch.zeros(n, kv_len, dtype=torch.bool)
    if causal:
        hidden |= key > position
    if window_left >= 0:
        hidden |= key < position - window_left
    hidden = hidden[:, None, :] | torch.isinf(lse)[..., None]  # a query that sees no key: no probabilities
    return torch.where(hidden, 0.0, p)


def group_sum(p, kv_heads):
    """[n, qo_heads, kv_len] -> [kv_len, kv_heads]: summed over the queries and each GQA group's heads."""
    n, qo_heads, kv_len = p.shape
    return p.reshape(n, kv_heads, qo_heads // kv_heads, kv_len).sum(dim=(0, 2)).transpose(0, 1)


def key_scores(q, k, lse, scale=1.0, **attention):
    """[kv_len, kv_heads] float64: scale * the probabilities summed over q's queries and each group."""
    return group_sum(attention_probs(q, k, lse, **attention), k.shape[1]) * scale


def pool(scores, kernel_size, pooled):
    """The first `pooled` rows of scores [kv_len, kv_heads] average-pooled along the keys as
    avg_pool1d(kernel_size, stride 1, padding kernel_size // 2) (zero padding counted), the rest as
    they are; in the kernels' float32 order (0, then the window's keys in position order, then / size)."""
    if kernel_size <= 1 or pooled <= 0:
        return scores.clone()
    x = scores[:pooled].float()
    half = kernel_size // 2
    padded = torch.cat([x.new_zeros(half, x.shape[1]), x, x.new_zeros(half, x.shape[1])])
    total = torch.zeros_like(x)
    for t in range(kernel_size):
        total = total + padded[t : t + pooled]
    out = scores.clone()
    out[:pooled] = (total / float(kernel_size)).to(scores.dtype)
    return out


def selection_keys(scores, window=0, keep_first=0, kernel_size=1):
    """scores [kv_len, kv_heads] (float32; None: no scores) -> int64 keys whose descending order, ties to
    the lower position, is the selection order (kernels/kv_compress.cuh: score_key, kForcedKey)."""
    kv_len, kv_heads = scores.shape
    pooled = max(kv_len - window, 0)
    s = pool(scores.float(), kernel_size, pooled)
    bits = s.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    keys = torch.where(bits >= 0x80000000, ~bits & 0xFFFFFFFF, bits | 0x80000000)
    keys = keys.masked_fill(torch.isnan(s), 0)
    keys[pooled:] = 0xFFFFFFFF
    keys[: min(keep_first, kv_len)] = 0xFFFFFFFF
    return keys


def select(scores, budget, window=0, keep_first=0, kernel_size=1):
    """scores [kv_len, kv_heads] -> kept positions [budget, kv_heads] int32, ascending per head; a budget
    past kv_len keeps every key and pads with -1."""
    kv_len, kv_heads = scores.shape
    if budget >= kv_len:
        kept = torch.full((budget, kv_heads), -1, dtype=torch.int32)
        kept[:kv_len] = torch.arange(kv_len, dtype=torch.int32)[:, None]
        return kept
    keys = selection_keys(scores, window, keep_first, kernel_size)
    order = torch.sort(-keys, dim=0, stable=True).indices[:budget]  # descending key, ties to the lower position
    return torch.sort(order, dim=0).values.to(torch.int32)


def compact(x, kept):
    """x [kv_len, kv_heads, ...] (keys, values or scores), kept [budget, kv_heads] -> [budget, kv_heads, ...]."""
    index = kept.long().view(*kept.shape, *([1] * (x.dim() - 2))).expand(kept.shape[0], kept.shape[1], *x.shape[2:])
    return torch.gather(x, 0, index)


# ---- the paged ops (CPU implementations of torch.ops.flashkern.kv_*) ----


def _requests(kv_indptr, kv_indices, kv_last_page_len, page_size):
    """(pages, kv_len) of each request, from host copies of its page table."""
    indptr, indices, last = kv_indptr.tolist(), kv_indices.cpu(), kv_last_page_len.tolist()
    for b in range(len(indptr) - 1):
        pages = indices[indptr[b] : indptr[b + 1]].long()
        yield pages, (len(pages) - 1) * page_size + last[b] if len(pages) else 0


def _positions(pages, kv_len, page_size):
    """(page, slot) of positions 0 .. kv_len - 1."""
    j = torch.arange(kv_len)
    return pages[j // page_size], j % page_size


def kv_scores(q, lse, k_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, scores, sm_scale, scale, causal,
              window_left, logits_soft_cap, accumulate, logits=None):
    """torch.ops.flashkern.kv_scores (ops.h: KvScoresParams), in place on scores; from q and K, or from the
    attention's base-2 logits [queries, qo_heads, >= kv_len] (its soft cap applied)."""
    page_size = k_cache.shape[1]
    qo = qo_indptr.tolist()
    for b, (pages, kv_len) in enumerate(_requests(kv_indptr, kv_indices, kv_last_page_len, page_size)):
        if kv_len == 0:
            continue
        page, slot = _positions(pages, kv_len, page_size)
        rows = slice(qo[b], qo[b + 1])
        if logits is None:
            total = key_scores(q[rows], k_cache[page, slot], lse[rows], scale, sm_scale=sm_scale, causal=causal,
                               window_left=window_left, logits_soft_cap=logits_soft_cap)
        else:
            natural = logits[rows, :, :kv_len].double() * math.log(2)
            total = group_sum(probs_from_logits(natural, lse[rows], causal, window_left), k_cache.shape[2]) * scale
        total = total.to(scores.dtype)
        old = scores[page, :, slot]  # [kv_len, kv_heads]
        if accumulate:
            cached = torch.arange(kv_len) < kv_len - (qo[b + 1] - qo[b])
            total = torch.where(cached[:, None], old + total, total)
        scores[page, :, slot] = total


def kv_select(scores, kv_indptr, kv_indices, kv_last_page_len, kept_indptr, num_kept, window, keep_first, kernel_size):
    """torch.ops.flashkern.kv_select: kept positions [num_kept, kv_heads] int32."""
    kv_heads, page_size = scores.shape[1:]
    kept = torch.empty(num_kept, kv_heads, dtype=torch.int32)
    ki = kept_indptr.tolist()
    for b, (pages, kv_len) in enumerate(_requests(kv_indptr, kv_indices, kv_last_page_len, page_size)):
        page, slot = _positions(pages, kv_len, page_size)
        kept[ki[b] : ki[b + 1]] = select(scores[page, :, slot], ki[b + 1] - ki[b], window, keep_first, kernel_size)
    return kept


def kv_compact(k_cache, v_cache, scores, kv_indptr, kv_indices, kept, kept_indptr, out_indptr, out_indices):
    """torch.ops.flashkern.kv_compact, in place on the caches (and scores): every source is read before
    any destination is written."""
    page_size, kv_heads = k_cache.shape[1:3]
    src_ptr, src_idx, ki = kv_indptr.tolist(), kv_indices.cpu().long(), kept_indptr.tolist()
    dst_ptr, dst_idx = out_indptr.tolist(), out_indices.cpu().long()
    moves = []
    for b in range(len(src_ptr) - 1):
        rows = kept[ki[b] : ki[b + 1]].long()  # [n, kv_heads]
        if rows.numel() == 0:
            continue
        valid = rows >= 0
        src_pages = src_idx[src_ptr[b] : src_ptr[b + 1]]
        dst_pages = dst_idx[dst_ptr[b] : dst_ptr[b + 1]]
        i = torch.arange(rows.shape[0])[:, None].expand_as(rows)[valid]
        j, h = rows[valid], torch.arange(kv_heads)[None, :].expand_as(rows)[valid]
        src = (src_pages[j // page_size], j % page_size, h)
        dst = (dst_pages[i // page_size], i % page_size, h)
        moves.append((dst, src, k_cache[src].clone(), v_cache[src].clone(),
                      None if scores is None else scores[src[0], src[2], src[1]].clone()))
    for dst, _, k, v, s in moves:
        k_cache[dst] = k
        v_cache[dst] = v
        if s is not None:
            scores[dst[0], dst[2], dst[1]] = s
