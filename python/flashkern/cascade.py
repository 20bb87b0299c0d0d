"""Cascade attention for decoding: KV shared by many requests (a system prompt, few-shot examples,
a document) is read once for all of them, by the multi-query kernel on matrix units, and merged
with each request's own KV through the attention states (natural-log LSE). FlashInfer's names
(flashinfer.cascade); the merge operators are flashkern.merge_state(s).
"""

import torch

from . import invariance
from ._paged_attention import (
    ALL_KINDS,
    PagedAttention,
    attention_dtype,
    check_buffer,
    fill_buffer,
    host_int32,
    reject_unsupported,
)
from ._validate import MAX_LEVELS, check_tensor


class MultiLevelCascadeAttentionWrapper:
    """Decode attention over a hierarchy of KV levels, in one plan and one run.

    Level 0 is the most shared. At level i, ``qo_indptr_arr[i]`` groups the batch's query tokens
    into the groups that share that level's KV, whose pages are listed by that level's page table
    (``paged_kv_indptr_arr[i]``, ``paged_kv_indices_arr[i]``, ``paged_kv_last_page_len[i]``, int32,
    CSR as in BatchDecodeWithPagedKVCacheWrapper; a group with no pages at a level contributes
    nothing). Each query's output is attention over the union of its groups' KV at every level. The
    last level is per request: ``qo_indptr_arr[-1]`` gives each request its query tokens (one for
    decode, several for speculative verification or an append). With ``causal=True`` a request's
    ``n`` query tokens are the last ``n`` tokens of its last-level KV, and token i sees that level's
    tokens ``j <= kv_len - n + i``; the upper levels are seen whole, as FlashInfer does. Up to 8 levels.

    ``use_cuda_graph=True`` needs the fixed int32 buffers ``qo_indptr_buf_arr``,
    ``paged_kv_indptr_buf_arr``, ``paged_kv_indices_buf_arr`` and ``paged_kv_last_page_len_buf_arr``
    (one each per level); plan() copies the page tables into them, and a captured run() replays the
    latest plan.
    """

    def __init__(self, num_levels, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 qo_indptr_buf_arr=None, paged_kv_indptr_buf_arr=None, paged_kv_indices_buf_arr=None,
                 paged_kv_last_page_len_buf_arr=None):
        op = "MultiLevelCascadeAttentionWrapper"
        if not isinstance(num_levels, int) or not 1 <= num_levels <= MAX_LEVELS:
            raise ValueError(f"{op}: num_levels must be an int from 1 to {MAX_LEVELS}, got {num_levels!r}")
        self._num_levels = num_levels
        self._core = PagedAttention(op, float_workspace_buffer, kv_layout, use_cuda_graph)
        self._buffers = (qo_indptr_buf_arr, paged_kv_indptr_buf_arr, paged_kv_indices_buf_arr,
                         paged_kv_last_page_len_buf_arr)
        if use_cuda_graph:
            names = ("qo_indptr_buf_arr", "paged_kv_indptr_buf_arr", "paged_kv_indices_buf_arr",
                     "paged_kv_last_page_len_buf_arr")
            for name, buffers in zip(names, self._buffers):
                if buffers is None or len(buffers) != num_levels:
                    raise ValueError(f"{op}: use_cuda_graph=True needs {name}, one fixed int32 buffer per level")
                for i, buffer in enumerate(buffers):
                    check_buffer(op, f"{name}[{i}]", buffer, float_workspace_buffer.device)

    @property
    def is_cuda_graph_enabled(self):
        return self._core.is_cuda_graph_enabled

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffers=None):
        """Use a new workspace (flashkern has one; ``int_workspace_buffers`` is accepted and unused).
        The plan lives in the workspace: call plan() again before run()."""
        self._core.reset_workspace("MultiLevelCascadeAttentionWrapper.reset_workspace_buffer", float_workspace_buffer)

    def plan(self, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim, page_size, causal=False, pos_encoding_mode="NONE",
             use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None, rope_scale=None,
             rope_theta=None, q_data_type="float16", kv_data_type=None, *, batch_invariant=None):
        """Plan the cascade (see the class docstring); every page table is checked here, on the host.
        ``logits_soft_cap`` (Gemma2) applies to every level. ``window_left`` must stay -1: a sliding
        window over a shared level would start at a different token for each request sharing it
        (ValueError rather than a window relative to each level, which is what FlashInfer's per-level
        prefill computes). ``batch_invariant`` (flashkern's): a batch-invariant plan (flashkern.invariance;
        None: the process-wide setting): every level split in INVARIANT_CHUNK tokens, the shared levels on
        one fixed tile, so a request's bits depend on its own levels, not on who shares them."""
        op = "MultiLevelCascadeAttentionWrapper.plan"
        invariant = invariance.resolve(op, batch_invariant)
        if causal not in (False, True):
            raise TypeError(f"{op}: causal must be a bool, got {causal!r}")
        reject_unsupported(op, pos_encoding_mode=pos_encoding_mode, window_left=window_left, rope_scale=rope_scale,
                           rope_theta=rope_theta)
        q_dtype = attention_dtype(op, "q_data_type", q_data_type)
        kv_dtype = attention_dtype(op, "kv_data_type", kv_data_type, default=q_dtype)
        arrays = (qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len)
        names = ("qo_indptr_arr", "paged_kv_indptr_arr", "paged_kv_indices_arr", "paged_kv_last_page_len")
        for name, array in zip(names, arrays):
            if not isinstance(array, (list, tuple)) or len(array) != self._num_levels:
                raise ValueError(f"{op}: {name} must be a list of {self._num_levels} tensors (one per level)")
        last_qo = qo_indptr_arr[-1]
        check_tensor(op, f"qo_indptr_arr[{self._num_levels - 1}]", last_qo)
        requests = last_qo.shape[0] - 1 if last_qo.dim() == 1 else -1
        levels, device_indices = [], []
        for i in range(self._num_levels):
            kv = paged_kv_indptr_arr[i]
            check_tensor(op, f"paged_kv_indptr_arr[{i}]", kv)
            if kv.dim() != 1 or kv.shape[0] < 1:
                raise ValueError(f"{op}: paged_kv_indptr_arr[{i}] must be 1-D with groups + 1 entries, got shape "
                                 f"{tuple(kv.shape)}")
            groups = kv.shape[0] - 1
            qo_h = host_int32(op, f"qo_indptr_arr[{i}]", qo_indptr_arr[i], groups + 1)
            kv_h = host_int32(op, f"paged_kv_indptr_arr[{i}]", kv)
            indices_h = host_int32(op, f"paged_kv_indices_arr[{i}]", paged_kv_indices_arr[i])
            last_h = host_int32(op, f"paged_kv_last_page_len[{i}]", paged_kv_last_page_len[i], groups)
            levels.append((qo_h, kv_h, indices_h, last_h))
            device_indices.append(self._device_indices(op, i, paged_kv_indices_arr[i], arrays, requests))
        batch = int(levels[-1][0][-1]) if requests >= 0 else 0  # the query tokens (the planner checks the rest)
        self._core._plan(op, levels, device_indices, batch, num_qo_heads, num_kv_heads, head_dim, page_size, sm_scale,
                         q_dtype, kv_dtype, names, True, ALL_KINDS, causal=causal, logits_soft_cap=logits_soft_cap,
                         batch_invariant=invariant)

    begin_forward = plan

    def run(self, q, paged_kv_cache, out=None, lse=None, return_lse=False, *, sinks=None, k_scale=None, v_scale=None):
        """q ``[tokens, num_qo_heads, head_dim]`` -> out (q's dtype), and lse ``[tokens, num_qo_heads]``
        float32 (natural log) with ``return_lse``. ``sinks`` ``[num_qo_heads]``: one more logit per
        head, of value zero, in each query's softmax over all its levels (as in
        BatchDecodeWithPagedKVCacheWrapper.run); lse includes it. ``k_scale`` / ``v_scale`` (flashkern's
        addition): as in BatchDecodeWithPagedKVCacheWrapper.run, for an fp8 cache planned with kv_data_type."""
        out, lse = self._core._run("MultiLevelCascadeAttentionWrapper.run", q, paged_kv_cache, out, lse, sinks,
                                   k_scale=k_scale, v_scale=v_scale)
        return (out, lse) if return_lse else out

    forward = run

    def _device_indices(self, op, level, indices, arrays, requests):
        if not self._core.is_cuda_graph_enabled:
            return indices.to(self._core._device)
        qo_buf, kv_buf, indices_buf, last_buf = (b[level] for b in self._buffers)
        qo, kv, _, last = (a[level] for a in arrays)
        for name, buf, value in (("qo_indptr_buf_arr", qo_buf, qo), ("paged_kv_indptr_buf_arr", kv_buf, kv),
                                 ("paged_kv_last_page_len_buf_arr", last_buf, last),
                                 ("paged_kv_indices_buf_arr", indices_buf, indices)):
            fill_buffer(op, f"{name}[{level}]", buf, value)
        if level == self._num_levels - 1 and qo_buf.shape[0] != requests + 1:
            raise ValueError(f"{op}: under CUDA graphs the batch size is fixed at {qo_buf.shape[0] - 1}, got {requests}")
        return indices_buf
