// Every flashkern op's schema, in one place: registration.cpp defines them as torch.ops.flashkern,
// and the emulated kernels (gpu_ops.cpp built with FLASHKERN_EMULATED_OPS) as their own namespace.
#pragma once

#include <torch/library.h>

namespace flashkern {

inline void define_schemas(torch::Library& m) {
  // out = input * rsqrt(mean(input^2, -1) + eps) * (weight + weight_offset). enable_pdl (here and
  // below): launch as a programmatic dependent launch where the GPU has it (platform.h)
  m.def("rmsnorm(Tensor input, Tensor weight, float eps, float weight_offset, bool enable_pdl=False) -> Tensor");
  m.def(
      "rmsnorm_out(Tensor(a!) out, Tensor input, Tensor weight, float eps, float weight_offset, "
      "bool enable_pdl=False) -> ()");
  // residual += input; input = rmsnorm(residual)
  m.def(
      "fused_add_rmsnorm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps, float weight_offset, "
      "bool enable_pdl=False) -> ()");
  m.def(
      "rmsnorm_backward(Tensor grad_out, Tensor input, Tensor weight, float eps, float weight_offset) "
      "-> (Tensor grad_input, Tensor grad_weight)");
  // out = act(input[..., :d]) * input[..., d:], act in {silu, gelu, gelu_tanh}
  m.def("act_and_mul(Tensor input, str activation, bool enable_pdl=False) -> Tensor");
  m.def("act_and_mul_out(Tensor(a!) out, Tensor input, str activation, bool enable_pdl=False) -> ()");
  m.def("act_and_mul_backward(Tensor grad_out, Tensor input, str activation) -> Tensor");
  // out = act(gate) * up: act_and_mul with the halves as two tensors (no concatenation)
  m.def("act_mul(Tensor gate, Tensor up, str activation) -> Tensor");
  m.def("act_mul_backward(Tensor grad_out, Tensor gate, Tensor up, str activation) -> (Tensor grad_gate, Tensor grad_up)");
  // rotary position embedding of q [tokens, q_heads, head_dim] and k [tokens, k_heads, head_dim] at
  // positions [tokens]; freqs: inv_freq [rotary_dim / 2] or cos_sin_cache [max_position, rotary_dim]
  m.def(
      "rope(Tensor q, Tensor k, Tensor positions, Tensor freqs, bool interleave, bool inverse) "
      "-> (Tensor q_out, Tensor k_out)");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor freqs, bool interleave) -> ()");
  // attention states (v [tokens, heads, head_dim], s = natural-log sum-exp [tokens, heads] float32)
  m.def("merge_state(Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b) -> (Tensor v, Tensor s)");
  m.def("merge_state_in_place(Tensor(a!) v, Tensor(b!) s, Tensor v_other, Tensor s_other, Tensor? mask) -> ()");
  m.def("merge_states(Tensor v, Tensor s) -> (Tensor v_merged, Tensor s_merged)");
  // attention over a paged KV cache as planned in `workspace` (attention_work.h): q [batch, qo_heads,
  // head_dim], k_cache and v_cache [pages, page_size, kv_heads, head_dim] (views of the cache), one
  // kv_indices per level; writes out [batch, qo_heads, head_dim] (float16 or bfloat16, either for
  // either q) and lse [batch, qo_heads] (natural log). grid: blocks for the decode, 16-row and 64-row
  // kernels and (0 or 1) the merge. sinks: [qo_heads] float32 sink logits; out_scale scales out;
  // custom_mask: uint8, the plan's masks as little-endian bits; logits_soft_cap > 0: cap * tanh(x / cap);
  // logits: float32 [batch, qo_heads, L], the decode and 16-row kernels' logits (base 2) for kv_scores.
  // k_cache / v_cache may be fp8 (q stays 16-bit), with k_scale / v_scale [kv_heads] float32 multiplying
  // its K (the logit) and V (the output) per KV head.
  m.def(
      "batch_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor[] kv_indices, Tensor(a!) workspace, "
      "Tensor(b!) out, Tensor(c!) lse, int[] grid, float sm_scale, Tensor? sinks=None, float out_scale=1.0, "
      "bool enable_pdl=False, Tensor? custom_mask=None, float logits_soft_cap=0.0, Tensor(d!)? logits=None, "
      "Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  // one token per row of probs [rows, vocab] float32 (or per indices entry): filter 'none', 'top_k',
  // 'top_p', 'min_p' or 'top_k_top_p' (joint), each parameter a scalar or a [batch] tensor; random
  // numbers from Philox keyed by seed and offset (values or [1] / [batch] int64 tensors). Returns the
  // tokens (int32, or indices' dtype) and whether each row had mass to sample from.
  m.def(
      "sampling(Tensor probs, Tensor? indices, str filter, Tensor? top_k_arr, int top_k, Tensor? top_p_arr, "
      "float top_p, Tensor? min_p_arr, float min_p, Tensor? seed_arr, int seed, Tensor? offset_arr, int offset) "
      "-> (Tensor samples, Tensor valid)");
  // kind 'top_k_probs' / 'top_p_probs': keep the top-k / top-p probabilities and renormalize;
  // 'top_k_logits': the others become -inf
  m.def("renorm(Tensor input, str kind, Tensor? top_k_arr, int top_k, Tensor? top_p_arr, float top_p) -> Tensor");
  // softmax(logits / temperature) per row of logits [rows, vocab], as float32 probabilities; the
  // temperature a [rows] float32 tensor or one value
  m.def("softmax(Tensor logits, Tensor? temperature_arr, float temperature, bool enable_pdl) -> Tensor");
  // speculative verification along a tree of candidates (ops.h: SpeculativeParams); mode 'greedy'
  // (target logits) or 'sample' (target, and draft, probabilities); parents None: a chain.
  // Returns tokens [batch, nodes] and accepted nodes [batch, nodes - 1] (-1 padded), the number
  // accepted [batch] and, for a sampled chain, how many draft tokens pass their own test [batch].
  m.def(
      "speculative(Tensor target, Tensor? draft, Tensor candidates, int first_candidate, Tensor? parents, str mode, "
      "Tensor? seed_arr, int seed, Tensor? offset_arr, int offset) "
      "-> (Tensor tokens, Tensor nodes, Tensor num_accepted, Tensor independent_accepted)");
  // KV-cache compression (ops.h: KvScoresParams, KvSelectParams, KvCompactParams). Caches are views
  // [pages, page_size, kv_heads, head_dim]; scores float32 [pages, kv_heads, page_size]; page tables
  // int32 CSR (kv_indptr, kv_indices, kv_last_page_len). kv_scores adds (accumulate) or writes the
  // attention probabilities of q's queries (per request the last tokens, qo_indptr) from their lse;
  // logits: batch_attention's (in place of q . k: no read of q or K);
  // kv_select returns kept positions [num_kept, kv_heads], num_kept = kept_indptr[-1]; kv_compact moves
  // the kept keys, values and scores to positions 0.. of the pages out_indices[out_indptr[b]..].
  m.def(
      "kv_scores(Tensor q, Tensor lse, Tensor k_cache, Tensor qo_indptr, Tensor kv_indptr, Tensor kv_indices, "
      "Tensor kv_last_page_len, Tensor(a!) scores, int max_kv_len, float sm_scale, float scale, bool causal, "
      "int window_left, float logits_soft_cap, bool accumulate, Tensor? logits=None) -> ()");
  m.def(
      "kv_select(Tensor scores, Tensor kv_indptr, Tensor kv_indices, Tensor kv_last_page_len, Tensor kept_indptr, "
      "int num_kept, int window, int keep_first, int kernel_size) -> Tensor");
  m.def(
      "kv_compact(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!)? scores, Tensor kv_indptr, Tensor kv_indices, "
      "Tensor kept, Tensor kept_indptr, Tensor out_indptr, Tensor out_indices) -> ()");
  // FlashInfer's append_paged_kv_cache (ops.h: AppendPagedKvParams): token i of append_key / append_value
  // [nnz, kv_heads, head_dim] to position positions[i] of request batch_indices[i] in k_cache / v_cache,
  // views [pages, page_size, kv_heads, head_dim] of the cache: float16 / bfloat16 as the input (copied) or
  // fp8 (x / scale, saturated, round to nearest even; scale k_scale[head] or k_scale_value, the same for v).
  m.def(
      "append_paged_kv_cache(Tensor append_key, Tensor append_value, Tensor batch_indices, Tensor positions, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor kv_indices, Tensor kv_indptr, Tensor kv_last_page_len, "
      "Tensor? k_scale=None, Tensor? v_scale=None, float k_scale_value=1.0, float v_scale_value=1.0) -> ()");
  // tensor parallelism: every rank of a group calls it at once. peers: each rank's workspace (symmetric
  // memory, ops.h: CommLayout) at its address in this process; this rank's is `workspace` (peers[rank]
  // is not read). residual_in None: out = the sum over the
  // ranks of input; else residual_out = residual_in + the sum, norm_out = rmsnorm of it (fp32 sum).
  m.def(
      "allreduce_fusion(Tensor input, Tensor? residual_in, Tensor? weight, Tensor(a!)? out, Tensor(b!)? residual_out, "
      "Tensor(c!)? norm_out, Tensor(d!) workspace, int[] peers, int rank, bool two_shot, float eps, "
      "float weight_offset, bool enable_pdl=False) -> ()");
  // The gradient norm of many tensors at once (kernels/optim.cuh): the p-norm over all their elements
  // (norm_type 1, 2, any p > 0 or inf), each tensor's norm, with a max_norm the clip coefficients
  // min(1, max_norm / (norm + 1e-6)) of the total ([1]) or of each tensor (per_tensor; else [0]), and
  // found_inf (1.0 when the total is not finite). table / table_host: the device table of the
  // tensors' addresses (_C.OPTIM_TABLE_ENTRY_BYTES a tensor) and its host copy, rewritten only when
  // an address changes, which allow_upload=False (a CUDA graph being captured) makes an error.
  m.def(
      "grad_norm(Tensor[] tensors, float norm_type, float? max_norm, bool per_tensor, Tensor(a!) table, "
      "Tensor(b!) table_host, bool allow_upload=True) "
      "-> (Tensor total_norm, Tensor tensor_norms, Tensor clip_coef, Tensor found_inf)");
  // AdamW over many tensors (ops.h: AdamWParams), in place: params, exp_avgs and exp_avg_sqs (float32),
  // masters (none, or one per param: a float32 master copy, or an empty tensor for none) and steps
  // (float32 [1] each); each grad times clip_coef ([1], or one per tensor); found_inf != 0 skips all.
  m.def(
      "adamw(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] masters, Tensor(e!)[] steps, Tensor? lr_tensor, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool maximize, Tensor? clip_coef, bool per_tensor_clip, Tensor? found_inf, "
      "Tensor(f!) table, Tensor(g!) table_host, bool allow_upload=True) -> ()");
}

}  // namespace flashkern
