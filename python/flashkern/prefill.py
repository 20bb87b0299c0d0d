"""Prefill and append attention: many query tokens per request over their keys, causal or not, with
sliding windows, soft-capping, custom (tree) masks and sinks. FlashInfer's names and layouts
(flashinfer.prefill). The same plan/run machinery and kernels as decode and cascade
(_paged_attention.py): a request is a group, its queries (times the GQA group) the rows of the
multi-query kernel's 64-row tiles, the KV cut into chunks only when the tiles cannot fill the device.

Masks, as FlashInfer and FlashAttention-2 align them (bottom-right): query i of a request with
``qo_len`` queries and ``kv_len`` keys is token ``i + kv_len - qo_len`` of the sequence; causal, it
sees the keys ``j <= i + kv_len - qo_len``; ``window_left = w >= 0`` also hides ``j < i + kv_len -
qo_len - w``; a custom mask (True: may attend) replaces the causal mask. ``logits_soft_cap = c > 0``
turns each logit x (after sm_scale) into ``c * tanh(x / c)``. A query that sees no key gets 0 and
LSE -inf. LSE is the natural log.
"""

import functools

import torch

from . import invariance, ref
from ._paged_attention import (
    ALL_KINDS,
    PagedAttention,
    attention_dtype,
    check_buffer,
    check_window_left,
    fill_buffer,
    host_indptr,
    host_int32,
    kv_scale_arg,
    reject_unsupported,
    scale_factor,
    sink_logits,
    single_request_kv,
    split_length,
    soft_cap_value,
)
from ._validate import ATTENTION_DTYPES, check_enable_pdl, check_positive_int, check_tensor

NAMES = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")
RAGGED_NAMES = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")


def pack_mask_segments(op, mask_bits, segment_bits):
    """A flattened boolean mask ``[sum(segment_bits)]`` as FlashInfer's packed form: each request's
    bits packed little-endian (numpy.packbits(..., bitorder="little")), each request starting on a
    byte. On the mask's device."""
    segment_bits = segment_bits.to(mask_bits.device)
    nbytes = (segment_bits + 7) // 8
    starts = torch.cumsum(nbytes, 0) - nbytes  # each request's first byte
    request = torch.repeat_interleave(torch.arange(segment_bits.numel(), device=mask_bits.device), segment_bits)
    first_bit = torch.cumsum(segment_bits, 0) - segment_bits
    local = torch.arange(mask_bits.numel(), device=mask_bits.device) - first_bit[request]
    padded = torch.zeros(int(nbytes.sum()) * 8, dtype=torch.uint8, device=mask_bits.device)
    padded[starts[request] * 8 + local] = mask_bits.to(torch.uint8)
    weights = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8, device=mask_bits.device)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def checked_mask(op, custom_mask, packed_custom_mask, qo_lens, kv_lens):
    """The custom mask as the packed bytes the kernels read (None: no mask), checked against the
    requests' lengths: ``custom_mask`` a bool tensor ``[sum(qo_len * kv_len)]`` (packed here), or
    ``packed_custom_mask`` uint8, each request's ``qo_len * kv_len`` bits from a byte of its own."""
    bits = qo_lens.long() * kv_lens.long()
    if packed_custom_mask is not None:
        check_tensor(op, "packed_custom_mask", packed_custom_mask)
        need = int(((bits + 7) // 8).sum())
        if packed_custom_mask.dtype != torch.uint8 or packed_custom_mask.dim() != 1 or \
                packed_custom_mask.shape[0] != need:
            raise ValueError(f"{op}: packed_custom_mask must be a 1-D uint8 tensor of {need} bytes (each request's "
                             f"qo_len * kv_len bits, little-endian, from a byte of its own), got "
                             f"{packed_custom_mask.dtype} of shape {tuple(packed_custom_mask.shape)}")
        return packed_custom_mask.contiguous()
    if custom_mask is None:
        return None
    check_tensor(op, "custom_mask", custom_mask)
    need = int(bits.sum())
    if custom_mask.dtype != torch.bool or custom_mask.dim() != 1 or custom_mask.shape[0] != need:
        raise ValueError(f"{op}: custom_mask must be a 1-D bool tensor of sum(qo_len * kv_len) = {need} entries, got "
                         f"{custom_mask.dtype} of shape {tuple(custom_mask.shape)}")
    return pack_mask_segments(op, custom_mask, bits)


# the fixed buffers (use_cuda_graph=True) kv_scores reads: (qo_indptr, kv_indptr, kv_last_page_len)
GRAPH_TABLES = ("qo_indptr_buf", "paged_kv_indptr_buf", "paged_kv_last_page_len_buf")


class _Prefill:
    """What the two prefill wrappers share: checking the plan's arguments, the mask and the run."""

    def __init__(self, op, float_workspace_buffer, kv_layout, use_cuda_graph, buffers, backend, jit_args, jit_kwargs):
        reject_unsupported(op, jit_args=jit_args)
        if jit_kwargs is not None:
            raise ValueError(f"{op}: jit_kwargs (custom JIT kernels in FlashInfer) is not supported by flashkern")
        self._core = PagedAttention(op, float_workspace_buffer, kv_layout, use_cuda_graph)
        self._buffers = buffers  # {name: fixed int32 / uint8 buffer} under CUDA graphs
        self._causal = False
        if use_cuda_graph:
            for name, buffer in buffers.items():
                if buffer is None:
                    if name in ("custom_mask_buf", "mask_indptr_buf"):
                        continue  # only a plan with a custom mask needs them
                    raise ValueError(f"{op}: use_cuda_graph=True needs {name} (a fixed buffer)")
                if name == "custom_mask_buf":
                    check_tensor(op, name, buffer)
                    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or \
                            buffer.device != float_workspace_buffer.device:
                        raise ValueError(f"{op}: custom_mask_buf must be a 1-D uint8 tensor on "
                                         f"{float_workspace_buffer.device}")
                else:
                    check_buffer(op, name, buffer, float_workspace_buffer.device)

    @property
    def is_cuda_graph_enabled(self):
        return self._core.is_cuda_graph_enabled

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None):
        """Use a new workspace (flashkern has one; ``int_workspace_buffer`` is accepted and unused).
        The plan lives in the workspace: call plan() again before run()."""
        self._core.reset_workspace(f"{type(self).__name__}.reset_workspace_buffer", float_workspace_buffer)

    def end_forward(self):
        """Nothing to release (kept for old callers, as in FlashInfer)."""

    def _plan_prefill(self, op, names, qo_indptr, kv_indptr, indices, last_page_len, lengths, num_qo_heads,
                      num_kv_heads, head_dim_qk, head_dim_vo, page_size, custom_mask, packed_custom_mask, causal,
                      pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale,
                      rope_theta, q_data_type, kv_data_type, o_data_type, fixed_split_size, disable_split_kv,
                      identity, device_indices, dry_run=False, batch_invariant=None):
        """qo_indptr, kv_indptr, indices, last_page_len: host int32 (shape-checked); lengths: each
        request's KV tokens (int64); device_indices: where the kernels read the page table."""
        reject_unsupported(op, pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale, rope_theta=rope_theta)
        if causal not in (False, True):
            raise TypeError(f"{op}: causal must be a bool, got {causal!r}")
        if use_fp16_qk_reduction not in (False, True):
            raise TypeError(f"{op}: use_fp16_qk_reduction must be a bool, got {use_fp16_qk_reduction!r}")
        if head_dim_vo is not None and head_dim_vo != head_dim_qk:
            raise ValueError(f"{op}: head_dim_vo must equal head_dim_qk ({head_dim_qk}) in flashkern, got {head_dim_vo}")
        invariant = invariance.resolve(op, batch_invariant)
        split_tokens = split_length(op, fixed_split_size, disable_split_kv, page_size)
        q_dtype = attention_dtype(op, "q_data_type", q_data_type)
        if q_dtype is None:
            raise TypeError(f"{op}: q_data_type must be torch.float16 or torch.bfloat16, got None")
        kv_dtype = attention_dtype(op, "kv_data_type", kv_data_type, default=q_dtype)
        o_dtype = attention_dtype(op, "o_data_type", o_data_type, default=q_dtype)
        if qo_indptr.shape[0] != kv_indptr.shape[0]:
            raise ValueError(f"{op}: {names[0]} and {names[1]} must have one entry per request + 1, got "
                             f"{qo_indptr.shape[0]} and {kv_indptr.shape[0]}")
        qo_lens = qo_indptr[1:] - qo_indptr[:-1]
        if int(qo_indptr[0]) != 0 or bool((qo_lens < 0).any()):
            raise ValueError(f"{op}: {names[0]} must start at 0 and be non-decreasing, got {qo_indptr.tolist()}")
        mask = checked_mask(op, custom_mask, packed_custom_mask, qo_lens, lengths) if qo_lens.numel() else None
        if mask is not None and not dry_run:
            mask = self._device_mask(op, mask)
        planned = self._core._plan(op, [(qo_indptr, kv_indptr, indices, last_page_len)], [device_indices],
                                   int(qo_indptr[-1]), num_qo_heads, num_kv_heads, head_dim_qk, page_size, sm_scale,
                                   q_dtype, kv_dtype, names, False, ALL_KINDS, split_tokens, o_dtype, causal=causal,
                                   window_left=window_left, logits_soft_cap=logits_soft_cap, custom_mask=mask,
                                   identity=identity, dry_run=dry_run,
                                   graph_tables=tuple(self._buffers.get(name) for name in GRAPH_TABLES),
                                   batch_invariant=invariant)
        if dry_run:
            return planned
        self._causal = causal

    def _device_mask(self, op, mask):
        if not self._core.is_cuda_graph_enabled:
            return mask.to(self._core._device)
        buffer = self._buffers.get("custom_mask_buf")
        if buffer is None:
            raise ValueError(f"{op}: a custom mask under use_cuda_graph=True needs custom_mask_buf (a fixed uint8 "
                             "buffer)")
        fill_buffer(op, "custom_mask_buf", buffer, mask)
        return buffer

    def _fill(self, op, pairs):
        """Under CUDA graphs: copies (buffer name, values) into the caller's fixed buffers."""
        if self._core.is_cuda_graph_enabled:
            for name, values in pairs:
                fill_buffer(op, name, self._buffers[name], values)

    def _run_prefill(self, op, q, kv, kv_layout, args, q_scale, k_scale, v_scale, out, lse, return_lse, enable_pdl,
                     window_left, sinks, kv_scores=None, o_scale=None):
        if args:
            raise ValueError(f"{op}: extra positional arguments (custom-kernel arguments in FlashInfer) are not "
                             f"supported by flashkern, got {len(args)}")
        pdl = check_enable_pdl(op, enable_pdl)
        self._core.check_window(op, window_left)
        out, lse = self._core._run(op, q, kv, out, lse, sinks, q_scale, k_scale, v_scale, pdl=pdl, kv_layout=kv_layout,
                                   kv_scores=kv_scores, o_scale=o_scale)
        return (out, lse) if return_lse else out

    def _forward(self, op, q, kv, kv_layout, causal, pos_encoding_mode, k_scale, v_scale, window_left,
                 logits_soft_cap, sm_scale, rope_scale, rope_theta):
        reject_unsupported(op, pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale, rope_theta=rope_theta)
        if causal != self._causal:
            raise ValueError(f"{op}: causal={causal!r} differs from the plan's {self._causal}; plan again with it")
        self._core.check_window(op, window_left)
        return self._core._run(op, q, kv, None, None, None, None, k_scale, v_scale, sm_scale,
                               logits_soft_cap=logits_soft_cap, kv_layout=kv_layout)


class BatchPrefillWithPagedKVCacheWrapper(_Prefill):
    """Prefill / append attention over a paged KV cache: request b's query tokens are rows
    ``qo_indptr[b]:qo_indptr[b+1]`` of q, its keys the pages ``paged_kv_indices[paged_kv_indptr[b]:
    paged_kv_indptr[b+1]]`` (the last holding ``paged_kv_last_page_len[b]`` tokens), int32 CSR, the
    cache layouts of BatchDecodeWithPagedKVCacheWrapper. The queries are the request's last tokens
    (an append to a cached prefix; see the module docstring for the masks).

    ``use_cuda_graph=True`` needs the fixed int32 buffers ``qo_indptr_buf``, ``paged_kv_indptr_buf``,
    ``paged_kv_indices_buf`` and ``paged_kv_last_page_len_buf`` (and ``custom_mask_buf``, uint8, for a
    custom mask): plan() copies into them and a captured run() replays the latest plan.
    """

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None):
        buffers = {"qo_indptr_buf": qo_indptr_buf, "paged_kv_indptr_buf": paged_kv_indptr_buf,
                   "paged_kv_indices_buf": paged_kv_indices_buf, "paged_kv_last_page_len_buf": paged_kv_last_page_len_buf,
                   "custom_mask_buf": custom_mask_buf, "mask_indptr_buf": mask_indptr_buf}
        super().__init__("BatchPrefillWithPagedKVCacheWrapper", float_workspace_buffer, kv_layout, use_cuda_graph,
                         buffers, backend, jit_args, jit_kwargs)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False,
             pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
             token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
             max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False, *,
             batch_invariant=None):
        """Plan the batch; every check happens here, on the host (pass CPU tensors: device ones cost
        a synchronization). ``custom_mask`` (bool ``[sum(qo_len * kv_len)]``, row-major per request)
        or ``packed_custom_mask`` (its FlashInfer packed form) replaces ``causal``. The
        ``prefix_len_ptr`` / ``token_pos_in_items_*`` / ``max_item_len_ptr`` (multi-item scoring),
        ``seq_lens*`` / ``block_tables`` / ``max_*`` (trtllm-gen backend) arguments must stay None
        (ValueError); ``fixed_split_size`` / ``disable_split_kv`` / ``batch_invariant`` as in the decode
        wrapper."""
        self._plan_paged("BatchPrefillWithPagedKVCacheWrapper.plan", **_arguments(locals()))

    begin_forward = plan

    def workspace_size(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                       num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None,
                       packed_custom_mask=None, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
                       sm_scale=None, window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
                       q_data_type="float16", kv_data_type=None, o_data_type=None, prefix_len_ptr=None,
                       token_pos_in_items_ptr=None, token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None,
                       seq_lens_q=None, block_tables=None, max_token_per_sequence=None, max_sequence_kv=None,
                       fixed_split_size=None, disable_split_kv=False, *, batch_invariant=None):
        """(float_workspace_size, int_workspace_size) in bytes that plan() needs for this batch at the
        split the device asks for (flashkern has one workspace: the second is 0). Nothing is kept."""
        return self._plan_paged("BatchPrefillWithPagedKVCacheWrapper.workspace_size", **_arguments(locals()),
                                dry_run=True), 0

    def _plan_paged(self, op, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                    num_kv_heads, head_dim_qk, page_size, head_dim_vo, custom_mask, packed_custom_mask, causal,
                    pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale,
                    rope_theta, q_data_type, kv_data_type, o_data_type, prefix_len_ptr, token_pos_in_items_ptr,
                    token_pos_in_items_len, max_item_len_ptr, seq_lens, seq_lens_q, block_tables,
                    max_token_per_sequence, max_sequence_kv, fixed_split_size, disable_split_kv, non_blocking=True,
                    dry_run=False, batch_invariant=None):
        reject_other_features(op, prefix_len_ptr=prefix_len_ptr, token_pos_in_items_ptr=token_pos_in_items_ptr,
                              token_pos_in_items_len=token_pos_in_items_len, max_item_len_ptr=max_item_len_ptr,
                              seq_lens=seq_lens, seq_lens_q=seq_lens_q, block_tables=block_tables,
                              max_token_per_sequence=max_token_per_sequence, max_sequence_kv=max_sequence_kv)
        check_positive_int(op, "page_size", page_size)
        kv_h, batch = host_indptr(op, "paged_kv_indptr", paged_kv_indptr)
        qo_h = host_int32(op, "qo_indptr", qo_indptr, batch + 1)
        last_h = host_int32(op, "paged_kv_last_page_len", paged_kv_last_page_len, batch)
        indices_h = host_int32(op, "paged_kv_indices", paged_kv_indices)
        pages = (kv_h[1:] - kv_h[:-1]).long()
        lengths = torch.where(pages > 0, (pages - 1) * page_size + last_h.long(), 0)
        if dry_run:
            device_indices = None
        elif self._core.is_cuda_graph_enabled:
            self._fill(op, [("qo_indptr_buf", qo_indptr), ("paged_kv_indptr_buf", paged_kv_indptr),
                            ("paged_kv_last_page_len_buf", paged_kv_last_page_len),
                            ("paged_kv_indices_buf", paged_kv_indices)])
            device_indices = self._buffers["paged_kv_indices_buf"]
        else:
            device_indices = paged_kv_indices.to(self._core._device)
        return self._plan_prefill(op, NAMES, qo_h, kv_h, indices_h, last_h, lengths, num_qo_heads, num_kv_heads,
                                  head_dim_qk, head_dim_vo, page_size, custom_mask, packed_custom_mask, causal,
                                  pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap,
                                  rope_scale, rope_theta, q_data_type, kv_data_type, o_data_type, fixed_split_size,
                                  disable_split_kv, False, device_indices, dry_run, batch_invariant)

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None, kv_cache_sf=None,
            skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None, uses_spcompress=None, kv_scores=None):
        """q ``[qo_indptr[-1], num_qo_heads, head_dim]`` -> out (the plan's o_data_type), and with
        ``return_lse`` lse ``[qo_indptr[-1], num_qo_heads]`` float32 (natural log). ``sinks``,
        scales, ``enable_pdl`` and ``kv_scores`` (H2O's running scores, flashkern.kv_compress) as in
        BatchDecodeWithPagedKVCacheWrapper.run; ``window_left``: None or the plan's; ``kv_cache_sf`` and
        ``skip_softmax_threshold_scale_factor`` must be None; FlashInfer's ``use_fp16_softmax`` and
        ``uses_spcompress`` (its TensorRT-LLM kernels' options) None or False (flashkern's softmax is
        float32, its KV uncompressed)."""
        op = "BatchPrefillWithPagedKVCacheWrapper.run"
        reject_unsupported(op, kv_cache_sf=kv_cache_sf,
                           skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor)
        for name, value in (("use_fp16_softmax", use_fp16_softmax), ("uses_spcompress", uses_spcompress)):
            if value is not None and value is not False:
                raise ValueError(f"{op}: {name}={value!r} is not supported by flashkern (None or False: its softmax "
                                 f"is float32, its KV cache uncompressed)")
        return self._run_prefill(op, q, paged_kv_cache, None, args, q_scale, k_scale, v_scale, out, lse, return_lse,
                                 enable_pdl, window_left, sinks, kv_scores)

    run_return_lse = functools.partialmethod(run, return_lse=True)

    def forward(self, q, paged_kv_cache, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
                k_scale=None, v_scale=None, window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                rope_theta=None):
        """FlashInfer's deprecated run(): out. ``causal`` and ``window_left`` must be the plan's;
        ``logits_soft_cap`` and ``sm_scale``, when given, replace the plan's for this call."""
        return self._forward("BatchPrefillWithPagedKVCacheWrapper.forward", q, paged_kv_cache, None, causal,
                             pos_encoding_mode, k_scale, v_scale, window_left, logits_soft_cap, sm_scale, rope_scale,
                             rope_theta)[0]

    def forward_return_lse(self, q, paged_kv_cache, causal=False, pos_encoding_mode="NONE",
                           use_fp16_qk_reduction=False, k_scale=None, v_scale=None, window_left=-1,
                           logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None):
        """forward(), returning (out, lse)."""
        return self._forward("BatchPrefillWithPagedKVCacheWrapper.forward_return_lse", q, paged_kv_cache, None,
                             causal, pos_encoding_mode, k_scale, v_scale, window_left, logits_soft_cap, sm_scale,
                             rope_scale, rope_theta)


class BatchPrefillWithRaggedKVCacheWrapper(_Prefill):
    """Prefill attention with each request's keys and values contiguous in k and v (``[kv_indptr[-1],
    num_kv_heads, head_dim]``, NHD, or ``[num_kv_heads, kv_indptr[-1], head_dim]``, HND): request b's
    query tokens are rows ``qo_indptr[b]:qo_indptr[b+1]`` of q, its keys rows ``kv_indptr[b]:
    kv_indptr[b+1]`` of k and v. The kernels see k as a cache of one-token pages whose page table is
    the identity (never stored). Masks as in the module docstring.

    ``use_cuda_graph=True`` needs the fixed int32 buffers ``qo_indptr_buf`` and ``kv_indptr_buf`` (and
    ``custom_mask_buf`` for a custom mask)."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 kv_indptr_buf=None, custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None,
                 jit_kwargs=None):
        buffers = {"qo_indptr_buf": qo_indptr_buf, "kv_indptr_buf": kv_indptr_buf, "custom_mask_buf": custom_mask_buf,
                   "mask_indptr_buf": mask_indptr_buf}
        super().__init__("BatchPrefillWithRaggedKVCacheWrapper", float_workspace_buffer, kv_layout, use_cuda_graph,
                         buffers, backend, jit_args, jit_kwargs)

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None, custom_mask=None,
             packed_custom_mask=None, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
             window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, non_blocking=True, prefix_len_ptr=None,
             token_pos_in_items_ptr=None, token_pos_in_items_len=0, max_item_len_ptr=None, fixed_split_size=None,
             disable_split_kv=False, seq_lens=None, seq_lens_q=None, max_token_per_sequence=None, max_sequence_kv=None,
             v_indptr=None, o_indptr=None, *, batch_invariant=None):
        """Plan the batch (see BatchPrefillWithPagedKVCacheWrapper.plan; ``fixed_split_size`` counts
        tokens here). ``v_indptr`` / ``o_indptr`` (other layouts of v and out) must stay None."""
        self._plan_ragged("BatchPrefillWithRaggedKVCacheWrapper.plan", **_arguments(locals()))

    begin_forward = plan

    def _plan_ragged(self, op, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo,
                     custom_mask, packed_custom_mask, causal, pos_encoding_mode, use_fp16_qk_reduction, window_left,
                     logits_soft_cap, sm_scale, rope_scale, rope_theta, q_data_type, kv_data_type, o_data_type,
                     non_blocking, prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr,
                     fixed_split_size, disable_split_kv, seq_lens, seq_lens_q, max_token_per_sequence,
                     max_sequence_kv, v_indptr, o_indptr, dry_run=False, batch_invariant=None):
        reject_other_features(op, prefix_len_ptr=prefix_len_ptr, token_pos_in_items_ptr=token_pos_in_items_ptr,
                              token_pos_in_items_len=token_pos_in_items_len, max_item_len_ptr=max_item_len_ptr,
                              seq_lens=seq_lens, seq_lens_q=seq_lens_q, max_token_per_sequence=max_token_per_sequence,
                              max_sequence_kv=max_sequence_kv, v_indptr=v_indptr, o_indptr=o_indptr)
        kv_h, batch = host_indptr(op, "kv_indptr", kv_indptr)
        qo_h = host_int32(op, "qo_indptr", qo_indptr, batch + 1)
        lengths = (kv_h[1:] - kv_h[:-1]).long()
        if int(kv_h[0]) != 0 or bool((lengths < 0).any()):
            raise ValueError(f"{op}: kv_indptr must start at 0 and be non-decreasing, got {kv_h.tolist()}")
        last_h = (lengths > 0).to(torch.int32)  # one-token pages
        if not dry_run:
            self._fill(op, [("qo_indptr_buf", qo_indptr), ("kv_indptr_buf", kv_indptr)])
        no_indices = torch.empty(0, dtype=torch.int32)
        return self._plan_prefill(op, RAGGED_NAMES, qo_h, kv_h, no_indices, last_h, lengths, num_qo_heads,
                                  num_kv_heads, head_dim_qk, head_dim_vo, 1, custom_mask, packed_custom_mask, causal,
                                  pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap,
                                  rope_scale, rope_theta, q_data_type, kv_data_type, o_data_type, fixed_split_size,
                                  disable_split_kv, True, None if dry_run else no_indices.to(self._core._device),
                                  dry_run, batch_invariant)

    def run(self, q, k, v, *args, q_scale=None, k_scale=None, v_scale=None, o_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, kv_cache_sf=None, window_left=None, sinks=None):
        """q ``[qo_indptr[-1], num_qo_heads, head_dim]``, k and v in the wrapper's layout -> out, and
        (out, lse) with ``return_lse`` (as BatchPrefillWithPagedKVCacheWrapper.run; ``o_scale``
        multiplies the output as ``v_scale`` does)."""
        op = "BatchPrefillWithRaggedKVCacheWrapper.run"
        reject_unsupported(op, kv_cache_sf=kv_cache_sf)
        return self._run_prefill(op, q, ragged_kv(op, k, v, self._core._kv_layout), "NHD", args, q_scale, k_scale,
                                 v_scale, out, lse, return_lse, enable_pdl, window_left, sinks, o_scale=o_scale)

    run_return_lse = functools.partialmethod(run, return_lse=True)

    def forward(self, q, k, v, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, window_left=-1,
                logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None):
        """FlashInfer's deprecated run() (as BatchPrefillWithPagedKVCacheWrapper.forward): out."""
        op = "BatchPrefillWithRaggedKVCacheWrapper.forward"
        return self._forward(op, q, ragged_kv(op, k, v, self._core._kv_layout), "NHD", causal, pos_encoding_mode,
                             None, None, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)[0]

    def forward_return_lse(self, q, k, v, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
                           window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None):
        """forward(), returning (out, lse)."""
        op = "BatchPrefillWithRaggedKVCacheWrapper.forward_return_lse"
        return self._forward(op, q, ragged_kv(op, k, v, self._core._kv_layout), "NHD", causal, pos_encoding_mode,
                             None, None, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)


def _arguments(local_vars):
    """A method's arguments from its locals(), without self."""
    return {name: value for name, value in local_vars.items() if name not in ("self", "__class__")}


def reject_other_features(op, **options):
    """FlashInfer arguments of other backends and features (multi-item scoring, trtllm-gen, other
    output layouts): None (0 for token_pos_in_items_len) only."""
    for name, value in options.items():
        if value is not None and not (name == "token_pos_in_items_len" and value == 0):
            raise ValueError(f"{op}: {name} is not supported by flashkern (only {0 if name.endswith('_len') else None})")


def ragged_kv(op, k, v, kv_layout):
    """k and v (NHD ``[tokens, heads, D]`` or HND ``[heads, tokens, D]``) as a cache of one-token pages
    ``[tokens, 1, heads, D]`` (views)."""
    for name, t in (("k", k), ("v", v)):
        check_tensor(op, name, t)
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"{op}: k and v must be 3-D of one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if kv_layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    return k.unsqueeze(1), v.unsqueeze(1)


def single_prefill_with_kv_cache(q, k, v, scale_q=None, scale_k=None, scale_v=None, o_dtype=None, custom_mask=None,
                                 packed_custom_mask=None, causal=False, kv_layout="NHD", pos_encoding_mode="NONE",
                                 use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None,
                                 rope_scale=None, rope_theta=None, backend="auto", return_lse=False, kv_cache_sf=None,
                                 k_scale=None, v_scale=None, *, sinks=None):
    """Prefill attention of one request: q ``[qo_len, num_qo_heads, head_dim]``, k and v ``[kv_len,
    num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, kv_len, head_dim]`` (HND) -> out ``[qo_len,
    num_qo_heads, head_dim]`` (``o_dtype``, q's by default; and lse ``[qo_len, num_qo_heads]``,
    natural log, with ``return_lse``). Masks as in the module docstring; ``custom_mask`` bool
    ``[qo_len, kv_len]`` (or flattened), or ``packed_custom_mask``. ``k_scale`` multiplies sm_scale,
    ``v_scale`` the output; ``sinks`` as in BatchDecodeWithPagedKVCacheWrapper.run. The per-head fp8
    scales ``scale_q`` / ``scale_k`` / ``scale_v`` and ``kv_cache_sf`` must be None. float16 / bfloat16
    run the kernels (on a GPU); float32 and float64 run the reference on any device (models in full
    precision on the CPU path).

    Without a custom mask the plan for a shape is made once and kept (a few per device), so after one
    eager call with a shape, calls with that shape can be captured in a CUDA graph."""
    op = "single_prefill_with_kv_cache"
    reject_unsupported(op, pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale, rope_theta=rope_theta,
                       kv_cache_sf=kv_cache_sf)
    reject_other_features(op, scale_q=scale_q, scale_k=scale_k, scale_v=scale_v)
    k, v = single_request_kv(op, q, k, v, kv_layout, ("qo_len", "num_qo_heads", "head_dim"))
    qo_len, num_qo_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[:2]
    if custom_mask is not None and custom_mask.dim() == 2:
        custom_mask = custom_mask.reshape(-1)
    if q.dtype in (torch.float32, torch.float64):
        sm_scale = head_dim**-0.5 if sm_scale is None else scale_factor(op, "sm_scale", sm_scale)
        sm_scale *= kv_scale_arg(op, "k_scale", k_scale, k.dtype, num_kv_heads, k.device)[0]
        out, lse = _single_prefill_reference(op, q, k, v, custom_mask, packed_custom_mask, causal, sm_scale,
                                             window_left, logits_soft_cap, sinks)
        out = (out * kv_scale_arg(op, "v_scale", v_scale, k.dtype, num_kv_heads, k.device)[0]).to(o_dtype or q.dtype)
        return (out, lse) if return_lse else out
    if q.dtype not in ATTENTION_DTYPES:
        raise TypeError(f"{op}: q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    o_dtype = attention_dtype(op, "o_dtype", o_dtype, default=q.dtype)
    cap = soft_cap_value(op, logits_soft_cap)
    sm_scale = None if sm_scale is None else scale_factor(op, "sm_scale", sm_scale)
    if custom_mask is None and packed_custom_mask is None:
        wrapper = _single_plan(q.device, q.dtype, k.dtype, o_dtype, qo_len, kv_len, num_qo_heads, num_kv_heads,
                               head_dim, causal, sm_scale, window_left, cap, invariance.is_batch_invariant())
    else:
        wrapper = _plan_single(q.device, q.dtype, k.dtype, o_dtype, qo_len, kv_len, num_qo_heads, num_kv_heads,
                               head_dim, causal, sm_scale, window_left, cap, invariance.is_batch_invariant(),
                               custom_mask, packed_custom_mask)
    out, lse = wrapper._core._run(op, q, (k.unsqueeze(1), v.unsqueeze(1)), None, None, sinks, None, k_scale, v_scale,
                                  kv_layout="NHD")
    return (out, lse) if return_lse else out


single_prefill_with_kv_cache_return_lse = functools.partial(single_prefill_with_kv_cache, return_lse=True)


def _plan_single(device, dtype, kv_dtype, o_dtype, qo_len, kv_len, num_qo_heads, num_kv_heads, head_dim, causal,
                 sm_scale, window_left, cap, batch_invariant, custom_mask=None, packed_custom_mask=None):
    """A ragged wrapper planned for one request, with a workspace sized by a dry run of its plan."""
    i32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    qo, kv = i32([0, qo_len]), i32([0, kv_len])
    args = dict(custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal, sm_scale=sm_scale,
                window_left=window_left, logits_soft_cap=cap, q_data_type=dtype, kv_data_type=kv_dtype,
                o_data_type=o_dtype, batch_invariant=batch_invariant)
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(0, dtype=torch.uint8, device=device))
    nbytes = wrapper._plan_ragged(**_ragged_arguments(qo, kv, num_qo_heads, num_kv_heads, head_dim, args), dry_run=True)
    wrapper.reset_workspace_buffer(torch.empty(nbytes, dtype=torch.uint8, device=device))
    wrapper.plan(qo, kv, num_qo_heads, num_kv_heads, head_dim, **args)
    return wrapper


def _ragged_arguments(qo, kv, num_qo_heads, num_kv_heads, head_dim, args):
    """plan()'s arguments, with its defaults, for _plan_ragged."""
    import inspect

    bound = inspect.signature(BatchPrefillWithRaggedKVCacheWrapper.plan).bind(None, qo, kv, num_qo_heads,
                                                                             num_kv_heads, head_dim, **args)
    bound.apply_defaults()
    return {"op": "single_prefill_with_kv_cache", **_arguments(bound.arguments)}


_single_plan = functools.lru_cache(maxsize=32)(_plan_single)


def _single_prefill_reference(op, q, k, v, custom_mask, packed_custom_mask, causal, sm_scale, window_left,
                              logits_soft_cap, sinks):
    """float32 / float64: the reference, on any device: (out, lse) in the compute dtype."""
    qo_len, kv_len = q.shape[0], k.shape[0]
    lens = torch.tensor([qo_len]), torch.tensor([kv_len])
    mask = checked_mask(op, custom_mask, packed_custom_mask, *lens)
    if mask is not None:
        mask = ref.attention.unpack_mask_bits(mask, 0, qo_len * kv_len).view(qo_len, kv_len)
    check_window_left(op, window_left)
    sinks = sink_logits(op, sinks, q.shape[1], q.device)
    return ref.attention.prefill_attention(q, k, v, causal=causal, window_left=window_left,
                                           logits_soft_cap=soft_cap_value(op, logits_soft_cap), mask=mask,
                                           sm_scale=sm_scale, sinks=sinks)
