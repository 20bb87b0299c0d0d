"""Decode attention over a KV cache: one query token per request, grouped-query attention (any
group size), natural-log LSE. FlashInfer's names and layouts (flashinfer.decode), so switching is
an import. The kernels: csrc/include/flashkern/kernels/batch_attention.cuh.
"""

import functools

import torch

from . import _C, invariance
from ._paged_attention import (
    PagedAttention,
    attention_dtype,
    check_buffer,
    check_window_left,
    csr_page_table,
    fill_buffer,
    host_indptr,
    host_int32,
    reject_unsupported,
    single_request_kv,
    split_length,
)
from ._validate import check_enable_pdl, check_positive_int


class BatchDecodeWithPagedKVCacheWrapper:
    """Batch decode over a paged KV cache.

    ``plan()`` once per batch (page tables, head counts, dtypes), then ``run()`` in every layer::

        wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
        wrapper.plan(kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16)
        out, lse = wrapper.run(q, paged_kv_cache, return_lse=True)

    The page table is in CSR form, int32: request b's pages are
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, its last page holds ``kv_last_page_len[b]`` tokens
    (1..page_size; 0 for a request without pages, whose output is 0 and LSE -inf). Pass them as CPU
    tensors: device tensors cost plan() one synchronization. ``paged_kv_cache`` is
    ``[pages, 2, page_size, num_kv_heads, head_dim]`` (NHD), ``[pages, 2, num_kv_heads, page_size,
    head_dim]`` (HND) or a ``(k_cache, v_cache)`` tuple of 4-D tensors.

    ``use_cuda_graph=True`` with fixed ``paged_kv_indptr_buffer``, ``paged_kv_indices_buffer`` and
    ``paged_kv_last_page_len_buffer`` (int32, on the workspace's device): plan() copies the page
    tables into them and run() can be captured; a replay after a new plan() computes the new batch.
    ``use_tensor_cores`` and ``backend`` are accepted for compatibility (``use_tensor_cores`` is kept
    as an attribute): flashkern picks tensor cores by itself for GQA groups above 4. The workspace is
    any contiguous 1-D tensor of 1-byte elements (``torch.uint8`` or ``torch.int8``), 16-byte aligned.
    """

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        op = "BatchDecodeWithPagedKVCacheWrapper"
        reject_unsupported(op, jit_args=jit_args)
        self._core = PagedAttention(op, float_workspace_buffer, kv_layout, use_cuda_graph)
        self.use_tensor_cores = use_tensor_cores
        self._buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        if use_cuda_graph:
            names = ("paged_kv_indptr_buffer", "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer")
            for name, buffer in zip(names, self._buffers):
                if buffer is None:
                    raise ValueError(f"{op}: use_cuda_graph=True needs {name} (a fixed int32 buffer)")
                check_buffer(op, name, buffer, float_workspace_buffer.device)
            if paged_kv_last_page_len_buffer.shape[0] != paged_kv_indptr_buffer.shape[0] - 1:
                raise ValueError(f"{op}: paged_kv_last_page_len_buffer must have one entry less than paged_kv_indptr_buffer")

    @property
    def is_cuda_graph_enabled(self):
        return self._core.is_cuda_graph_enabled

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None):
        """Use a new workspace (flashkern has one; ``int_workspace_buffer`` is accepted and unused).
        The plan lives in the workspace: call plan() again before run()."""
        self._core.reset_workspace("BatchDecodeWithPagedKVCacheWrapper.reset_workspace_buffer", float_workspace_buffer)

    def end_forward(self):
        """Nothing to release (as in FlashInfer, where it is kept for old callers)."""

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking=True, block_tables=None, seq_lens=None, fixed_split_size=None, disable_split_kv=False,
             q_len_per_req=1, *, window_right=0, batch_invariant=None):
        """Plan decode for a batch of ``len(indptr) - 1`` requests (see the class docstring).
        All host work happens here; a bad page table raises ValueError or TypeError now, not in run().
        FlashInfer's parameters, in its order:

        - ``data_type`` (the old name) fills only a dtype left as None; ``o_data_type`` (float16 or
          bfloat16, either for either input) is the output's dtype, q's by default.
        - ``q_len_per_req``: each request has that many query tokens, its last ones (speculative
          verification, MTP): q is ``[batch * q_len_per_req, num_qo_heads, head_dim]``, request b's
          tokens at rows ``b * q_len_per_req ...``, and token i of a request of ``kv_len`` tokens sees
          the tokens ``j <= kv_len - q_len_per_req + i`` (causal). As in FlashInfer, every request must
          hold its q_len_per_req tokens already (kv_len >= q_len_per_req: ValueError otherwise), and a
          wrapper with ``use_cuda_graph=True`` keeps the q_len_per_req of its first plan.
        - ``seq_lens`` ``[batch]`` and ``block_tables`` ``[batch, max_pages]`` (int32): the page table
          in its fixed-width form, turned into CSR here; ``indptr``, ``indices`` and ``last_page_len``
          may then be None, and if given must describe the same pages (ValueError otherwise).
        - ``disable_split_kv`` gives each request one block of work (no split, no merge);
          ``fixed_split_size`` splits every request into chunks of that many pages (rounded up to 64
          tokens; longer if the workspace cannot hold the pieces) whatever the device, so results do
          not depend on the batch.
        - ``batch_invariant`` (flashkern's): a batch-invariant plan (flashkern.invariance): True, False,
          or None for the process-wide ``flashkern.set_batch_invariant`` setting.
        - ``window_right`` != 0 is not supported (ValueError), nor are the options rejected in
          ``reject_unsupported`` at other than their defaults."""
        reject_unsupported("BatchDecodeWithPagedKVCacheWrapper.plan", window_right=window_right)
        self._plan_from_args("BatchDecodeWithPagedKVCacheWrapper.plan", indptr, indices, last_page_len, num_qo_heads,
                             num_kv_heads, head_dim, page_size, pos_encoding_mode, window_left, logits_soft_cap,
                             q_data_type, kv_data_type, o_data_type, data_type, sm_scale, rope_scale, rope_theta,
                             block_tables, seq_lens, fixed_split_size, disable_split_kv, q_len_per_req,
                             batch_invariant=batch_invariant)

    def _plan_from_args(self, op, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                        pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type, o_data_type,
                        data_type, sm_scale, rope_scale, rope_theta, block_tables, seq_lens, fixed_split_size,
                        disable_split_kv, q_len_per_req, dry_run=False, batch_invariant=None):
        """plan() and workspace_size(): FlashInfer's arguments to the planner's."""
        check_positive_int(op, "page_size", page_size)
        check_positive_int(op, "q_len_per_req", q_len_per_req)
        invariant = invariance.resolve(op, batch_invariant)
        split_tokens = split_length(op, fixed_split_size, disable_split_kv, page_size)
        if block_tables is not None or seq_lens is not None:
            indptr, indices, last_page_len = csr_page_table(op, indptr, indices, last_page_len, block_tables,
                                                            seq_lens, page_size)
        return self._plan(op, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                          pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type, data_type,
                          sm_scale, rope_scale, rope_theta, o_data_type, split_tokens, q_len_per_req, dry_run, invariant)

    begin_forward = plan

    def workspace_size(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                       pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
                       kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None, rope_scale=None,
                       rope_theta=None, block_tables=None, seq_lens=None, fixed_split_size=None, disable_split_kv=False,
                       q_len_per_req=1, *, batch_invariant=None):
        """(float_workspace_size, int_workspace_size) in bytes: the workspace plan() needs for this batch
        to split it as the device asks (a smaller one still works, with longer chunks; a workspace
        too small for even one chunk a request is a ValueError in plan()). flashkern has one workspace,
        so the second is 0. plan()'s arguments; nothing is planned or kept."""
        return self._plan_from_args("BatchDecodeWithPagedKVCacheWrapper.workspace_size", indptr, indices,
                                    last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                                    pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type,
                                    o_data_type, data_type, sm_scale, rope_scale, rope_theta, block_tables, seq_lens,
                                    fixed_split_size, disable_split_kv, q_len_per_req, dry_run=True,
                                    batch_invariant=batch_invariant), 0

    def _plan(self, op, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
              pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16", kv_data_type=None,
              data_type=None, sm_scale=None, rope_scale=None, rope_theta=None, o_data_type=None, split_tokens=None,
              q_len_per_req=1, dry_run=False, batch_invariant=False):
        """plan(), its errors under the name of the function the caller called."""
        reject_unsupported(op, pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale, rope_theta=rope_theta)
        if data_type is not None:
            q_data_type = data_type if q_data_type is None else q_data_type
            kv_data_type = data_type if kv_data_type is None else kv_data_type
        q_dtype = attention_dtype(op, "q_data_type", q_data_type)
        if q_dtype is None:
            raise TypeError(f"{op}: q_data_type must be torch.float16 or torch.bfloat16, got None")
        kv_dtype = attention_dtype(op, "kv_data_type", kv_data_type, default=q_dtype)
        o_dtype = attention_dtype(op, "o_data_type", o_data_type, default=q_dtype)
        indptr_h, batch = host_indptr(op, "indptr", indptr)
        last_h = host_int32(op, "last_page_len", last_page_len, batch)
        indices_h = host_int32(op, "indices", indices)
        if q_len_per_req > 1 and batch:
            pages = indptr_h[1:] - indptr_h[:-1]
            shortest = int(torch.where(pages > 0, (pages - 1) * page_size + last_h, 0).min())
            if shortest < q_len_per_req:  # FlashInfer's words, which its callers match on
                raise ValueError(f"{op}: q_len_per_req={q_len_per_req} requires kv_len >= q_len_per_req for every "
                                 f"request (the verified tokens must already be in the KV cache), but a request has "
                                 f"kv_len={shortest}: its earlier rows would attend to an empty KV range")
        frozen = getattr(self, "_q_len_per_req", None)
        if self._core.is_cuda_graph_enabled and frozen is not None and frozen != q_len_per_req and not dry_run:
            raise ValueError(f"{op}: q_len_per_req is part of the frozen CUDA-graph shape: this wrapper was planned "
                             f"with {frozen}, got {q_len_per_req}; use a wrapper per q_len_per_req")
        indices_d = None if dry_run else self._device_indices(op, indices, indptr, last_page_len, batch)
        # request b's queries: rows b * q_len_per_req ... of q (None: one query a request)
        qo_h = None if q_len_per_req == 1 else torch.arange(batch + 1, dtype=torch.int32) * q_len_per_req
        planned = self._core._plan(op, [(qo_h, indptr_h, indices_h, last_h)], [indices_d], batch * q_len_per_req,
                                   num_qo_heads, num_kv_heads, head_dim, page_size, sm_scale, q_dtype, kv_dtype,
                                   ("qo_indptr", "indptr", "indices", "last_page_len"), False,
                                   {_C.attention_kind(q_len_per_req, num_qo_heads // max(num_kv_heads, 1), head_dim)},
                                   split_tokens, o_dtype, causal=q_len_per_req > 1, window_left=window_left,
                                   logits_soft_cap=logits_soft_cap, dry_run=dry_run,
                                   graph_tables=(None, self._buffers[0], self._buffers[2]),
                                   batch_invariant=batch_invariant)
        if dry_run:
            return planned
        self._q_len_per_req, self._batch = q_len_per_req, batch

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=None,
            skip_softmax_threshold_scale_factor=None, kv_cache_sf=None, kv_scores=None):
        """Decode: q ``[batch * q_len_per_req, num_qo_heads, head_dim]`` -> out of that shape (the
        plan's o_data_type), and with ``return_lse`` also lse ``[batch * q_len_per_req,
        num_qo_heads]`` float32, the natural-log sum-exp of the scaled logits. ``out`` / ``lse`` may be
        given (contiguous). FlashInfer's keywords:

        - ``sinks`` ``[num_qo_heads]``: head h's softmax gets one more logit, ``sinks[h]`` (not scaled
          by sm_scale), whose value is zero (GPT-OSS); lse then includes it: ``log(exp(sinks[h]) +
          sum_j exp(logit_j))``.
        - ``q_scale`` and ``k_scale`` (numbers) multiply sm_scale, ``v_scale`` the output.
        - ``q_len_per_req`` and ``window_left``: None or the planned values.
        - ``enable_pdl=True``: the kernels as programmatic dependent launches where the GPU has them
          (CUDA sm_90+); None is off. ``skip_softmax_threshold_scale_factor`` and ``kv_cache_sf`` are
          not supported (ValueError).
        - ``kv_scores`` (flashkern's): H2O's running scores, float32 ``[num_pages, num_kv_heads,
          page_size]``; each query's attention probabilities, summed over its GQA group, are added
          into them (the step's own keys start from 0): ``flashkern.kv_compress``."""
        op = "BatchDecodeWithPagedKVCacheWrapper.run"
        if args:
            raise ValueError(f"{op}: extra positional arguments (custom-kernel arguments in FlashInfer) are not "
                             f"supported by flashkern, got {len(args)}")
        pdl = check_enable_pdl(op, enable_pdl)
        reject_unsupported(op, skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
                           kv_cache_sf=kv_cache_sf)
        self._core.check_window(op, window_left)
        planned = getattr(self, "_q_len_per_req", 1)
        if q_len_per_req is not None and q_len_per_req != planned:
            raise ValueError(f"{op}: q_len_per_req={q_len_per_req!r} differs from the plan's {planned}; "
                             "plan again with it")
        self._check_q_rows(op, q)
        out, lse = self._core._run(op, q, paged_kv_cache, out, lse, sinks, q_scale, k_scale, v_scale, pdl=pdl,
                                   kv_scores=kv_scores)
        return (out, lse) if return_lse else out

    run_return_lse = functools.partialmethod(run, return_lse=True)

    def forward(self, q, paged_kv_cache, pos_encoding_mode="NONE", q_scale=None, k_scale=None, v_scale=None,
                window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None):
        """FlashInfer's deprecated run(), with the options it took then: out. ``sm_scale``, when
        given, replaces the plan's for this call; the others as in plan() and run()."""
        return self._forward("BatchDecodeWithPagedKVCacheWrapper.forward", q, paged_kv_cache, pos_encoding_mode,
                             q_scale, k_scale, v_scale, window_left, logits_soft_cap, sm_scale, rope_scale,
                             rope_theta)[0]

    def forward_return_lse(self, q, paged_kv_cache, pos_encoding_mode="NONE", q_scale=None, k_scale=None,
                           v_scale=None, window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                           rope_theta=None):
        """forward(), returning (out, lse)."""
        return self._forward("BatchDecodeWithPagedKVCacheWrapper.forward_return_lse", q, paged_kv_cache,
                             pos_encoding_mode, q_scale, k_scale, v_scale, window_left, logits_soft_cap, sm_scale,
                             rope_scale, rope_theta)

    def _forward(self, op, q, paged_kv_cache, pos_encoding_mode, q_scale, k_scale, v_scale, window_left,
                 logits_soft_cap, sm_scale, rope_scale, rope_theta):
        reject_unsupported(op, pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale, rope_theta=rope_theta)
        self._core.check_window(op, window_left)
        self._check_q_rows(op, q)
        return self._core._run(op, q, paged_kv_cache, None, None, None, q_scale, k_scale, v_scale, sm_scale,
                               logits_soft_cap=logits_soft_cap)

    def _check_q_rows(self, op, q):
        """q's rows against the plan's batch * q_len_per_req, in words that name q_len_per_req."""
        q_len, batch = getattr(self, "_q_len_per_req", 1), getattr(self, "_batch", None)
        if batch is not None and isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[0] != batch * q_len:
            raise ValueError(f"{op}: q has {q.shape[0]} rows, but the plan's {batch} requests with "
                             f"q_len_per_req={q_len} need batch * q_len_per_req = {batch * q_len}")

    def _device_indices(self, op, indices, indptr, last_page_len, batch):
        """kv_indices where the kernels read them: the fixed buffer under CUDA graphs (filled here)."""
        device = self._core._device
        if not self._core.is_cuda_graph_enabled:
            return indices.to(device)
        indptr_buf, indices_buf, last_buf = self._buffers
        if indptr_buf.shape[0] != batch + 1:
            raise ValueError(f"{op}: under CUDA graphs the batch size is fixed at {indptr_buf.shape[0] - 1} "
                             f"(paged_kv_indptr_buffer), got {batch}")
        fill_buffer(op, "paged_kv_indptr_buffer", indptr_buf, indptr)
        fill_buffer(op, "paged_kv_last_page_len_buffer", last_buf, last_page_len)
        fill_buffer(op, "paged_kv_indices_buffer", indices_buf, indices)
        return indices_buf


def single_decode_with_kv_cache(q, k, v, kv_layout="NHD", pos_encoding_mode="NONE", use_tensor_cores=False,
                                q_scale=None, k_scale=None, v_scale=None, window_left=-1, logits_soft_cap=None,
                                sm_scale=None, rope_scale=None, rope_theta=None, return_lse=False, *, sinks=None):
    """Decode attention of one request: q ``[num_qo_heads, head_dim]``, k and v ``[kv_len,
    num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, kv_len, head_dim]`` (HND) -> out
    ``[num_qo_heads, head_dim]`` (and lse ``[num_qo_heads]``, natural log, with ``return_lse``).
    ``sinks`` and the scales: as in BatchDecodeWithPagedKVCacheWrapper.run; ``window_left`` (a
    sliding window: the last ``window_left + 1`` tokens) and ``logits_soft_cap`` as in its plan().

    The plan for a shape is made once and kept (a few per device), so after one eager call with a
    shape, calls with that shape can be captured in a CUDA graph."""
    op = "single_decode_with_kv_cache"
    reject_unsupported(op, pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale, rope_theta=rope_theta)
    k, v = single_request_kv(op, q, k, v, kv_layout, ("num_qo_heads", "head_dim"))
    kv_len, num_kv_heads, head_dim = k.shape
    if kv_len == 0:
        raise ValueError(f"{op}: k and v must hold at least one token")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"{op}: q must be float16 or bfloat16, got {q.dtype}")
    check_window_left(op, window_left)
    wrapper = _single_plan(q.device, q.dtype, k.dtype, kv_len, q.shape[0], num_kv_heads, head_dim,
                           None if sm_scale is None else float(sm_scale), window_left, invariance.is_batch_invariant())
    # the whole sequence as one page of kv_len tokens
    out, lse = wrapper._core._run(op, q[None], (k[None], v[None]), None, None, sinks, q_scale, k_scale, v_scale,
                                  logits_soft_cap=logits_soft_cap)
    return (out[0], lse[0]) if return_lse else out[0]


@functools.lru_cache(maxsize=32)
def _single_plan(device, dtype, kv_dtype, kv_len, num_qo_heads, num_kv_heads, head_dim, sm_scale, window_left,
                 batch_invariant):
    """A planned wrapper for one request of kv_len tokens (one page), with a workspace sized by a dry
    run of its plan."""
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.empty(0, dtype=torch.uint8, device=device), "NHD")
    i32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    args = ("single_decode_with_kv_cache", i32([0, 1]), i32([0]), i32([kv_len]), num_qo_heads, num_kv_heads,
            head_dim, kv_len)
    options = dict(q_data_type=dtype, kv_data_type=kv_dtype, sm_scale=sm_scale, window_left=window_left,
                   batch_invariant=batch_invariant)
    wrapper.reset_workspace_buffer(torch.empty(wrapper._plan(*args, **options, dry_run=True), dtype=torch.uint8,
                                               device=device))
    wrapper._plan(*args, **options)
    return wrapper
