"""KV-cache compression on a paged KV cache: per-key attention scores, selection and compaction as
kernels, and the SnapKV, H2O and StreamingLLM policies on top of them.

Layouts are those of the paged attention wrappers: the cache ``[pages, 2, page_size, kv_heads, D]``
(NHD) or ``[pages, 2, kv_heads, page_size, D]`` (HND), or a (k_cache, v_cache) pair; page tables as
int32 CSR (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``). Per-key scores are float32
``[num_pages, num_kv_heads, page_size]``, laid out like the cache so that they move with the pages.
Keys are stored after RoPE: compaction moves them as they are, and the caller keeps each request's
logical length for the next token's position.

- :func:`key_scores`: per key and KV head, ``scale * sum`` over the given queries (each request's last
  tokens) and the GQA group's q heads of ``softmax(q k^T * sm_scale)[key]``, from the lse the attention
  run returned (natural log, no second softmax over the row). ``accumulate=True`` adds into ``scores``
  (H2O's running score; keys appended by this step start from 0), else writes.
- :func:`select_keys`: per request and KV head the positions of the ``budget`` highest scores,
  ascending, ties to the lower position; the first ``keep_first`` (attention sinks) and the last
  ``window`` positions rank above every score (the lower positions first among them), a NaN below all;
  ``kernel_size > 1`` scores the keys before the window by SnapKV's average pooling (avg_pool1d,
  stride 1, zero padding ``kernel_size // 2``). Every head keeps the same number of keys, so one page
  table serves all heads.
- :func:`compact`: the kept keys, values (and scores) of each request move, per KV head its own
  positions, to positions 0, 1, ... of the request's own first pages (in place) or of pages the caller
  gives (``out_indptr``/``out_indices``, pages no request reads: fresh ones; then requests may share
  the pages they read, as prefixes do). Returns the new page table and the pages no longer used.
  :meth:`flashkern.prefix_cache.PrefixCache.compact` does this for the cache's running requests and
  updates their page lists. Scores are per page, so a page shared by requests has one score per key.

Policies (:class:`SnapKV`, :class:`H2O`, :class:`StreamingLLM`) combine them with kvpress's budgets.
The decode and prefill wrappers' ``run(..., kv_scores=...)`` accumulate H2O scores in the same call.

Host work: the functions read the page tables on the host (a synchronization) to size their outputs
and to check the pages; the ops underneath (``torch.ops.flashkern.kv_scores``, ``kv_select``,
``kv_compact``) take device tensors only and can be captured in a CUDA graph with fixed budgets.
"""

import numbers
from typing import NamedTuple

import torch

from . import _backend, _validate, ref
from ._paged_attention import check_kv_layout, kv_cache_views

_ops = torch.ops.flashkern


def _run(name, device, dtype, *args):
    """torch.ops.flashkern.<name>, or its reference directly where GPU tensors have no kernels (_backend) and
    for a float32 / float64 cache (models in full precision; the kernels take float16 and bfloat16)."""
    if _backend.use_reference(device) or dtype in (torch.float32, torch.float64):
        return _REFERENCE[name](*args)
    return getattr(_ops, name)(*args)


class PageTable(NamedTuple):
    """A paged KV layout after compaction: int32 tensors on the cache's device, and the pages that
    compaction left unused (host list; the caller frees them)."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    freed_pages: list


# ---- host views of a page table ----


def _host_table(op, kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages, writes=True):
    """Host int64 copies and each request's kv_len, with the checks the kernels cannot make: a CSR indptr,
    pages in [0, num_pages), last-page lengths in [1, page_size] for a request with pages, and (writes: the
    op writes the pages or their scores) no page twice."""
    for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("kv_last_page_len", kv_last_page_len)):
        _validate.check_tensor(op, name, t)
        if t.dtype != torch.int32 or t.dim() != 1:
            raise ValueError(f"{op}: {name} must be a 1-D int32 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    indptr, indices, last = kv_indptr.cpu().long(), kv_indices.cpu().long(), kv_last_page_len.cpu().long()
    batch = indptr.shape[0] - 1
    if batch < 0 or last.shape[0] != batch:
        raise ValueError(f"{op}: kv_indptr must have batch_size + 1 entries and kv_last_page_len batch_size, got "
                         f"{indptr.shape[0]} and {last.shape[0]}")
    pages = indptr[1:] - indptr[:-1]
    if batch and (indptr[0] != 0 or (pages < 0).any() or indptr[-1] > indices.shape[0]):
        raise ValueError(f"{op}: kv_indptr must start at 0, not decrease and end within kv_indices "
                         f"({indices.shape[0]} entries), got {indptr.tolist()}")
    used = indices[: int(indptr[-1])] if batch else indices[:0]
    if used.numel() and (used.min() < 0 or used.max() >= num_pages):
        raise ValueError(f"{op}: kv_indices must name pages in [0, {num_pages}), got {used.min()} .. {used.max()}")
    if writes and used.numel() != used.unique().numel():
        values, counts = used.unique(return_counts=True)
        raise ValueError(f"{op}: page {int(values[counts > 1][0])} appears twice in the page tables: compression "
                         f"writes each request's own pages (a page shared between requests, or listed twice, "
                         f"cannot be compressed in place)")
    with_pages = pages > 0
    if ((last < 1) | (last > page_size))[with_pages].any():
        raise ValueError(f"{op}: kv_last_page_len must be in [1, {page_size}] for a request with pages, got "
                         f"{last.tolist()}")
    kv_len = torch.where(with_pages, (pages - 1) * page_size + last, 0)
    if kv_len.numel() and kv_len.max() >= 2**30:  # the kernels' positions are 32-bit (attention_plan.h: kMaxKvLength)
        raise ValueError(f"{op}: a request holds {int(kv_len.max())} tokens; at most 2^30 - 1")
    return indptr, indices, kv_len


def _budgets(op, budget, kv_len):
    """Per-request numbers of keys to keep, at most each kv_len: an int or one per request."""
    batch = kv_len.shape[0]
    if isinstance(budget, torch.Tensor):
        if budget.dtype.is_floating_point or budget.dtype.is_complex or budget.dtype == torch.bool:
            raise TypeError(f"{op}: budget must be an int or one int per request (an integer tensor), got a "
                            f"{budget.dtype} tensor")
        budget = budget.cpu().long()
    elif isinstance(budget, int) and not isinstance(budget, bool):
        budget = torch.full((batch,), budget, dtype=torch.long)
    else:
        try:
            budget = torch.tensor(list(budget), dtype=torch.long)
        except (TypeError, ValueError):
            raise TypeError(f"{op}: budget must be an int or one int per request, got {budget!r}") from None
    if budget.shape != (batch,):
        raise ValueError(f"{op}: budget must be an int or {batch} ints (one per request), got shape {tuple(budget.shape)}")
    if (budget < 1).any():
        raise ValueError(f"{op}: a budget must be >= 1 (attention over no key is undefined), got {budget.tolist()}")
    return torch.minimum(budget, kv_len)


def _indptr(counts, device):
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32).to(device)


# ---- the primitives ----


def key_scores(q, lse, paged_kv_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, scores=None,
               kv_layout="NHD", sm_scale=None, causal=True, window_left=-1, logits_soft_cap=0.0, scale=1.0,
               accumulate=False):
    """Per-key attention scores of q's queries (see the module docstring). q ``[tokens, num_qo_heads, D]``:
    request b's queries are rows ``qo_indptr[b] .. qo_indptr[b + 1]``, its last tokens (causal: query i
    of n sits at position kv_len - n + i); lse ``[tokens, num_qo_heads]`` float32 from the attention run
    over the same cache (natural log; ``return_lse=True``). ``scores``: float32 ``[num_pages,
    num_kv_heads, page_size]`` to write or add into (None: a new zero tensor). Returns scores."""
    op = "key_scores"
    check_kv_layout(op, kv_layout)
    k_cache, _ = kv_cache_views(op, paged_kv_cache, kv_layout)
    num_pages, page_size, kv_heads = k_cache.shape[:3]
    _, _, kv_len = _host_table(op, kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages)
    _validate.check_tensor(op, "qo_indptr", qo_indptr)
    qo = qo_indptr.cpu().long()
    if qo.shape != (kv_len.shape[0] + 1,) or (kv_len.shape[0] and (qo[0] != 0 or (qo[1:] < qo[:-1]).any())):
        raise ValueError(f"{op}: qo_indptr must be a non-decreasing CSR indptr from 0 with batch_size + 1 entries")
    _validate.check_tensor(op, "q", q)
    if q.dim() != 3 or kv_len.shape[0] and qo[-1] != q.shape[0]:
        raise ValueError(f"{op}: q must be 3-D with qo_indptr[-1] rows, got shape {tuple(q.shape)}")
    if scores is None:
        scores = torch.zeros(num_pages, kv_heads, page_size, dtype=torch.float32, device=k_cache.device)
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    window_left = -1 if window_left is None else int(window_left)
    _run("kv_scores", q.device, k_cache.dtype, q, lse, k_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
         scores, int(kv_len.max()) if kv_len.numel() else 0, sm_scale, float(scale), bool(causal), window_left,
         float(logits_soft_cap or 0.0), bool(accumulate))
    return scores


def select_keys(scores, kv_indptr, kv_indices, kv_last_page_len, budget, window=0, keep_first=0, kernel_size=1):
    """The kept positions of each request: (kept ``[num_kept, num_kv_heads]`` int32, kept_indptr
    ``[batch + 1]`` int32), request b's rows ``kept_indptr[b] .. kept_indptr[b + 1]``, min(budget,
    kv_len) of them, ascending per head (see the module docstring)."""
    op = "select_keys"
    _validate.check_tensor(op, "scores", scores)
    if scores.dim() != 3:
        raise ValueError(f"{op}: scores must be [num_pages, num_kv_heads, page_size], got shape {tuple(scores.shape)}")
    _, _, kv_len = _host_table(op, kv_indptr, kv_indices, kv_last_page_len, scores.shape[2], scores.shape[0],
                               writes=False)
    for name, value in (("window", window), ("keep_first", keep_first), ("kernel_size", kernel_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{op}: {name} must be an int, got {value!r}")
    counts = _budgets(op, budget, kv_len)
    kept_indptr = _indptr(counts, scores.device)
    kept = _run("kv_select", scores.device, None, scores, kv_indptr, kv_indices, kv_last_page_len, kept_indptr,
                int(counts.sum()), window, keep_first, kernel_size)
    return kept, kept_indptr


def compact(paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kept, kept_indptr, kv_layout="NHD", scores=None,
            out_indptr=None, out_indices=None):
    """Move each request's kept keys and values (and scores) to positions 0, 1, ... of its own first pages
    (in place), or of the pages ``out_indices[out_indptr[b] ..]`` (pages no request reads; enough for
    the kept keys). Returns the new :class:`PageTable`; its freed_pages are the request's pages that the
    compacted cache no longer uses (in place) or all of its old pages (out_indices given)."""
    op = "compact"
    check_kv_layout(op, kv_layout)
    k_cache, v_cache = kv_cache_views(op, paged_kv_cache, kv_layout)
    num_pages, page_size = k_cache.shape[:2]
    indptr, indices, kv_len = _host_table(op, kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages,
                                          writes=out_indices is None)
    _validate.check_index(op, "kept_indptr", kept_indptr, k_cache, kv_len.shape[0] + 1)
    counts = kept_indptr.cpu().long().diff()
    if (counts < 0).any() or (counts > kv_len).any():
        raise ValueError(f"{op}: each request keeps 0 to kv_len keys, got {counts.tolist()} for kv_len {kv_len.tolist()}")
    _check_kept(op, kept, kept_indptr, kv_len, k_cache)
    need = (counts + page_size - 1) // page_size
    own_pages = [indices[indptr[b] : indptr[b + 1]] for b in range(kv_len.shape[0])]
    if out_indices is None:
        if out_indptr is not None:
            raise ValueError(f"{op}: out_indptr and out_indices come together")
        new_pages = [own_pages[b][: need[b]] for b in range(len(own_pages))]
        freed = torch.cat([own_pages[b][need[b] :] for b in range(len(own_pages))] or [indices[:0]]).tolist()
        out_indptr = _indptr(need, k_cache.device)
        out_indices = torch.cat(new_pages or [indices[:0]]).to(torch.int32).to(k_cache.device)
    else:
        _validate.check_index(op, "out_indptr", out_indptr, k_cache, kv_len.shape[0] + 1)
        _validate.check_index(op, "out_indices", out_indices, k_cache)
        o_ptr, o_idx = out_indptr.cpu().long(), out_indices.cpu().long()
        given = o_ptr.diff()
        if (given < need).any():
            raise ValueError(f"{op}: out_indices must give each request at least ceil(kept / page_size) pages: "
                             f"need {need.tolist()}, got {given.tolist()}")
        used = o_idx[int(o_ptr[0]) : int(o_ptr[-1])]  # (kv_indices may repeat a page: shared prefixes, read only)
        if used.numel() and (used.min() < 0 or used.max() >= num_pages):
            raise ValueError(f"{op}: out_indices must name pages in [0, {num_pages})")
        if used.numel() != used.unique().numel() or torch.isin(used, indices[: int(indptr[-1])]).any():
            raise ValueError(f"{op}: out_indices must be distinct pages that no request's page table holds (fresh "
                             f"pages); to compact in place, leave out_indptr and out_indices out")
        new_pages = [o_idx[o_ptr[b] : o_ptr[b] + need[b]] for b in range(len(own_pages))]
        freed = indices[: int(indptr[-1])].unique().tolist()
        out_indptr = _indptr(need, k_cache.device)
        out_indices = torch.cat(new_pages or [indices[:0]]).to(torch.int32).to(k_cache.device)
    if scores is not None:
        _validate.check_scores(op, scores, k_cache)
    _run("kv_compact", k_cache.device, k_cache.dtype, k_cache, v_cache, scores, kv_indptr, kv_indices, kept,
         kept_indptr, out_indptr, out_indices)
    last = torch.where(counts > 0, counts - (need - 1) * page_size, 0).to(torch.int32).to(k_cache.device)
    return PageTable(out_indptr, out_indices, last, freed)


def _check_kept(op, kept, kept_indptr, kv_len, k_cache):
    """Per request and head: kept positions strictly ascending in [0, kv_len), then only -1 (what compaction in
    place needs: a kept position never before its destination)."""
    _validate.check_tensor(op, "kept", kept)
    if kept.dtype != torch.int32 or kept.dim() != 2 or kept.shape[1] != k_cache.shape[2]:
        raise ValueError(f"{op}: kept must be int32 [num_kept, num_kv_heads], got {kept.dtype} {tuple(kept.shape)}")
    rows, ptr = kept.cpu().long(), kept_indptr.cpu().long()
    if rows.shape[0] != int(ptr[-1]):
        raise ValueError(f"{op}: kept has {rows.shape[0]} rows, kept_indptr ends at {int(ptr[-1])}")
    for b in range(kv_len.shape[0]):
        r = rows[ptr[b] : ptr[b + 1]]
        valid = r >= 0
        n = valid.sum(0)
        ok = (valid == (torch.arange(r.shape[0])[:, None] < n[None, :])).all() and (r[valid] < kv_len[b]).all()
        ok = ok and bool((torch.where(valid[1:] & valid[:-1], r[1:] - r[:-1], 1) > 0).all())
        if not ok:
            raise ValueError(f"{op}: request {b}'s kept positions must ascend strictly within [0, {int(kv_len[b])}) "
                             f"for every head, -1 only after them (as select_keys returns them)")


# ---- policies ----


def _budget_of(op, ratio, budget, kv_len):
    """kvpress's budget: int(kv_len * (1 - ratio)) keys (at least 1), or a fixed number of keys."""
    if (ratio is None) == (budget is None):
        raise ValueError(f"{op}: give exactly one of ratio and budget")
    if budget is not None:
        return _budgets(op, budget, kv_len)
    if not (isinstance(ratio, (int, float)) and 0 <= ratio < 1):
        raise ValueError(f"{op}: ratio (the fraction of keys removed) must be in [0, 1), got {ratio!r}")
    return torch.clamp((kv_len.double() * (1 - ratio)).long(), min=1)


class StreamingLLM:
    """Keep the first ``sinks`` keys (attention sinks) and the last ``window``; no scores."""

    def __init__(self, sinks=4, window=1020):
        for name, value in (("sinks", sinks), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"StreamingLLM: {name} must be an int, got {type(value).__name__} {value!r}")
        sinks, window = int(sinks), int(window)
        if sinks < 0 or window < 0 or sinks + window < 1:
            raise ValueError(f"StreamingLLM: sinks and window must be >= 0 with sinks + window >= 1, got {sinks}, "
                             f"{window}")
        self.sinks, self.window = sinks, window

    def compress(self, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout="NHD", scores=None):
        op = "StreamingLLM.compress"
        k_cache, _ = kv_cache_views(op, paged_kv_cache, kv_layout)
        _, _, kv_len = _host_table(op, kv_indptr, kv_indices, kv_last_page_len, k_cache.shape[1], k_cache.shape[0])
        kept = []
        for n in kv_len.tolist():
            keep = list(range(n)) if n <= self.sinks + self.window else \
                list(range(self.sinks)) + list(range(n - self.window, n))
            kept.append(torch.tensor(keep, dtype=torch.int32))
        counts = torch.tensor([len(k) for k in kept], dtype=torch.long)
        kept = torch.cat(kept or [torch.zeros(0, dtype=torch.int32)])[:, None].expand(-1, k_cache.shape[2])
        return compact(paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kept.contiguous().to(k_cache.device),
                       _indptr(counts, k_cache.device), kv_layout, scores)


class SnapKV:
    """SnapKV at prompt time: the last ``window`` queries of each prompt vote (their attention
    probabilities, averaged over the window and each GQA group), votes average-pooled along the keys
    (``kernel_size``), the window itself kept; ``ratio`` of the keys removed (kvpress's
    compression_ratio: int(kv_len * (1 - ratio)) kept, at least 1) or ``budget`` keys kept per request. A
    prompt no longer than the window is kept whole."""

    def __init__(self, ratio=None, budget=None, window=64, kernel_size=5, keep_first=0):
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"SnapKV: kernel_size must be odd and >= 1, got {kernel_size}")
        if window < 1:
            raise ValueError(f"SnapKV: window must be >= 1, got {window}")
        self.ratio, self.budget, self.window, self.kernel_size, self.keep_first = ratio, budget, window, kernel_size, \
            keep_first

    def scores(self, q, lse, qo_indptr, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout="NHD",
               sm_scale=None, logits_soft_cap=0.0):
        """The window's votes (un-pooled): q / lse of the prompts' tokens (rows qo_indptr[b] ..), of which
        each request's last ``window`` vote."""
        op = "SnapKV.scores"
        qo = qo_indptr.cpu().long()
        n = (qo[1:] - qo[:-1]).clamp(max=self.window)
        rows = torch.cat([torch.arange(int(qo[b + 1] - n[b]), int(qo[b + 1])) for b in range(n.shape[0])] or
                         [torch.zeros(0, dtype=torch.long)]).to(q.device)
        group = q.shape[1] // kv_cache_views(op, paged_kv_cache, kv_layout)[0].shape[2]
        return key_scores(q.index_select(0, rows), lse.index_select(0, rows).contiguous(), paged_kv_cache,
                          _indptr(n, q.device), kv_indptr, kv_indices, kv_last_page_len, None, kv_layout, sm_scale,
                          True, -1, logits_soft_cap, 1.0 / (self.window * group))

    def compress(self, q, lse, qo_indptr, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout="NHD",
                 sm_scale=None, logits_soft_cap=0.0):
        op = "SnapKV.compress"
        scores = self.scores(q, lse, qo_indptr, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout,
                             sm_scale, logits_soft_cap)
        _, _, kv_len = _host_table(op, kv_indptr, kv_indices, kv_last_page_len, scores.shape[2], scores.shape[0],
                               writes=False)
        budget = torch.where(kv_len <= self.window, kv_len, _budget_of(op, self.ratio, self.budget, kv_len))
        kept, kept_indptr = select_keys(scores, kv_indptr, kv_indices, kv_last_page_len, budget, self.window,
                                        self.keep_first, self.kernel_size)
        return compact(paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kept, kept_indptr, kv_layout)


class H2O:
    """Heavy hitters: keep the keys with the largest accumulated attention and the last ``recent`` keys
    (and ``keep_first`` sinks): ``heavy`` of them besides the recent ones, or, with ``ratio``, kvpress's
    budget int(kv_len * (1 - ratio)) in all. The scores are those the wrappers' ``run(...,
    kv_scores=scores)`` add up (decode), or :meth:`prompt_scores` (the prompt's own attention); they move
    with the keys, so accumulation goes on after compression. ``normalize=True`` divides a key's score
    by the number of prompt queries that see it (kvpress's ObservedAttentionPress)."""

    def __init__(self, heavy=None, recent=0, keep_first=0, ratio=None, normalize=False):
        if (heavy is None) == (ratio is None):
            raise ValueError("H2O: give exactly one of heavy and ratio")
        if recent < 0 or keep_first < 0 or (heavy is not None and (heavy < 0 or heavy + recent < 1)):
            raise ValueError(f"H2O: heavy, recent and keep_first must be >= 0 and keep at least one key, got "
                             f"{heavy}, {recent}, {keep_first}")
        self.heavy, self.recent, self.keep_first, self.ratio, self.normalize = heavy, recent, keep_first, ratio, \
            normalize

    def prompt_scores(self, q, lse, qo_indptr, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len,
                      kv_layout="NHD", sm_scale=None, logits_soft_cap=0.0):
        """The prompt's accumulated scores: every query of each prompt (rows qo_indptr[b] .., causal)."""
        scores = key_scores(q, lse, paged_kv_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, None,
                            kv_layout, sm_scale, True, -1, logits_soft_cap)
        if self.normalize:  # key j of a prompt of n is seen by its n - j queries
            op = "H2O.prompt_scores"
            _, page_size = scores.shape[1:]
            indptr, indices, kv_len = _host_table(op, kv_indptr, kv_indices, kv_last_page_len, page_size,
                                                  scores.shape[0])
            n = qo_indptr.cpu().long().diff()
            for b in range(kv_len.shape[0]):
                j = torch.arange(int(kv_len[b]))
                page, slot = indices[indptr[b] + j // page_size], j % page_size
                seen = (j - (kv_len[b] - n[b])).clamp(min=0)  # queries before key j's own
                count = (n[b] - seen).clamp(min=1).float().to(scores.device)
                scores[page.to(scores.device), :, slot.to(scores.device)] /= count[:, None]
        return scores

    def compress(self, scores, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout="NHD"):
        op = "H2O.compress"
        _, _, kv_len = _host_table(op, kv_indptr, kv_indices, kv_last_page_len, scores.shape[2], scores.shape[0],
                               writes=False)
        budget = _budget_of(op, self.ratio, None if self.ratio is not None else self.heavy + self.recent, kv_len)
        kept, kept_indptr = select_keys(scores, kv_indptr, kv_indices, kv_last_page_len, budget, self.recent,
                                        self.keep_first)
        return compact(paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kept, kept_indptr, kv_layout, scores)


# ---- CPU implementations and fake functions of the ops ----


@_backend.register_cpu("kv_scores")
def _kv_scores_cpu(q, lse, k_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, scores, max_kv_len, sm_scale,
                   scale, causal, window_left, logits_soft_cap, accumulate, logits=None):
    _validate.check_kv_scores(q, lse, k_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, scores, max_kv_len,
                              sm_scale, scale, window_left, logits_soft_cap, reference=True, logits=logits)
    ref.kv_compress.kv_scores(q, lse, k_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, scores, sm_scale,
                              scale, causal, window_left, logits_soft_cap, accumulate, logits)


@torch.library.register_fake("flashkern::kv_scores")
def _kv_scores_fake(q, lse, k_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, scores, max_kv_len, sm_scale,
                    scale, causal, window_left, logits_soft_cap, accumulate, logits=None):
    _validate.check_kv_scores(q, lse, k_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, scores, max_kv_len,
                              sm_scale, scale, window_left, logits_soft_cap, addresses=False, reference=True,
                              logits=logits)


@_backend.register_cpu("kv_select")
def _kv_select_cpu(scores, kv_indptr, kv_indices, kv_last_page_len, kept_indptr, num_kept, window, keep_first,
                   kernel_size):
    _validate.check_kv_select(scores, kv_indptr, kv_indices, kv_last_page_len, kept_indptr, num_kept, window,
                              keep_first, kernel_size)
    return ref.kv_compress.kv_select(scores, kv_indptr, kv_indices, kv_last_page_len, kept_indptr, num_kept, window,
                                     keep_first, kernel_size)


@torch.library.register_fake("flashkern::kv_select")
def _kv_select_fake(scores, kv_indptr, kv_indices, kv_last_page_len, kept_indptr, num_kept, window, keep_first,
                    kernel_size):
    _validate.check_kv_select(scores, kv_indptr, kv_indices, kv_last_page_len, kept_indptr, num_kept, window,
                              keep_first, kernel_size)
    return scores.new_empty(num_kept, scores.shape[1], dtype=torch.int32)


@_backend.register_cpu("kv_compact")
def _kv_compact_cpu(k_cache, v_cache, scores, kv_indptr, kv_indices, kept, kept_indptr, out_indptr, out_indices):
    _validate.check_kv_compact(k_cache, v_cache, scores, kv_indptr, kv_indices, kept, kept_indptr, out_indptr,
                               out_indices, reference=True)
    ref.kv_compress.kv_compact(k_cache, v_cache, scores, kv_indptr, kv_indices, kept, kept_indptr, out_indptr,
                               out_indices)


@torch.library.register_fake("flashkern::kv_compact")
def _kv_compact_fake(k_cache, v_cache, scores, kv_indptr, kv_indices, kept, kept_indptr, out_indptr, out_indices):
    _validate.check_kv_compact(k_cache, v_cache, scores, kv_indptr, kv_indices, kept, kept_indptr, out_indptr,
                               out_indices, addresses=False, reference=True)


_REFERENCE = {"kv_scores": _kv_scores_cpu, "kv_select": _kv_select_cpu, "kv_compact": _kv_compact_cpu}

__all__ = ["H2O", "PageTable", "SnapKV", "StreamingLLM", "compact", "key_scores", "select_keys"]
