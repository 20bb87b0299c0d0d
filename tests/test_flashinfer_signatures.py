"""FlashInfer's signatures, as recorded facts, against flashkern's (inspect.signature).

FLASHINFER below holds, for every public FlashInfer function and wrapper method that flashkern
provides, FlashInfer's parameters: names, order, defaults, which are keyword-only, and *args. For
each one, flashkern's signature must accept every call FlashInfer's accepts, with the same meaning:
each FlashInfer positional parameter at the same position under the same name, each keyword-only
one by keyword, the same defaults (compared literally: "float16" is not torch.float16, False is
not 0; only 1 and 1.0 are the same), *args where FlashInfer has *args (right after the positional
parameters). flashkern may add parameters after FlashInfer's or as keyword-only, with defaults,
and may give a default to a parameter FlashInfer requires. A new FlashInfer parameter is a change
to one line of the table."""

import inspect

import pytest
import torch

import flashkern

# FlashInfer (github.com/flashinfer-ai/flashinfer, main, 2026), read from:
#   norm:       flashinfer/norm/__init__.py  @ 0040d23e6a5d7b1fc3c2cc1a1dc4a159a2e525e1
#   activation: flashinfer/activation.py     @ 0daa58bf3f1acec070b9467df640bc12664dc1db
#   rope:       flashinfer/rope/rope.py      @ 30315c17ac74e668a09ffaa785fa94a7a4cea2d7 (exported by rope/__init__.py)
#   cascade:    flashinfer/cascade.py        @ 01c897d7075594003c411c0aa5e3befdf0bcae94 (merge_state*, cascade wrapper)
#   decode:     flashinfer/decode.py         @ 002752ae3615318e75b95e2eeb716242233c0fdd
#   prefill:    flashinfer/prefill.py        @ 002920bf8256465171c95d76519ea1cf35244865
#   sampling:   flashinfer/sampling.py       @ 01c897d7075594003c411c0aa5e3befdf0bcae94
#   page:       flashinfer/page.py           @ 0478a48cdf32d0b5a4f84b4b9c9e21d51ea8972a
# single_prefill_with_kv_cache_return_lse is functools.partial(single_prefill_with_kv_cache,
# return_lse=True) in both libraries.
# BatchDecodeWithPagedKVCacheWrapper.plan is written as what it accepts: its literal signature is
# (indptr, ..., page_size, *deprecated_positional_args, **kwargs) since PR #3794; the optional
# parameters are still taken positionally (deprecated), in the order of _BATCH_DECODE_PLAN_LEGACY_POS_ARGS,
# with _plan_impl's defaults; window_right is keyword-only. run_return_lse is
# functools.partialmethod(run, return_lse=True); begin_forward = plan and (cascade) forward = run are
# aliases, while the decode wrapper's forward / forward_return_lse are separate deprecated methods.
ROPE = "rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4, backend='cuda'"
LLAMA31 = ("rotary_dim=None, interleave=False, rope_scale=8, rope_theta=5e5, low_freq_factor=1, high_freq_factor=4, "
           "old_context_len=8192, backend='cuda'")
COS_SIN = "positions, query, key, head_size, cos_sin_cache, is_neox=True, backend='cuda'"
CASCADE_PLAN = ("qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len, num_qo_heads, "
                "num_kv_heads, head_dim, page_size, causal=False, pos_encoding_mode='NONE', "
                "use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None, rope_scale=None, "
                "rope_theta=None, q_data_type='float16', kv_data_type=None")
DECODE_PLAN = ("indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, "
               "pos_encoding_mode='NONE', window_left=-1, logits_soft_cap=None, q_data_type='float16', "
               "kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None, "
               "non_blocking=True, block_tables=None, seq_lens=None, fixed_split_size=None, disable_split_kv=False, "
               "q_len_per_req=1, *, window_right=0")
DECODE_RUN = ("q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None, "
              "return_lse=False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=None, "
              "skip_softmax_threshold_scale_factor=None, kv_cache_sf=None")
DECODE_FORWARD = ("q, paged_kv_cache, pos_encoding_mode='NONE', q_scale=None, k_scale=None, v_scale=None, "
                  "window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None")

PREFILL_OPTIONS = ("custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode='NONE', "
                   "use_fp16_qk_reduction=False")
PAGED_PLAN_TAIL = ("prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len=0, max_item_len_ptr=None, "
                   "seq_lens=None, seq_lens_q=None, block_tables=None, max_token_per_sequence=None, "
                   "max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False")
PAGED_PLAN = ("qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads, "
              f"head_dim_qk, page_size, head_dim_vo=None, {PREFILL_OPTIONS}, sm_scale=None, window_left=-1, "
              "logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type='float16', kv_data_type=None, "
              f"o_data_type=None, non_blocking=True, {PAGED_PLAN_TAIL}")
PAGED_RUN = ("q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None, "
             "return_lse=False, enable_pdl=None, window_left=None, sinks=None, kv_cache_sf=None, "
             "skip_softmax_threshold_scale_factor=None")
PAGED_FORWARD = ("q, paged_kv_cache, causal=False, pos_encoding_mode='NONE', use_fp16_qk_reduction=False, "
                 "k_scale=None, v_scale=None, window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None, "
                 "rope_theta=None")
RAGGED_PLAN = (f"qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None, {PREFILL_OPTIONS}, "
               "window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None, "
               "q_data_type='float16', kv_data_type=None, o_data_type=None, non_blocking=True, prefix_len_ptr=None, "
               "token_pos_in_items_ptr=None, token_pos_in_items_len=0, max_item_len_ptr=None, fixed_split_size=None, "
               "disable_split_kv=False, seq_lens=None, seq_lens_q=None, max_token_per_sequence=None, "
               "max_sequence_kv=None, v_indptr=None, o_indptr=None")
RAGGED_RUN = ("q, k, v, *args, q_scale=None, k_scale=None, v_scale=None, o_scale=None, out=None, lse=None, "
              "return_lse=False, enable_pdl=None, kv_cache_sf=None")
RAGGED_FORWARD = ("q, k, v, causal=False, pos_encoding_mode='NONE', use_fp16_qk_reduction=False, window_left=-1, "
                  "logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None")
SINGLE_PREFILL = ("q, k, v, scale_q=None, scale_k=None, scale_v=None, o_dtype=None, custom_mask=None, "
                  "packed_custom_mask=None, causal=False, kv_layout='NHD', pos_encoding_mode='NONE', "
                  "use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None, rope_scale=None, "
                  "rope_theta=None, backend='auto', return_lse=False, kv_cache_sf=None, k_scale=None, v_scale=None")

RANDOM = "deterministic=True, generator=None, check_nan=False, seed=None, offset=None"
SAMPLE = f"indices=None, {RANDOM}, return_valid=False"
ORDERED = f"indices=None, filter_apply_order='top_k_first', {RANDOM}"

FLASHINFER = {
    "sampling_from_probs": f"probs, {SAMPLE}",
    "sampling_from_logits": f"logits, indices=None, {RANDOM}",
    "top_k_sampling_from_probs": f"probs, top_k, {SAMPLE}",
    "top_p_sampling_from_probs": f"probs, top_p, {SAMPLE}",
    "min_p_sampling_from_probs": f"probs, min_p, {SAMPLE}",
    "top_k_top_p_sampling_from_probs": f"probs, top_k, top_p, {ORDERED}, return_valid=False",
    "top_k_top_p_sampling_from_logits": f"logits, top_k, top_p, {ORDERED}",
    "softmax": "logits, temperature=None, enable_pdl=None",
    "top_k_renorm_probs": "probs, top_k, is_deterministic=False",
    "top_p_renorm_probs": "probs, top_p, is_deterministic=False",
    "top_k_mask_logits": "logits, top_k",
    "chain_speculative_sampling": "draft_probs, draft_token_ids, target_probs, maybe_output_accepted_token_num=None, "
                                  "maybe_output_emitted_draft_token_num=None, deterministic=True, generator=None, "
                                  "seed=None, offset=None",
    "rmsnorm": "input, weight, eps=1e-6, out=None, enable_pdl=None",
    "fused_add_rmsnorm": "input, residual, weight, eps=1e-6, enable_pdl=None",
    "gemma_rmsnorm": "input, weight, eps=1e-6, out=None, enable_pdl=None",
    "gemma_fused_add_rmsnorm": "input, residual, weight, eps=1e-6, enable_pdl=None",
    "silu_and_mul": "input, out=None, enable_pdl=None",
    "gelu_and_mul": "input, out=None, enable_pdl=None",
    "gelu_tanh_and_mul": "input, out=None, enable_pdl=None",
    "apply_rope": f"q, k, indptr, offsets, {ROPE}",
    "apply_rope_inplace": f"q, k, indptr, offsets, {ROPE}",
    "apply_rope_pos_ids": f"q, k, pos_ids, {ROPE}",
    "apply_rope_pos_ids_inplace": f"q, k, pos_ids, {ROPE}",
    "apply_llama31_rope": f"q, k, indptr, offsets, {LLAMA31}",
    "apply_llama31_rope_inplace": f"q, k, indptr, offsets, {LLAMA31}",
    "apply_llama31_rope_pos_ids": f"q, k, pos_ids, {LLAMA31}",
    "apply_llama31_rope_pos_ids_inplace": f"q, k, pos_ids, {LLAMA31}",
    "apply_rope_with_cos_sin_cache": COS_SIN,
    "apply_rope_with_cos_sin_cache_inplace": COS_SIN,
    "merge_state": "v_a, s_a, v_b, s_b",
    "merge_state_in_place": "v, s, v_other, s_other, mask=None",
    "merge_states": "v, s",
    "append_paged_kv_cache": "append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, "
                             "kv_indptr, kv_last_page_len, kv_layout='NHD'",
    "get_batch_indices_positions": "append_indptr, seq_lens, nnz",
    "single_decode_with_kv_cache": "q, k, v, kv_layout='NHD', pos_encoding_mode='NONE', use_tensor_cores=False, "
                                   "q_scale=None, k_scale=None, v_scale=None, window_left=-1, logits_soft_cap=None, "
                                   "sm_scale=None, rope_scale=None, rope_theta=None, return_lse=False",
    "BatchDecodeWithPagedKVCacheWrapper.__init__": "float_workspace_buffer, kv_layout='NHD', use_cuda_graph=False, "
                                                   "use_tensor_cores=False, paged_kv_indptr_buffer=None, "
                                                   "paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None, "
                                                   "backend='auto', jit_args=None",
    "BatchDecodeWithPagedKVCacheWrapper.reset_workspace_buffer": "float_workspace_buffer, int_workspace_buffer",
    "BatchDecodeWithPagedKVCacheWrapper.plan": DECODE_PLAN,
    "BatchDecodeWithPagedKVCacheWrapper.begin_forward": DECODE_PLAN,
    "BatchDecodeWithPagedKVCacheWrapper.run": DECODE_RUN,
    "BatchDecodeWithPagedKVCacheWrapper.run_return_lse": DECODE_RUN.replace("return_lse=False", "return_lse=True"),
    "BatchDecodeWithPagedKVCacheWrapper.forward": DECODE_FORWARD,
    "BatchDecodeWithPagedKVCacheWrapper.forward_return_lse": DECODE_FORWARD,
    "BatchDecodeWithPagedKVCacheWrapper.end_forward": "",
    "BatchDecodeWithPagedKVCacheWrapper.workspace_size": DECODE_PLAN.replace("non_blocking=True, ", "").replace(
        ", *, window_right=0", ""),
    "MultiLevelCascadeAttentionWrapper.__init__": "num_levels, float_workspace_buffer, kv_layout='NHD', "
                                                  "use_cuda_graph=False, qo_indptr_buf_arr=None, "
                                                  "paged_kv_indptr_buf_arr=None, paged_kv_indices_buf_arr=None, "
                                                  "paged_kv_last_page_len_buf_arr=None",
    "MultiLevelCascadeAttentionWrapper.reset_workspace_buffer": "float_workspace_buffer, int_workspace_buffers",
    "MultiLevelCascadeAttentionWrapper.plan": CASCADE_PLAN,
    "MultiLevelCascadeAttentionWrapper.begin_forward": CASCADE_PLAN,
    "MultiLevelCascadeAttentionWrapper.run": "q, paged_kv_cache",
    "MultiLevelCascadeAttentionWrapper.forward": "q, paged_kv_cache",
    "single_prefill_with_kv_cache": SINGLE_PREFILL,
    # a partial binding return_lse by keyword: it and every parameter after it become keyword-only
    "single_prefill_with_kv_cache_return_lse": SINGLE_PREFILL.replace("return_lse=False", "*, return_lse=True"),
    "BatchPrefillWithPagedKVCacheWrapper.__init__": "float_workspace_buffer, kv_layout='NHD', use_cuda_graph=False, "
                                                    "qo_indptr_buf=None, paged_kv_indptr_buf=None, "
                                                    "paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None, "
                                                    "custom_mask_buf=None, mask_indptr_buf=None, backend='auto', "
                                                    "jit_args=None, jit_kwargs=None",
    "BatchPrefillWithPagedKVCacheWrapper.reset_workspace_buffer": "float_workspace_buffer, int_workspace_buffer",
    "BatchPrefillWithPagedKVCacheWrapper.plan": PAGED_PLAN,
    "BatchPrefillWithPagedKVCacheWrapper.begin_forward": PAGED_PLAN,
    "BatchPrefillWithPagedKVCacheWrapper.workspace_size": PAGED_PLAN.replace("non_blocking=True, ", ""),
    "BatchPrefillWithPagedKVCacheWrapper.run": PAGED_RUN,
    "BatchPrefillWithPagedKVCacheWrapper.run_return_lse": PAGED_RUN.replace("return_lse=False", "return_lse=True"),
    "BatchPrefillWithPagedKVCacheWrapper.forward": PAGED_FORWARD,
    "BatchPrefillWithPagedKVCacheWrapper.forward_return_lse": PAGED_FORWARD,
    "BatchPrefillWithPagedKVCacheWrapper.end_forward": "",
    "BatchPrefillWithRaggedKVCacheWrapper.__init__": "float_workspace_buffer, kv_layout='NHD', use_cuda_graph=False, "
                                                     "qo_indptr_buf=None, kv_indptr_buf=None, custom_mask_buf=None, "
                                                     "mask_indptr_buf=None, backend='auto', jit_args=None, "
                                                     "jit_kwargs=None",
    "BatchPrefillWithRaggedKVCacheWrapper.reset_workspace_buffer": "float_workspace_buffer, int_workspace_buffer",
    "BatchPrefillWithRaggedKVCacheWrapper.plan": RAGGED_PLAN,
    "BatchPrefillWithRaggedKVCacheWrapper.begin_forward": RAGGED_PLAN,
    "BatchPrefillWithRaggedKVCacheWrapper.run": RAGGED_RUN,
    "BatchPrefillWithRaggedKVCacheWrapper.run_return_lse": RAGGED_RUN.replace("return_lse=False", "return_lse=True"),
    "BatchPrefillWithRaggedKVCacheWrapper.forward": RAGGED_FORWARD,
    "BatchPrefillWithRaggedKVCacheWrapper.forward_return_lse": RAGGED_FORWARD,
    "BatchPrefillWithRaggedKVCacheWrapper.end_forward": "",
}

# flashkern's public names that FlashInfer does not have (so not in the table).
FLASHKERN_ONLY = {"act_mul", "batch_invariant", "check", "clip_grad_norm_", "cos_sin_cache", "get_backend", "info",
                  "is_batch_invariant", "ref", "rope_frequencies", "rope_frequencies_from_config", "set_backend",
                  "set_batch_invariant"}

P = inspect.Parameter
ACCEPTS_NAME = (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)


def recorded(params):
    """The signature a table entry describes (its defaults are literals; torch for the checker's own test)."""
    namespace = {"torch": torch}
    exec(f"def f({params}): pass", namespace)
    return inspect.signature(namespace["f"])


def flashkern_signature(name):
    obj = flashkern
    for part in name.split("."):
        obj = getattr(obj, part)
    signature = inspect.signature(obj)
    return signature.replace(parameters=[p for p in signature.parameters.values() if p.name != "self"])


def same_default(expected, found):
    if expected is P.empty:  # FlashInfer requires it: flashkern may give it a default
        return True
    numbers = (int, float)
    if isinstance(expected, numbers) and isinstance(found, numbers) and bool not in (type(expected), type(found)):
        return expected == found
    return type(expected) is type(found) and expected == found


def show(default):
    return "no default" if default is P.empty else repr(default)


def mismatches(expected, found):
    """Why `found` (flashkern) does not accept every call `expected` (FlashInfer) accepts: [] when it does."""
    problems = []
    exp, got = list(expected.parameters.values()), list(found.parameters.values())
    by_name, kwargs = {p.name: p for p in got}, any(p.kind == P.VAR_KEYWORD for p in got)
    positional = [p for p in exp if p.kind == P.POSITIONAL_OR_KEYWORD]
    for i, e in enumerate(positional):
        g = got[i] if i < len(got) else None
        if g is None or g.kind != P.POSITIONAL_OR_KEYWORD or g.name != e.name:
            problems.append(f"position {i}: expected {e.name!r}, found {str(g) if g else 'nothing'!r}")
            break  # the later positions are off too
        if not same_default(e.default, g.default):
            problems.append(f"{e.name}: default {show(e.default)} expected, found {show(g.default)}")
    for e in (p for p in exp if p.kind == P.KEYWORD_ONLY):
        g = by_name.get(e.name)
        if g is None or g.kind not in ACCEPTS_NAME:
            problems.append(f"{e.name}: keyword-only parameter missing" + (" (only **kwargs)" if kwargs else ""))
        elif not same_default(e.default, g.default):
            problems.append(f"{e.name}: default {show(e.default)} expected, found {show(g.default)}")
    for kind, where in ((P.VAR_POSITIONAL, len(positional)), (P.VAR_KEYWORD, None)):
        if any(p.kind == kind for p in exp):
            at = [i for i, p in enumerate(got) if p.kind == kind]
            if not at:
                problems.append(f"{'*args' if kind == P.VAR_POSITIONAL else '**kwargs'} missing")
            elif where is not None and at[0] != where:
                problems.append(f"*args at position {at[0]}, expected right after the {where} positional parameters")
    names = {p.name for p in exp}
    for g in got:
        if g.name not in names and g.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD) and g.default is P.empty:
            problems.append(f"{g.name}: a parameter FlashInfer does not have, without a default")
    return problems


@pytest.mark.parametrize("name", FLASHINFER)
def test_flashinfer_signature(name):
    problems = mismatches(recorded(FLASHINFER[name]), flashkern_signature(name))
    assert not problems, f"flashkern.{name}{flashkern_signature(name)}: " + "; ".join(problems)


def test_table_covers_flashkern():
    """Every public flashkern name, and every public method of its wrappers, is in the table or flashkern's own."""
    missing = []
    for name in set(flashkern.__all__) - FLASHKERN_ONLY:
        obj = getattr(flashkern, name)
        if not inspect.isclass(obj):
            missing += [name] if name not in FLASHINFER else []
            continue
        for attr, value in vars(obj).items():
            if (attr == "__init__" or not attr.startswith("_")) and not isinstance(value, property):
                missing += [f"{name}.{attr}"] if f"{name}.{attr}" not in FLASHINFER else []
    assert not missing, f"not in FLASHINFER (or FLASHKERN_ONLY): {sorted(missing)}"


REFERENCE = "q, k, eps=1e-6, scale=1, *args, dtype='float16', flag=False"
ACCEPTED = [
    "q, k, eps=1e-6, scale=1.0, *args, dtype='float16', flag=False",  # 1 and 1.0
    "q, k=None, eps=1e-6, scale=1, *args, dtype='float16', flag=False, extra=None",  # a default, an extra keyword
    "q, k, eps=1e-6, scale=1, *args, flag=False, dtype='float16', **kwargs",  # keyword-only order is free
]
REJECTED = {
    "renamed": "q, key, eps=1e-6, scale=1, *args, dtype='float16', flag=False",
    "reordered": "k, q, eps=1e-6, scale=1, *args, dtype='float16', flag=False",
    "positional-only": "q, k, /, eps=1e-6, scale=1, *args, dtype='float16', flag=False",
    "other default": "q, k, eps=1e-5, scale=1, *args, dtype='float16', flag=False",
    "no default": "q, k, eps, scale=1, *args, dtype='float16', flag=False",
    "torch dtype for a string": "q, k, eps=1e-6, scale=1, *args, dtype=torch.float16, flag=False",
    "0 for False": "q, k, eps=1e-6, scale=1, *args, dtype='float16', flag=0",
    "keyword-only missing": "q, k, eps=1e-6, scale=1, *args, flag=False",
    "only through **kwargs": "q, k, eps=1e-6, scale=1, *args, **kwargs",
    "no *args": "q, k, eps=1e-6, scale=1, *, dtype='float16', flag=False",
    "*args after an extra": "q, k, eps=1e-6, scale=1, extra=None, *args, dtype='float16', flag=False",
    "*args for a positional": "q, k, *args, eps=1e-6, scale=1, dtype='float16', flag=False",
    "extra without default": "q, k, eps=1e-6, scale=1, *args, dtype='float16', flag=False, more",
}


@pytest.mark.parametrize("params", ACCEPTED)
def test_checker_accepts(params):
    assert mismatches(recorded(REFERENCE), recorded(params)) == []


@pytest.mark.parametrize("case", REJECTED)
def test_checker_rejects(case):
    assert mismatches(recorded(REFERENCE), recorded(REJECTED[case]))
