"""Attention over a paged KV cache: the plan/run machinery behind the decode and cascade wrappers,
and the op they launch, torch.ops.flashkern.batch_attention (its CPU implementation and fake).

plan() does every host step once per batch: it checks the page tables, lets the C++ planner
(csrc/include/flashkern/attention_plan.h) split the KV into work items and writes that plan into
the caller's workspace. run() checks shapes and launches, nothing else: no host synchronization,
no allocation outside torch, so it can be captured in a CUDA graph (a replay runs whatever plan()
wrote last) and traced by torch.compile.
Order in this file: the shared wrapper base, CPU reference registration, fake function.
"""

import itertools
import math

import torch

from . import _C, _backend, ref
from .invariance import INVARIANT_CHUNK
from ._validate import (
    ATTENTION_DTYPES,
    ATTENTION_HEAD_DIMS,
    FP8_DTYPES,
    MIN_SOFT_CAP,
    check_aligned,
    check_batch_attention,
    check_head_dim,
    check_kv_scale_number,
    check_kv_scale_values,
    check_kv_scores,
    check_positive_int,
    check_tensor,
    nan_where_bad,
)

_ops = torch.ops.flashkern

MIN_CHUNK = 256  # tokens: split-KV never cuts a sequence finer
MAX_KV_LENGTH = 1 << 30  # attention_plan.h: kMaxKvLength
CPU_CTA_BUDGET = 16  # the CPU runs plans through the reference; a small budget still splits long sequences
ALL_KINDS = {0, 1, 2}  # attention_work.h: AttentionKind (decode, tile16, tile64)


def kv_cache_views(op, paged_kv_cache, kv_layout):
    """(k_cache, v_cache) as [pages, page_size, num_kv_heads, head_dim] views (no copy) of a 5-D
    paged cache [pages, 2, page_size, heads, D] (NHD) / [pages, 2, heads, page_size, D] (HND) or of a
    (k_cache, v_cache) tuple of 4-D tensors in that layout."""
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"{op}: paged_kv_cache must be a tensor or a (k_cache, v_cache) pair")
        k, v = paged_kv_cache
        check_tensor(op, "k_cache", k)
        check_tensor(op, "v_cache", v)
        if k.dim() != 4 or v.shape != k.shape:
            raise ValueError(
                f"{op}: k_cache and v_cache must be 4-D of one shape, got {tuple(k.shape)} and {tuple(v.shape)}"
            )
    else:
        check_tensor(op, "paged_kv_cache", paged_kv_cache)
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            layout = "[pages, 2, page_size, num_kv_heads, head_dim]" if kv_layout == "NHD" else \
                "[pages, 2, num_kv_heads, page_size, head_dim]"
            raise ValueError(f"{op}: paged_kv_cache must be 5-D {layout} ({kv_layout}), got shape "
                             f"{tuple(paged_kv_cache.shape)}")
        k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    if kv_layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v


def check_window_left(op, window_left):
    """window_left: an int, -1 (no window) or the tokens before the query's own that it also sees."""
    if isinstance(window_left, bool) or not isinstance(window_left, int) or window_left < -1:
        raise ValueError(f"{op}: window_left must be an int >= -1 (-1: no window), got {window_left!r}")


def host_indptr(op, name, indptr):
    """A CSR indptr [batch + 1] (any device) as a host int32 tensor, and the batch size."""
    check_tensor(op, name, indptr)
    if indptr.dim() != 1 or indptr.shape[0] < 1:
        raise ValueError(f"{op}: {name} must be 1-D with batch_size + 1 entries, got shape {tuple(indptr.shape)}")
    return host_int32(op, name, indptr), indptr.shape[0] - 1


def split_length(op, fixed_split_size, disable_split_kv, page_size):
    """FlashInfer's split options as the planner's chunk length: None (the device's choice),
    MAX_KV_LENGTH (disable_split_kv: no split) or fixed_split_size pages' tokens."""
    if disable_split_kv not in (False, True):
        raise TypeError(f"{op}: disable_split_kv must be a bool, got {disable_split_kv!r}")
    if disable_split_kv:
        return MAX_KV_LENGTH
    if fixed_split_size is None:
        return None
    check_positive_int(op, "fixed_split_size", fixed_split_size, " (pages)")
    return min(fixed_split_size * page_size, MAX_KV_LENGTH)


def single_request_kv(op, q, k, v, kv_layout, q_shape):
    """The single-request functions' q, k, v checked (q of rank len(q_shape), named so in messages;
    k and v [kv_len, kv_heads, D] NHD or [kv_heads, kv_len, D] HND, q's head_dim, dtype and device):
    k and v as NHD views."""
    check_kv_layout(op, kv_layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(op, name, t)
    if q.dim() != len(q_shape):
        raise ValueError(f"{op}: q must be {len(q_shape)}-D [{', '.join(q_shape)}], got shape {tuple(q.shape)}")
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"{op}: k and v must be 3-D of one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if kv_layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    if k.shape[2] != q.shape[-1]:
        raise ValueError(f"{op}: k and v must have q's head_dim {q.shape[-1]}, got {k.shape[2]}")
    fp8 = k.dtype in FP8_DTYPES and q.dtype in ATTENTION_DTYPES  # an fp8 cache under a 16-bit q
    if not (k.dtype == q.dtype or fp8) or v.dtype != k.dtype:
        raise TypeError(f"{op}: k and v must have q's dtype {q.dtype} (or one fp8 dtype under a float16 / bfloat16 q), "
                        f"got {k.dtype} and {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"{op}: k and v must be on q's device {q.device}, got {k.device} and {v.device}")
    return k, v


def check_kv_layout(op, kv_layout):
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"{op}: kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")


FP8_NAMES = tuple(str(t).removeprefix("torch.") for t in FP8_DTYPES)


def attention_dtype(op, name, value, default=None):
    """q_data_type / kv_data_type: a torch dtype or its name ("float16", "bfloat16"); kv_data_type may
    also be an fp8 dtype ("float8_e4m3fn", "float8_e5m2", AMD's "float8_e4m3fnuz", "float8_e5m2fnuz")."""
    if value is None:
        return default
    allowed = ATTENTION_DTYPES + (FP8_DTYPES if name == "kv_data_type" else ())
    if isinstance(value, str):
        value = getattr(torch, value, None) if value in ("float16", "bfloat16", "half") + FP8_NAMES else value
    if value not in allowed:
        fp8 = ", or an fp8 dtype (torch.float8_e4m3fn, torch.float8_e5m2, or AMD's fnuz ones)" \
            if name == "kv_data_type" else ""
        raise TypeError(f"{op}: {name} must be torch.float16 or torch.bfloat16{fp8}, got {value!r}")
    return value


def kv_scale_arg(op, name, value, kv_dtype, num_kv_heads, device):
    """FlashInfer's k_scale / v_scale as (a number, a [num_kv_heads] float32 tensor or None): None (1), a
    number > 0 finite in float32 (folded into sm_scale / the output by the caller), or, for an fp8 cache, a
    float tensor of 1 or num_kv_heads elements on the cache's device (read by the kernels: no host sync).
    A tensor's values: checked here where it is on the CPU; on a GPU a scale that is not a positive finite
    number becomes NaN on the device (no host sync), so the rows of its head come out NaN."""
    if value is None:
        return 1.0, None
    if not isinstance(value, torch.Tensor):
        return check_kv_scale_number(op, name, value), None
    if kv_dtype not in FP8_DTYPES:
        raise ValueError(f"{op}: {name} as a tensor needs an fp8 kv_data_type (a 16-bit cache takes a number), "
                         f"got a tensor with a {kv_dtype} cache")
    if not value.is_floating_point() or value.numel() not in (1, num_kv_heads) or value.dim() > 1 or \
            value.device != device:
        raise ValueError(f"{op}: {name} must be a number or a floating tensor of 1 or num_kv_heads ({num_kv_heads}) "
                         f"elements on {device}, got {value.dtype} of shape {tuple(value.shape)} on {value.device}")
    check_kv_scale_values(op, name, value)
    return 1.0, nan_where_bad(value.to(torch.float32).reshape(-1).expand(num_kv_heads)).contiguous()


def reject_unsupported(op, **options):
    """FlashInfer options flashkern accepts only at their defaults (the kernels do not implement them)."""
    defaults = {"pos_encoding_mode": "NONE", "window_left": -1, "window_right": 0, "logits_soft_cap": None,
                "rope_scale": None, "rope_theta": None, "causal": False, "q_scale": None, "k_scale": None,
                "v_scale": None, "q_len_per_req": 1, "block_tables": None, "seq_lens": None, "sinks": None,
                "skip_softmax_threshold_scale_factor": None, "kv_cache_sf": None, "jit_args": None}
    for name, value in options.items():
        default = defaults[name]
        if default is None and (value is None or (name == "logits_soft_cap" and value == 0.0)):
            continue
        if default is not None and not isinstance(value, torch.Tensor) and value == default:
            continue
        given = f"{name} (a {type(value).__name__})" if isinstance(value, (torch.Tensor, tuple, list)) else \
            f"{name}={value!r}"
        raise ValueError(f"{op}: {given} is not supported by flashkern (only {default!r})")


def check_buffer(op, name, buffer, device):
    """A caller's fixed page-table buffer for CUDA graphs."""
    check_tensor(op, name, buffer)
    if buffer.dtype != torch.int32 or buffer.dim() != 1 or buffer.device != device or not buffer.is_contiguous():
        raise ValueError(f"{op}: {name} must be a contiguous 1-D int32 tensor on {device}")


def fill_buffer(op, name, buffer, values):
    """Copies a page-table array into the front of its fixed buffer (asynchronously, in stream order)."""
    if values.shape[0] > buffer.shape[0]:
        raise ValueError(f"{op}: {values.shape[0]} entries do not fit {name} ({buffer.shape[0]})")
    buffer[: values.shape[0]].copy_(values, non_blocking=True)


def host_int32(op, name, t, length=None):
    """A page-table argument: a 1-D int32 tensor (of `length` entries), as a contiguous CPU tensor."""
    check_tensor(op, name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{op}: {name} must be int32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{op}: {name} must be 1-D, got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{op}: {name} must have {length} entries, got {t.shape[0]}")
    if t.device.type == "meta":
        raise ValueError(f"{op}: {name} is on the meta device; plan() reads the page tables' values")
    return t.to("cpu").contiguous()  # a device tensor costs one synchronization here, in plan()


def csr_page_table(op, indptr, indices, last_page_len, block_tables, seq_lens, page_size):
    """FlashInfer's fixed-width page table, seq_lens [batch] and block_tables [batch, max_pages]
    (request b's pages: the first ceil(seq_lens[b] / page_size) entries of row b), as the CSR
    (indptr, indices, last_page_len) the planner takes, on the host. The CSR may be None when both
    are given; where both forms are given they must describe the same pages. page_size: checked."""
    given = (indptr, indices, last_page_len)
    csr = None
    if any(t is not None for t in given):
        if any(t is None for t in given):
            raise ValueError(f"{op}: give indptr, indices and last_page_len together (or all None with block_tables "
                             "and seq_lens)")
        indptr_h = host_int32(op, "indptr", indptr)
        if indptr_h.shape[0] < 1:
            raise ValueError(f"{op}: indptr must have batch_size + 1 entries")
        last_h = host_int32(op, "last_page_len", last_page_len, indptr_h.shape[0] - 1)
        indices_h = host_int32(op, "indices", indices)
        pages = indptr_h[1:] - indptr_h[:-1]
        if int(indptr_h[0]) < 0 or bool((pages < 0).any()) or int(indptr_h[-1]) > indices_h.shape[0]:
            raise ValueError(f"{op}: indptr must be non-decreasing, within the {indices_h.shape[0]} entries of indices")
        lengths = torch.where(pages > 0, (pages - 1) * page_size + last_h, 0).long()
        csr = (lengths, indices_h[int(indptr_h[0]) : int(indptr_h[-1])])
    if seq_lens is None:
        if csr is None:
            raise ValueError(f"{op}: block_tables needs seq_lens (or the CSR page table)")
        lengths = csr[0]
    else:
        check_tensor(op, "seq_lens", seq_lens)
        if seq_lens.dtype.is_floating_point or seq_lens.dtype.is_complex or seq_lens.dtype == torch.bool or \
                seq_lens.dim() != 1:
            raise ValueError(f"{op}: seq_lens must be a 1-D integer tensor, got {seq_lens.dtype} of shape "
                             f"{tuple(seq_lens.shape)}")
        lengths = seq_lens.to("cpu", torch.int64)
        if lengths.numel() and int(lengths.min()) < 0:
            raise ValueError(f"{op}: seq_lens must be >= 0, got {int(lengths.min())}")
        if csr is not None and not torch.equal(lengths, csr[0]):
            raise ValueError(f"{op}: seq_lens {lengths.tolist()} differ from the lengths of the CSR page table "
                             f"{csr[0].tolist()}")
    n_pages = (lengths + page_size - 1) // page_size
    if block_tables is None:
        if csr is None:
            raise ValueError(f"{op}: seq_lens needs block_tables (or the CSR page table)")
        return indptr, indices, last_page_len
    check_tensor(op, "block_tables", block_tables)
    most = int(n_pages.max()) if n_pages.numel() else 0
    if block_tables.dtype.is_floating_point or block_tables.dtype == torch.bool or block_tables.dim() != 2 or \
            block_tables.shape[0] != lengths.shape[0] or block_tables.shape[1] < most:
        raise ValueError(f"{op}: block_tables must be a 2-D integer tensor [batch={lengths.shape[0]}, max_pages >= "
                         f"{most}], got {block_tables.dtype} of shape {tuple(block_tables.shape)}")
    table = block_tables.to("cpu", torch.int64)
    in_use = torch.arange(table.shape[1])[None, :] < n_pages[:, None]
    new_indices = table[in_use].to(torch.int32)
    new_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), n_pages.cumsum(0)]).to(torch.int32)
    new_last = torch.where(n_pages > 0, lengths - (n_pages - 1) * page_size, 0).to(torch.int32)
    if csr is not None and not torch.equal(new_indices, csr[1].to(torch.int32)):
        raise ValueError(f"{op}: block_tables names other pages than indices (the CSR page table)")
    return new_indptr, new_indices, new_last


# The plan each workspace holds (by the address it starts at): a wrapper's run() checks that it is still its
# own, since two wrappers may be given one buffer and the plan lives in it.
_WORKSPACE_PLANS = {}
_plan_numbers = itertools.count(1)


class PagedAttention:
    """What the wrappers share: the workspace, the plan in it, and run()."""

    def __init__(self, op, workspace_buffer, kv_layout, use_cuda_graph):
        self.reset_workspace(op, workspace_buffer)
        check_kv_layout(op, kv_layout)
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        self._plan_info = None
        self._num_pages = None  # the cache size run() last saw: graph replays keep using that cache
        self._graph_scores = None  # under CUDA graphs, once a run had kv_scores: (batch, qo tensor it reads)
        self._cta_budget = self.cta_budget(self._device)
        self._min_chunk = MIN_CHUNK

    def reset_workspace(self, op, workspace_buffer):
        """A new workspace: any contiguous 1-D tensor of 1-byte elements (uint8, int8, ...), as
        FlashInfer takes, used as bytes. The plan lives in it, so plan() must run again."""
        check_tensor(op, "workspace_buffer", workspace_buffer)
        if workspace_buffer.element_size() != 1 or workspace_buffer.dim() != 1 or not workspace_buffer.is_contiguous():
            raise ValueError(
                f"{op}: workspace_buffer must be a contiguous 1-D tensor of 1-byte elements (uint8 or int8), got "
                f"{workspace_buffer.dtype} of shape {tuple(workspace_buffer.shape)}"
            )
        check_aligned(op, "workspace_buffer", workspace_buffer, 16)
        if getattr(self, "_device", workspace_buffer.device) != workspace_buffer.device:
            raise ValueError(f"{op}: workspace_buffer must stay on {self._device}, got {workspace_buffer.device}")
        self._workspace = workspace_buffer.view(torch.uint8)
        self._device = workspace_buffer.device
        self._workspace_key = (str(self._device), workspace_buffer.data_ptr())
        self._plan_info = None

    @staticmethod
    def cta_budget(device):
        """Blocks split-KV aims to fill: two per multiprocessor (the kernels' occupancy)."""
        if device.type == "cuda":
            return 2 * torch.cuda.get_device_properties(device).multi_processor_count
        return CPU_CTA_BUDGET

    @property
    def is_cuda_graph_enabled(self):
        return self._use_cuda_graph

    def _plan(self, op, levels, device_indices, batch, num_qo_heads, num_kv_heads, head_dim, page_size, sm_scale,
              q_dtype, kv_dtype, names, indexed, possible_kinds, split_tokens=None, o_dtype=None, causal=False,
              window_left=-1, logits_soft_cap=None, custom_mask=None, identity=False, dry_run=False,
              graph_tables=None, batch_invariant=False):
        """levels: [(qo_indptr or None, kv_indptr, kv_indices, kv_last_page_len)] as CPU int32 tensors,
        shape-checked; device_indices: each level's kv_indices where the kernels will read them;
        batch: the number of queries. The last level's groups may be causal (each group's queries
        are its last tokens, each seeing the tokens up to itself), have a sliding window
        (window_left >= 0) or custom masks (custom_mask: the packed bits on the device, checked by
        the caller); identity: its kv_indices is the identity (ragged KV, a page per token; not
        read). Checks the rest, plans, and writes the plan into the workspace; dry_run: returns
        the workspace bytes the plan needs (at its preferred split) instead. graph_tables: under CUDA graphs,
        the fixed buffers the plan filled, (qo_indptr or None, kv_indptr, kv_last_page_len), for kv_scores.
        batch_invariant: a batch-invariant plan (flashkern.invariance): its chunk is split_tokens, or
        INVARIANT_CHUNK when that is None."""
        check_head_dim(op, head_dim, ATTENTION_HEAD_DIMS)
        for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("page_size", page_size)):
            check_positive_int(op, name, value)
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"{op}: num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if kv_dtype != q_dtype and kv_dtype not in FP8_DTYPES:
            raise TypeError(f"{op}: kv_data_type must equal q_data_type ({q_dtype}) or be an fp8 dtype, got {kv_dtype}")
        sm_scale = float(head_dim) ** -0.5 if sm_scale is None else float(sm_scale)
        logits_soft_cap = soft_cap_value(op, logits_soft_cap)
        check_window_left(op, window_left)
        max_page = -1
        for i, (_, kv_indptr, indices, _) in enumerate(levels):
            if identity and i == len(levels) - 1:
                max_page = max(max_page, int(kv_indptr[-1]) - 1)
            elif indices.numel():
                lo, hi = int(indices.min()), int(indices.max())
                if lo < 0:
                    raise ValueError(f"{op}: {names[2]}{f'[{i}]' if indexed else ''} holds a negative page index {lo}")
                max_page = max(max_page, hi)
        if self._use_cuda_graph and self._num_pages is not None and max_page >= self._num_pages:
            raise ValueError(f"{op}: page index {max_page} is outside the {self._num_pages}-page cache the graph runs on")
        if self._graph_scores is not None and not dry_run:  # a captured kv_scores replays on this plan's tables
            kv_indptr, indices = levels[-1][1], levels[-1][2]
            if len(levels) != 1 or kv_indptr.shape[0] - 1 != self._graph_scores[0] or custom_mask is not None:
                raise ValueError(f"{op}: a CUDA graph of this wrapper scores keys (kv_scores): its plans must keep "
                                 f"one level of {self._graph_scores[0]} requests without a custom mask")
            check_distinct_pages(op, kv_indptr, indices)

        layout = _C.workspace_layout(self._workspace.numel(), batch, num_qo_heads, head_dim)
        int_words, item_capacity, slot_capacity = layout[:3]
        payload = torch.empty(int_words, dtype=torch.int32, pin_memory=self._device.type == "cuda")
        plan_levels = [
            (qo.data_ptr() if qo is not None else 0, kv.data_ptr(), last.data_ptr(), kv.shape[0] - 1,
             int(kv[-1]) if identity and i == len(levels) - 1 else indices.shape[0],
             *((causal, window_left, custom_mask is not None, identity) if i == len(levels) - 1 else
               (False, -1, False, False)))
            for i, (qo, kv, indices, last) in enumerate(levels)
        ]
        # split_tokens: a fixed chunk length (one block of work per that many tokens, however many
        # blocks the device has), or MAX_KV_LENGTH for no split at all; a batch-invariant plan always has
        # a fixed chunk, and is given the device's budget too, which its planner must not use
        if batch_invariant:
            budget, min_chunk = self._cta_budget, INVARIANT_CHUNK if split_tokens is None else split_tokens
        else:
            budget, min_chunk = (self._cta_budget, self._min_chunk) if split_tokens is None else (1 << 40, split_tokens)
        if dry_run:  # room for every item and state: the split the device asks for, never grown to fit
            _, counts, slots, _, _ = _C.plan_attention(
                plan_levels, batch, page_size, num_qo_heads // num_kv_heads, num_kv_heads, head_dim, budget, min_chunk,
                1 << 40, 1 << 40, names, indexed, 0, 0, batch_invariant)
            return _C.workspace_bytes(slots, batch, num_qo_heads, head_dim)  # items: room per slot and query (items_per_state)
        words, counts, slots, chunk, needs_merge = _C.plan_attention(
            plan_levels, batch, page_size, num_qo_heads // num_kv_heads, num_kv_heads, head_dim, budget, min_chunk,
            item_capacity, slot_capacity, names, indexed, payload.data_ptr(), int_words, batch_invariant)
        self._workspace[: 4 * words].view(torch.int32).copy_(payload[:words], non_blocking=True)
        self._plan_number = _WORKSPACE_PLANS[self._workspace_key] = next(_plan_numbers)
        if self._use_cuda_graph:  # the captured launch must not depend on the plan
            kinds = possible_kinds if head_dim <= _C.MAX_WIDE_HEAD_DIM else {1}  # wider: 16-row tiles only
            grid = [self._cta_budget if k in kinds else 0 for k in range(3)] + [1]
        else:
            grid = [min(c, 1 << 20) for c in counts] + [int(needs_merge)]
        self._plan_info = {
            "batch": batch, "num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
            "page_size": page_size, "dtype": q_dtype, "kv_dtype": kv_dtype, "o_dtype": o_dtype or q_dtype, "sm_scale": sm_scale,
            "grid": grid, "max_page": max_page, "logits_soft_cap": logits_soft_cap, "custom_mask": custom_mask,
            "window_left": window_left, "causal": causal,
            # one paged level, no custom mask: what kv_scores (H2O's running scores) can follow; the host
            # page table, and its device copies once a run asks for them
            "score_tables": (levels[0], device_indices[0], graph_tables)
            if len(levels) == 1 and not identity and custom_mask is None else None,
            "kv_indices": list(device_indices), "counts": counts, "slots": slots, "chunk": chunk, "words": words,
            "batch_invariant": batch_invariant,
        }

    def check_window(self, op, window_left):
        """run()'s window_left: None or the planned value (the window is part of the plan)."""
        planned = self._plan_info["window_left"] if self._plan_info else -1
        if window_left is not None and window_left != planned:
            raise ValueError(f"{op}: window_left={window_left!r} differs from the plan's {planned}; plan again with it")

    def _run(self, op, q, paged_kv_cache, out, lse, sinks=None, q_scale=None, k_scale=None, v_scale=None,
             sm_scale=None, pdl=False, logits_soft_cap=None, kv_layout=None, kv_scores=None, o_scale=None):
        """The planned attention of q (and FlashInfer's run() options: sinks [num_qo_heads], one sink
        logit per head; q_scale and k_scale multiply sm_scale, v_scale and o_scale the output; sm_scale and
        logits_soft_cap, if given, replace the plan's) into out / lse; kv_scores: H2O's running scores
        (flashkern.kv_compress), to which each query's attention probabilities are added. Every check,
        the score step's included, comes before the first write to out, lse or kv_scores."""
        info = self._plan_info
        if info is None:
            raise RuntimeError(f"{op}: call plan() before run()")
        if not torch.compiler.is_compiling() and _WORKSPACE_PLANS.get(self._workspace_key) != self._plan_number:
            raise ValueError(f"{op}: another wrapper planned into this workspace_buffer after this wrapper's plan(); "
                             "wrappers that share a workspace must each plan() again before their run() (or use a "
                             "workspace each)")
        check_tensor(op, "q", q)
        expected = (info["batch"], info["num_qo_heads"], info["head_dim"])
        if tuple(q.shape) != expected:
            raise ValueError(f"{op}: q must have the planned shape {expected}, got {tuple(q.shape)}")
        if q.dtype != info["dtype"]:
            raise TypeError(f"{op}: q must have the planned q_data_type {info['dtype']}, got {q.dtype}")
        if q.device != self._device:
            raise ValueError(f"{op}: q is on {q.device} but the workspace is on {self._device}")
        k, v = kv_cache_views(op, paged_kv_cache, kv_layout or self._kv_layout)
        planned = (info["page_size"], info["num_kv_heads"], info["head_dim"])
        if tuple(k.shape[1:]) != planned:
            raise ValueError(f"{op}: paged_kv_cache has (page_size, num_kv_heads, head_dim) = {tuple(k.shape[1:])}, "
                             f"the plan has {planned} ({self._kv_layout} layout)")
        if k.dtype != info["kv_dtype"]:
            raise TypeError(f"{op}: paged_kv_cache must have the planned kv_data_type {info['kv_dtype']}, got {k.dtype}")
        if info["max_page"] >= k.shape[0]:
            raise ValueError(f"{op}: the page tables hold page index {info['max_page']}, but paged_kv_cache has "
                             f"{k.shape[0]} pages")
        self._num_pages = k.shape[0]
        sm_scale = info["sm_scale"] if sm_scale is None else scale_factor(op, "sm_scale", sm_scale)
        k_factor, k_scales = kv_scale_arg(op, "k_scale", k_scale, k.dtype, k.shape[2], k.device)
        out_scale, v_scales = kv_scale_arg(op, "v_scale", v_scale, k.dtype, k.shape[2], k.device)
        sm_scale *= scale_factor(op, "q_scale", q_scale) * k_factor
        out_scale *= scale_factor(op, "o_scale", o_scale)
        sinks = sink_logits(op, sinks, info["num_qo_heads"], q.device)
        out = torch.empty(q.shape, dtype=info["o_dtype"], device=q.device) if out is None else out
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if lse is None else lse
        for name, t in (("out", out), ("lse", lse)):
            check_tensor(op, name, t)
        if out.dtype != info["o_dtype"]:
            raise TypeError(f"{op}: out must have the planned o_data_type {info['o_dtype']}, got {out.dtype}")
        cap = info["logits_soft_cap"] if logits_soft_cap is None else soft_cap_value(op, logits_soft_cap)
        if kv_scores is not None:  # before any work: the scoring kernels read 16-bit caches, head_dim <= 256
            if k.dtype in FP8_DTYPES:
                raise ValueError(f"{op}: kv_scores (H2O) reads a 16-bit cache; this one is {k.dtype}")
            check_head_dim(f"{op}: kv_scores (H2O)", info["head_dim"])
        score_tables = None if kv_scores is None else self._score_tables(op, kv_scores)
        logits, score_args = None, None
        if score_tables is not None:
            qo, kv_indptr, indices, last, max_kv_len = score_tables
            if self._scores_from_logits(k, max_kv_len):
                logits = torch.empty(*q.shape[:2], max_kv_len, dtype=torch.float32, device=q.device)
            score_args = (q, lse, k, qo, kv_indptr, indices, last, kv_scores, max_kv_len, sm_scale, 1.0,
                          info["causal"], info["window_left"], cap, True, logits)
            check_score_args(op, score_args)
        args = (q, k, v, info["kv_indices"], self._workspace, out, lse, info["grid"], sm_scale, sinks, out_scale, pdl,
                info["custom_mask"], cap, logits, k_scales, v_scales)
        if _backend.use_reference(q.device):
            _batch_attention_cpu(*args)
        else:
            _ops.batch_attention(*args)
        if score_args is not None:
            if _backend.use_reference(q.device):
                from .kv_compress import _kv_scores_cpu
                _kv_scores_cpu(*score_args)
            else:
                _ops.kv_scores(*score_args)
        return out, lse

    def _scores_from_logits(self, k_cache, max_kv_len):
        """Whether kv_scores reads the attention kernels' logits (their epilogue) rather than q and K again:
        when no 64-row tile runs (they write none) and the logits take no more bytes than K (decode: 4 bytes
        a query head and key against 2 * head_dim a KV head and key); never under CUDA graphs (the logits
        follow the longest request)."""
        info = self._plan_info
        kv_tokens = int(info["score_tables"][0][1][-1]) * info["page_size"]  # an upper bound: whole pages
        logit_bytes = 4 * info["batch"] * info["num_qo_heads"] * max_kv_len
        return not self._use_cuda_graph and info["grid"][2] == 0 and \
            logit_bytes <= kv_tokens * info["num_kv_heads"] * info["head_dim"] * k_cache.element_size()

    def _score_tables(self, op, scores):
        """kv_scores' page tables on the device (the step's own keys start from 0, the earlier ones add):
        (qo_indptr, kv_indptr, kv_indices, kv_last_page_len, max_kv_len), made once a plan. Under CUDA
        graphs: the fixed buffers, and max_kv_len their capacity (the score kernel loops over a request's
        keys, so its grid does not follow the plan)."""
        info = self._plan_info
        if info["score_tables"] is None:
            raise ValueError(f"{op}: kv_scores needs a paged plan of one level without a custom mask")
        if not isinstance(scores, torch.Tensor):
            raise TypeError(f"{op}: kv_scores must be a torch.Tensor, got {type(scores).__name__}")
        tables = info.get("score_device")
        if tables is None:
            (qo, kv_indptr, indices, last), device_indices, graph_tables = info["score_tables"]
            batch = kv_indptr.shape[0] - 1
            check_distinct_pages(op, kv_indptr, indices)
            qo = torch.arange(batch + 1, dtype=torch.int32) * (info["batch"] // max(batch, 1)) if qo is None else qo
            device = self._device
            if self._use_cuda_graph:
                qo_buf, kv_indptr_buf, last_buf = graph_tables
                if kv_indptr_buf.shape[0] != batch + 1 or last_buf.shape[0] != batch or \
                        qo_buf is not None and qo_buf.shape[0] != batch + 1:
                    raise ValueError(f"{op}: kv_scores under CUDA graphs needs page-table buffers of exactly the "
                                     f"plan's {batch} requests (indptr buffers of {batch + 1} entries)")
                if qo_buf is None:  # decode: one tensor, as fixed as its batch and queries per request
                    qo_buf = qo.to(device) if self._graph_scores is None else self._graph_scores[1]
                    if not torch.equal(qo_buf.cpu(), qo):
                        raise ValueError(f"{op}: under CUDA graphs the queries per request are fixed")
                self._graph_scores = (batch, qo_buf)
                capacity = min(device_indices.shape[0] * info["page_size"], MAX_KV_LENGTH)
                tables = (qo_buf, kv_indptr_buf, device_indices, last_buf, capacity)
            else:
                pages = kv_indptr[1:] - kv_indptr[:-1]
                kv_len = torch.where(pages > 0, (pages - 1) * info["page_size"] + last, 0)
                tables = (qo.to(device), kv_indptr.to(device), device_indices, last.to(device),
                          int(kv_len.max()) if batch else 0)
            info["score_device"] = tables
        return tables


def check_score_args(op, args):
    """The score step's checks (the kv_scores op's own) before the attention writes anything: a bad kv_scores
    (dtype, shape, layout, device) or lse raises with out, lse and the scores untouched."""
    q, lse, k, qo, kv_indptr, indices, last, scores, max_kv_len, sm_scale, scale, _, window_left, cap, _, logits = args
    try:
        check_kv_scores(q, lse, k, qo, kv_indptr, indices, last, scores, max_kv_len, sm_scale, scale, window_left,
                        cap, addresses=not torch.compiler.is_compiling(), logits=logits)
    except (ValueError, TypeError) as e:
        message = str(e).removeprefix("kv_scores: ")
        raise type(e)(f"{op}: kv_scores (H2O's running scores): {message}") from None


def check_distinct_pages(op, kv_indptr, indices):
    """kv_scores writes per page: a page in two requests' tables (or twice in one) would be written twice."""
    used = indices[: int(kv_indptr[-1])] if kv_indptr.shape[0] > 1 else indices[:0]
    if used.numel() != used.unique().numel():
        raise ValueError(f"{op}: kv_scores needs each page in one request's table once (the scores are per page); "
                         f"this plan's page tables repeat a page")


def scale_factor(op, name, value):
    """FlashInfer's q_scale (and a 16-bit cache's k_scale / v_scale): None (1) or a finite number."""
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{op}: {name} must be None or a finite number (a tensor of scales needs an fp8 KV cache), "
                         f"got {value!r}")
    return float(value)


def soft_cap_value(op, logits_soft_cap):
    """logits_soft_cap: None or 0 (none), or a positive finite number; as the float the op takes (0: none)."""
    if logits_soft_cap is None:
        return 0.0
    if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, (int, float)) or \
            not math.isfinite(logits_soft_cap) or not (logits_soft_cap == 0 or logits_soft_cap >= MIN_SOFT_CAP):
        raise ValueError(f"{op}: logits_soft_cap must be None, 0 or a finite number >= 1e-6, got {logits_soft_cap!r}")
    return float(logits_soft_cap)


def sink_logits(op, sinks, num_qo_heads, device):
    """sinks: None, or a floating tensor [num_qo_heads] on q's device, as float32 (no copy if it is)."""
    if sinks is None:
        return None
    check_tensor(op, "sinks", sinks)
    if not sinks.is_floating_point() or tuple(sinks.shape) != (num_qo_heads,) or sinks.device != device:
        raise ValueError(f"{op}: sinks must be a floating tensor of shape ({num_qo_heads},) (one logit per q head) on "
                         f"{device}, got {sinks.dtype} of shape {tuple(sinks.shape)} on {sinks.device}")
    return sinks.to(torch.float32).contiguous()


def _reference(q, k_cache, v_cache, kv_indices, workspace, sm_scale, sinks=None, out_scale=1.0, custom_mask=None,
               logits_soft_cap=0.0, logits=None, k_scale=None, v_scale=None):
    """ref.batch_attention on the plan and the partial-state buffers of a workspace."""
    batch, heads, head_dim = q.shape
    head = workspace[:64]
    ref.attention.check_plan_header(head[: head.numel() // 4 * 4].view(torch.int32).cpu(), batch)  # before the layout
    int_words, _, slots, s_at, v_at = _C.workspace_layout(workspace.numel(), batch, heads, head_dim)
    partial_s = workspace[s_at : s_at + 4 * slots * heads].view(torch.float32).view(slots, heads)
    partial_v = workspace[v_at : v_at + 4 * slots * heads * head_dim].view(torch.float32).view(slots, heads, head_dim)
    words = workspace[: 4 * int_words].view(torch.int32)
    return ref.batch_attention(q, k_cache, v_cache, kv_indices, words, partial_s, partial_v, sm_scale, sinks, out_scale,
                               custom_mask, logits_soft_cap, logits, k_scale, v_scale)


# ---- CPU: the reference, with the same checks as the kernels ----


@_backend.register_cpu("batch_attention")
def _batch_attention_cpu(q, k_cache, v_cache, kv_indices, workspace, out, lse, grid, sm_scale, sinks=None,
                         out_scale=1.0, enable_pdl=False, custom_mask=None, logits_soft_cap=0.0, logits=None,
                         k_scale=None, v_scale=None):
    check_batch_attention("batch_attention", q, k_cache, v_cache, kv_indices, workspace, out, lse, grid, sm_scale,
                          sinks, out_scale, custom_mask, logits_soft_cap, logits=logits, k_scale=k_scale,
                          v_scale=v_scale)
    o, s = _reference(q, k_cache, v_cache, kv_indices, workspace, sm_scale, sinks, out_scale, custom_mask,
                      logits_soft_cap, logits, k_scale, v_scale)
    out.copy_(o)
    lse.copy_(s)


# ---- fake function ----


@torch.library.register_fake("flashkern::batch_attention")
def _batch_attention_fake(q, k_cache, v_cache, kv_indices, workspace, out, lse, grid, sm_scale, sinks=None,
                          out_scale=1.0, enable_pdl=False, custom_mask=None, logits_soft_cap=0.0, logits=None,
                          k_scale=None, v_scale=None):
    check_batch_attention("batch_attention", q, k_cache, v_cache, kv_indices, workspace, out, lse, grid, sm_scale,
                          sinks, out_scale, custom_mask, logits_soft_cap, addresses=False, logits=logits,
                          k_scale=k_scale, v_scale=v_scale)
