import math

import torch

from .. import _C
from ._compute import compute_dtype


def merge_states(v, s):
    """Merge attention states: v [tokens, num_states, heads, head_dim], s [tokens, num_states, heads]
    (natural-log sum-exp) -> (v [tokens, heads, head_dim], s [tokens, heads]). All-empty (-inf) gives
    (0, -inf); a NaN anywhere in a row gives NaN."""
    c = compute_dtype(v)
    s = s.to(torch.float64 if c == torch.float64 else torch.float32)
    if s.shape[1] == 0:  # no states: the empty state, as the kernels give
        return v.new_zeros(v.shape[0], *v.shape[2:]), s.new_full((s.shape[0], s.shape[2]), float("-inf"))
    m = s.amax(dim=1)
    empty = m == float("-inf")
    w = torch.exp(s - torch.where(empty, 0.0, m).unsqueeze(1))
    total = w.sum(dim=1)
    merged = (w.unsqueeze(-1) * v.to(c)).sum(dim=1) / total.unsqueeze(-1).to(c)
    merged = torch.where(empty.unsqueeze(-1), 0.0, merged)
    s_out = torch.where(empty, float("-inf"), m + torch.log(total))
    return merged.to(v.dtype), s_out.to(torch.float64 if c == torch.float64 else torch.float32)


def merge_state(v_a, s_a, v_b, s_b):
    """Merge two attention states [tokens, heads, head_dim] / [tokens, heads]."""
    return merge_states(torch.stack([v_a, v_b], dim=1), torch.stack([s_a, s_b], dim=1))


def _split_kv(paged_kv_cache, kv_layout):
    """(k_cache, v_cache), each [pages, page_size, kv_heads, head_dim] ("NHD" view), from the layouts
    FlashInfer accepts: [pages, 2, page_size, kv_heads, D] (NHD), [pages, 2, kv_heads, page_size, D]
    (HND), or a (k_cache, v_cache) tuple of 4-D tensors in either layout."""
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    if isinstance(paged_kv_cache, (tuple, list)):
        k_cache, v_cache = paged_kv_cache
    else:
        k_cache, v_cache = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    if kv_layout == "HND":
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    return k_cache, v_cache


def request_kv(k_cache, v_cache, pages, last_page_len):
    """The keys and values of one request, [length, kv_heads, head_dim], length =
    page_size * (len(pages) - 1) + last_page_len (0 without pages)."""
    page_size = k_cache.shape[1]
    if len(pages) == 0:
        empty = k_cache.new_empty(0, *k_cache.shape[2:])
        return empty, v_cache.new_empty(0, *v_cache.shape[2:])
    length = page_size * (len(pages) - 1) + int(last_page_len)
    k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:length]
    v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:length]
    return k, v


def decode_attention(q, k, v, sm_scale=None):
    """One query token per head over one request's keys: q [qo_heads, D], k and v [length, kv_heads, D]
    (qo_heads a multiple of kv_heads: grouped-query attention) -> (o [qo_heads, D], lse [qo_heads]),
    lse the natural-log sum-exp of the scaled logits. No keys: (0, -inf). float64 in, float64 out."""
    qo_heads, head_dim = q.shape
    c = compute_dtype(q)
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    if k.shape[0] == 0:
        return q.new_zeros(qo_heads, head_dim, dtype=c), torch.full((qo_heads,), float("-inf"), dtype=c)
    group = qo_heads // k.shape[1]
    k = k.to(c).repeat_interleave(group, dim=1)  # [length, qo_heads, D]
    v = v.to(c).repeat_interleave(group, dim=1)
    logits = torch.einsum("hd,lhd->hl", q.to(c), k) * sm_scale
    lse = torch.logsumexp(logits, dim=-1)
    return torch.einsum("hl,lhd->hd", torch.softmax(logits, dim=-1), v), lse


def prefill_attention(q, k, v, causal=False, window_left=-1, logits_soft_cap=0.0, mask=None, sm_scale=None,
                      sinks=None):
    """Attention of one request's qo_len query tokens, its last ones, over its kv_len keys: q [qo_len,
    qo_heads, D], k and v [kv_len, kv_heads, D] (GQA) -> (o [qo_len, qo_heads, D], lse [qo_len,
    qo_heads]) in the compute dtype (float64 for float64 input). Query i is token i + kv_len - qo_len:
    causal, it sees the keys j <= that; window_left = w >= 0 hides j < i + kv_len - qo_len - w; mask
    [qo_len, kv_len] bool (True: may attend) replaces causal; logits_soft_cap c > 0: c * tanh(x / c)
    after sm_scale; sinks [qo_heads]: one more logit per head, of value zero. A query that sees
    nothing: (0, -inf) (with a sink: 0 and the sink's logit)."""
    qo_len, qo_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[:2]
    c = compute_dtype(q)
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    group = qo_heads // kv_heads
    k = k.to(c).repeat_interleave(group, dim=1)
    v = v.to(c).repeat_interleave(group, dim=1)
    logits = soft_cap(torch.einsum("qhd,khd->hqk", q.to(c), k) * sm_scale, logits_soft_cap)
    i = torch.arange(qo_len, device=q.device)[:, None] + (kv_len - qo_len)  # each query's position
    j = torch.arange(kv_len, device=q.device)[None, :]
    if mask is not None:
        hidden = ~mask.to(q.device)
    else:
        hidden = j > i if causal else torch.zeros(qo_len, kv_len, dtype=torch.bool, device=q.device)
    if window_left >= 0:
        hidden = hidden | (j < i - window_left)
    weights, lse = softmax_state(logits.masked_fill(hidden[None], float("-inf")))  # lse [heads, qo_len]
    o = torch.einsum("hqk,khd->qhd", weights, v)
    return final_state(o, lse.transpose(0, 1), sinks, 1.0)


def batch_decode(q, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout="NHD", sm_scale=None):
    """Paged-KV decode for a batch: q [batch, qo_heads, D], the page table in CSR form (kv_indptr
    [batch + 1], kv_indices, kv_last_page_len [batch]) -> (o [batch, qo_heads, D], lse [batch, qo_heads])."""
    k_cache, v_cache = _split_kv(paged_kv_cache, kv_layout)
    indptr, indices, last = kv_indptr.tolist(), kv_indices.tolist(), kv_last_page_len.tolist()
    outs, lses = [], []
    for b in range(q.shape[0]):
        k, v = request_kv(k_cache, v_cache, indices[indptr[b] : indptr[b + 1]], last[b])
        o, lse = decode_attention(q[b], k, v, sm_scale)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs).to(q.dtype), torch.stack(lses).to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def cascade_decode(q, paged_kv_cache, qo_indptr_arr, kv_indptr_arr, kv_indices_arr, kv_last_page_len_arr,
                   kv_layout="NHD", sm_scale=None):
    """Multi-level cascade decode, one query token per request: level i's KV (its own page table)
    is shared by the queries qo_indptr_arr[i][j]:qo_indptr_arr[i][j+1]; each query's attention is
    the merge of its states at every level. Level 0 is the most shared prefix."""
    batch = q.shape[0]
    v = s = None
    for qo_indptr, kv_indptr, kv_indices, last in zip(qo_indptr_arr, kv_indptr_arr, kv_indices_arr,
                                                     kv_last_page_len_arr):
        qo = qo_indptr.tolist()
        group_of = torch.repeat_interleave(torch.arange(len(qo) - 1), torch.tensor(qo[1:]) - torch.tensor(qo[:-1]))
        if group_of.numel() != batch:
            raise ValueError(f"qo_indptr must cover the {batch} queries, covers {group_of.numel()}")
        # every query of group g attends to group g's KV at this level
        starts, ends = kv_indptr[group_of], kv_indptr[group_of + 1]
        pages = [kv_indices[a:b] for a, b in zip(starts.tolist(), ends.tolist())]
        level_indices = torch.cat(pages) if pages else kv_indices[:0]
        level_kv_indptr = torch.tensor([0] + torch.cumsum(ends - starts, 0).tolist(), dtype=kv_indptr.dtype)
        level_v, level_s = batch_decode(q, paged_kv_cache, level_kv_indptr, level_indices, last[group_of],
                                        kv_layout, sm_scale)
        v, s = (level_v, level_s) if v is None else merge_state(v, s, level_v, level_s)
    return v, s


# ---- running a plan: what torch.ops.flashkern.batch_attention does, in torch ----

KIND_ROWS = _C.KIND_ROWS  # rows of a work item per kind (attention_work.h: kind_rows)
ITEM_WORDS = 12  # attention_work.h: kItemWords


PLAN_MAGIC = 0x4C504B46  # attention_work.h: kPlanMagic, the first word of every plan


def check_plan_header(words, batch=None):
    """The 16 header words of a plan as a list; words that hold no plan (for `batch` queries): ValueError."""
    header = words[:16].tolist()
    if len(header) < 16 or header[0] != PLAN_MAGIC or (batch is not None and header[10] != batch):
        raise ValueError(f"batch_attention: the workspace holds no flashkern plan"
                         f"{'' if batch is None else f' for {batch} queries'} (a wrapper's plan() writes it)")
    return header


def read_plan(words, batch=None):
    """A plan (the int32 words at the start of a workspace, attention_work.h) as Python lists:
    (items per kind, merge_indptr, merge_indices, identity_levels), an item being its 12 words (level,
    q_begin, n_q, row_begin, page_begin, kv_begin, kv_end, slot_base, first, last, mask, length).
    Reads the words back to the host. Words that hold no plan (for `batch` queries): ValueError."""
    w = words.cpu()
    header = check_plan_header(w, batch)
    count, start, indptr_at, indices_at, states, plan_batch = header[1:4], header[4:7], header[7], header[8], \
        header[9], header[10]
    items = [w[start[k] : start[k] + ITEM_WORDS * count[k]].view(-1, ITEM_WORDS).tolist() for k in range(3)]
    return (items, w[indptr_at : indptr_at + plan_batch + 1].tolist(), w[indices_at : indices_at + states].tolist(),
            header[11])


def softmax_state(logits):
    """(weights, lse) of logits over the last dimension: exp(logit - max) / sum and max + log(sum), as the
    kernels form them. Subtracting the max keeps float32's accuracy at logits far from zero; exp(logit -
    lse) loses 0.2 % of a weight at logits near -46,000 (FlashInfer's issue 4450). A row of -inf: weights
    0 and lse -inf."""
    m = logits.amax(dim=-1, keepdim=True)
    e = torch.exp(logits - torch.where(m == float("-inf"), 0.0, m))
    total = e.sum(dim=-1, keepdim=True)
    weights = e / torch.where(total == 0, 1.0, total)
    return weights, (m + torch.log(total)).squeeze(-1)


def soft_cap(logits, cap):
    """Gemma2's logit soft-capping, cap * tanh(logits / cap); cap 0 or None: none."""
    return logits if not cap else cap * torch.tanh(logits / cap)


def unpack_mask_bits(packed, begin, count):
    """Bits begin..begin+count of a packed mask (numpy.packbits(..., bitorder="little")) as bools."""
    if count == 0:
        return torch.zeros(0, dtype=torch.bool, device=packed.device)
    first, last = begin // 8, (begin + count - 1) // 8
    byte = packed[first : last + 1].long()
    bits = (byte[:, None] >> torch.arange(8, device=packed.device)) & 1
    return bits.reshape(-1)[begin - 8 * first : begin - 8 * first + count].bool()


def final_state(v, s, sinks, out_scale):
    """A query's finished attention (attention_state.h: final_state): (v, s) [.., heads, D] / [.., heads]
    merged with each head's sink, a key of logit sinks[h] whose value is zero, then v * out_scale."""
    if sinks is not None:
        sink = sinks.to(s.dtype).expand_as(s)
        merged_v, merged_s = merge_state(v, s, torch.zeros_like(v), sink)
        takes_all = (sink == float("inf")) & ~s.isnan()  # the sink's weight is 1 (not exp(inf - inf))
        v = torch.where(takes_all[..., None], 0.0, merged_v)
        s = torch.where(takes_all, float("inf"), merged_s)
    return v * out_scale, s


def valid_scales(scale):
    """Where a float32 tensor of scales holds positive finite numbers (numeric.h: valid_scale)."""
    scale = scale.to(torch.float32)
    return torch.isfinite(scale) & (scale > 0)


def dequant_factor(k_scale, v_scale, kv_heads, device):
    """The kernels' per-head output factor (attention_tiles.cuh: output_dequant): v_scale (1: none), NaN where
    k_scale or v_scale is not a positive finite number."""
    v = torch.ones(kv_heads, dtype=torch.float32, device=device) if v_scale is None else v_scale.to(torch.float32)
    ok = valid_scales(v) if k_scale is None else valid_scales(v) & valid_scales(k_scale)
    return torch.where(ok, v, float("nan"))


def batch_attention(q, k_cache, v_cache, kv_indices, words, partial_s, partial_v, sm_scale, sinks=None, out_scale=1.0,
                    custom_mask=None, logits_soft_cap=0.0, logits_out=None, k_scale=None, v_scale=None):
    """The plan in `words` run with torch, item by item as the kernels run it: each item's state over
    its KV chunk (query i of a group sees the tokens j with first <= j - i <= last, and its custom
    mask's bits) goes straight to (out, lse), finished with the sinks and out_scale, for a query
    with one state, and to its slot of partial_s / partial_v otherwise; then each query's slots are
    merged and finished. q [batch, qo_heads, D], k_cache / v_cache [pages, page_size, kv_heads, D]
    -> (out, lse), in the compute dtype. logits_out [batch, qo_heads, L]: kv_scores' epilogue, the base-2
    logit of each key a query sees, written by the decode and 16-row items (not the 64-row ones). A page index outside the cache raises ValueError (the
    kernels write NaN for the query instead). An fp8 cache is dequantized exactly (its values as floats),
    times k_scale / v_scale [kv_heads] where given; a head whose k_scale or v_scale is not a positive
    finite number gets NaN rows, as the kernels do with what the op gives them (_validate.nan_where_bad)."""
    if v_scale is not None or k_scale is not None:
        v_scale = dequant_factor(k_scale, v_scale, k_cache.shape[2], q.device)
    batch, qo_heads, head_dim = q.shape
    num_pages, page_size, kv_heads = k_cache.shape[:3]
    group = qo_heads // kv_heads
    c = compute_dtype(q)
    items, indptr, merge_indices, identity_levels = read_plan(words, batch)
    n_states = torch.tensor([indptr[t + 1] - indptr[t] for t in range(batch)], dtype=torch.long)
    out = torch.zeros(batch, qo_heads, head_dim, dtype=c, device=q.device)
    lse = torch.full((batch, qo_heads), float("-inf"), dtype=c, device=q.device)
    kv_heads_of = torch.arange(kv_heads, device=q.device)
    for kind, kind_items in enumerate(items):
        for level, q_begin, n_q, row_begin, page_begin, kv_begin, kv_end, slot_base, first, last, mask, length in \
                kind_items:
            rows = torch.arange(row_begin, min(row_begin + KIND_ROWS[kind], n_q * group), device=q.device)
            i, head_in_group = rows // group, rows % group  # the rows' queries in the group
            t = q_begin + i
            pos = torch.arange(kv_begin, kv_end, device=q.device)
            entry = page_begin + pos // page_size
            pages = entry if identity_levels >> level & 1 else kv_indices[level][entry].long()
            if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
                raise ValueError(
                    f"batch_attention: kv_indices[{level}] holds page {int(pages.max())} (or a negative one), "
                    f"outside the cache's {num_pages} pages"
                )
            k, v = k_cache[pages, pos % page_size].to(c), v_cache[pages, pos % page_size].to(c)  # [n, kv_heads, D]
            if k_scale is not None:
                k = k * k_scale.to(c)[:, None]
            if v_scale is not None:
                v = v * v_scale.to(c)[:, None]
            heads = kv_heads_of[:, None] * group + head_in_group[None, :]  # [kv_heads, rows]: the q heads
            # the products as one fixed shape per kind, the tile's rows, as a kernel's: a row's bits do not
            # depend on how many rows its item has (CPU matrix products take other paths for few rows)
            tile_q = q.new_zeros((kv_heads, KIND_ROWS[kind], head_dim), dtype=c)
            tile_q[:, : rows.numel()] = q[t[None, :], heads].to(c)
            logits = torch.einsum("hrd,nhd->hrn", tile_q, k)[:, : rows.numel()]
            logits = soft_cap(logits * sm_scale, logits_soft_cap)
            offset = pos[None, :] - i[:, None]
            hidden = (offset < first) | (offset > last)  # [rows, n]: outside the window or past the diagonal
            if mask >= 0:
                bits = unpack_mask_bits(custom_mask, mask, n_q * length).view(n_q, length)
                hidden |= ~bits[i][:, kv_begin:kv_end]
            if logits_out is not None and kind != 2:  # the 64-row kernel writes none (ops.h)
                hh, rr, nn = (~hidden[None]).expand_as(logits).nonzero(as_tuple=True)
                logits_out[t[rr], heads[hh, rr], pos[nn]] = (logits[hh, rr, nn] / math.log(2)).to(logits_out.dtype)
            weights, s = softmax_state(logits.masked_fill(hidden[None], float("-inf")))
            tile_w = weights.new_zeros((kv_heads, KIND_ROWS[kind], weights.shape[2]))
            tile_w[:, : rows.numel()] = weights
            o = torch.einsum("hrn,nhd->hrd", tile_w, v)[:, : rows.numel()]
            # a row writes only if its query sees the chunk (else it has no state here)
            sees = ((i + last + 1).clamp(max=kv_end) > (i + first).clamp(min=kv_begin))[None, :].expand_as(heads)
            tt = t[None, :].expand_as(heads)
            direct = (n_states[t.cpu()].to(q.device)[None, :].expand_as(heads) == 1) & sees
            merged = (n_states[t.cpu()].to(q.device)[None, :].expand_as(heads) > 1) & sees
            if sinks is not None or out_scale != 1.0:
                fo, fs = final_state(o, s, None if sinks is None else sinks.to(q.device)[heads], out_scale)
                o, s = torch.where(direct[..., None], fo, o), torch.where(direct, fs, s)
            out[tt[direct], heads[direct]] = o[direct]
            lse[tt[direct], heads[direct]] = s[direct]
            slot = (slot_base + tt)[merged]
            partial_v[slot, heads[merged]] = o[merged].float()
            partial_s[slot, heads[merged]] = s[merged].float()
    for t in range(batch):
        if n_states[t] != 1:  # no state (0, -inf) or several to merge
            slots = torch.tensor(merge_indices[indptr[t] : indptr[t + 1]], dtype=torch.long, device=q.device)
            v, s = (out[t], lse[t]) if not slots.numel() else \
                (x[0] for x in merge_states(partial_v[slots][None].to(c), partial_s[slots][None].to(c)))
            out[t], lse[t] = final_state(v, s, sinks, out_scale)
    return out, lse
