// The launch interface between the torch glue (csrc/torch/) and the kernels (csrc/cuda/,
// csrc/hip/): one params struct and one launch function per op, plain pointers, no torch and no
// GPU runtime types. Launchers enqueue on `stream`, never synchronize, and return nullptr or the
// runtime's error string.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashkern/activations.h"
#include "flashkern/attention_work.h"
#include "flashkern/divmod.h"
#include "flashkern/numeric.h"
#include "flashkern/rows.h"

namespace fk {

enum class DType : int { f32 = 0, f16 = 1, bf16 = 2 };

// Launch geometry limits of the row-wise kernels (rows.h: plan_rows), here so that host tests
// can check the plans the kernels will get. {max block threads, max vectors per thread kept in
// registers, target vectors per thread, target threads per block for short rows}
// 512 threads leave each thread up to 128 registers: 8 vectors of the row (and, fused, of the
// residual) in flight without spilling; rows up to 512 * 8 vectors (32K bf16, 16K fp32) are read once.
// Kernels whose loads take 32 registers or fewer are held to 64 (kernels/rmsnorm.cuh), for occupancy.
inline constexpr RowPlanLimits kRmsnormLimits{512, 8, 4, 256};
// The fused add keeps each element's fp32 sum in registers (twice a 16-bit element's room): half the vectors,
// and it aims at 2 a thread (4 loads in flight with the residual's; 64 registers: kernels/rmsnorm.cuh).
inline constexpr RowPlanLimits kFusedRmsnormLimits{512, 4, 2, 256};
// The backward keeps x, dy and the dw partial sums of its columns in registers: fewer of each.
inline constexpr RowPlanLimits kRmsnormBackwardLimits{512, 4, 2, 256};

// out = input * rsqrt(mean(input^2) + eps) * (weight + weight_offset), rows of `cols` elements.
// With `residual`: s = input + residual in fp32; residual = s rounded to the dtype, and the norm
// is of the unrounded s (FlashInfer's arithmetic).
struct RmsnormParams {
  void* out;              // [rows, cols] dtype
  const void* input;      // [rows, cols] dtype
  void* residual;         // [rows, cols] dtype, or nullptr
  const void* weight;     // [cols] weight_dtype, contiguous
  RowLayout out_rows, input_rows, residual_rows;
  int64_t rows, cols;
  DType dtype, weight_dtype;
  float eps, weight_offset;
  bool pdl;  // a programmatic dependent launch where the device has it (platform.h)
};

struct RmsnormBackwardParams {
  void* grad_input;        // [rows, cols] dtype
  void* grad_weight;       // [cols] weight_dtype
  float* workspace;        // rmsnorm_backward_workspace_bytes(), from the caller's allocator
  const void* grad_out;    // [rows, cols] dtype
  const void* input;       // [rows, cols] dtype
  const void* weight;      // [cols] weight_dtype
  RowLayout grad_input_rows, grad_out_rows, input_rows;
  int64_t rows, cols;
  DType dtype, weight_dtype;
  float eps, weight_offset;
};

// out = act(gate) * up: for act_and_mul, gate = input[:, :cols] and up = input[:, cols:] (the same
// layout, cols further on); for act_mul, two tensors.
struct ActAndMulParams {
  void* out;         // [rows, cols] dtype
  const void* gate;  // [rows, cols] dtype
  const void* up;    // [rows, cols] dtype
  RowLayout out_rows, gate_rows, up_rows;
  int64_t rows, cols;
  DType dtype;
  Activation act;
  bool pdl;  // a programmatic dependent launch where the device has it (platform.h)
};

// grad_gate = dy * up * act'(gate), grad_up = dy * act(gate)
struct ActAndMulBackwardParams {
  void* grad_gate;       // [rows, cols] dtype
  void* grad_up;         // [rows, cols] dtype
  const void* grad_out;  // [rows, cols] dtype
  const void* gate;      // [rows, cols] dtype
  const void* up;        // [rows, cols] dtype
  RowLayout grad_gate_rows, grad_up_rows, grad_out_rows, gate_rows, up_rows;
  int64_t rows, cols;
  DType dtype;
  Activation act;
};

// Rotary position embedding of q [tokens, q_heads, head_dim] and k [tokens, k_heads, head_dim]:
// each pair (x1, x2) of the first rotary_dim dimensions of a head turns by angle a:
//   (x1 cos a - x2 sin a, x2 cos a + x1 sin a)       (inverse: by -a; the backward of a rotation)
// pairs are (i, i + rotary_dim / 2) (NeoX, "rotate half") or (2i, 2i + 1) (GPT-J, interleave).
// a = float(position) * inv_freq[i] in fp32 (inv_freq [rotary_dim / 2]), or cos a and sin a come
// from cos_sin_cache[position] = [cos... | sin...] ([cache_rows, rotary_dim]). Dimensions past
// rotary_dim are copied (out of place) or left alone (in place: out == input).
struct RopeParams {
  void* q_out;                 // [tokens, q_heads, head_dim] dtype
  void* k_out;                 // [tokens, k_heads, head_dim] dtype
  const void* q;               // [tokens, q_heads, head_dim] dtype
  const void* k;               // [tokens, k_heads, head_dim] dtype
  const void* positions;       // [tokens] int32 or int64
  const float* inv_freq;       // [rotary_dim / 2], or nullptr
  const float* cos_sin_cache;  // [cache_rows, rotary_dim], or nullptr
  int64_t q_out_strides[2], k_out_strides[2], q_strides[2], k_strides[2];  // token, head (elements)
  int64_t tokens, cache_rows;
  int q_heads, k_heads, head_dim, rotary_dim;
  bool positions_int64, interleave, inverse;
  bool in_place;  // q_out == q and k_out == k: the dimensions past rotary_dim are left alone
  DType dtype;
};

// Merge attention states (attention_state.h) per (token, head): the `num_states` states of a
// stacked v [tokens, num_states, heads, head_dim] / s [tokens, num_states, heads], then, if given,
// one more state from v_other / s_other ([tokens, heads, head_dim] / [tokens, heads]).
// Tokens whose mask entry is false keep state 0 unchanged (merge_state_in_place's mask).
struct MergeStatesParams {
  void* v_out;                // [tokens, heads, head_dim] dtype
  float* s_out;               // [tokens, heads]
  const void* v;              // [tokens, num_states, heads, head_dim] dtype
  const float* s;             // [tokens, num_states, heads]
  const void* v_other;        // [tokens, heads, head_dim] dtype, or nullptr
  const float* s_other;       // [tokens, heads], or nullptr
  const bool* mask;           // [tokens], or nullptr
  int64_t v_strides[3], s_strides[3];  // token, state, head (elements; v's head_dim is contiguous)
  int64_t v_other_strides[2], s_other_strides[2], v_out_strides[2], s_out_strides[2];  // token, head
  int64_t tokens;
  int num_states, heads, head_dim;
  DType dtype;
};

// Attention over a paged KV cache, as planned in the workspace (attention_work.h): per query t
// and q head h, softmax(q[t, h] . K^T * sm_scale) V over the KV of every group that t belongs
// to (causal groups: the tokens up to t's diagonal), with lse = the natural-log sum-exp of the
// scaled logits. K and V of KV head h / group_size. With sinks, head h's softmax has one more
// logit, sinks[h], whose value is zero (attention_state.h: final_state); out is scaled by out_scale.
struct BatchAttentionParams {
  void* out;                     // [batch, qo_heads, head_dim] out_dtype, contiguous
  float* lse;                    // [batch, qo_heads], contiguous
  const void* q;                 // [batch, qo_heads, head_dim] dtype, 16-byte aligned rows
  int64_t q_strides[2];          // batch, head (elements)
  const void* k_cache;           // [num_pages, page_size, kv_heads, head_dim] dtype (or fp8), aligned rows
  const void* v_cache;           // the same shape
  int64_t k_strides[3], v_strides[3];  // page, slot in page, head (elements)
  int64_t num_pages;             // a page index outside [0, num_pages) makes its query's output NaN
  const int32_t* kv_indices[kMaxLevels];  // each level's page indices
  int32_t kv_indices_len[kMaxLevels];     // their entries (0: no such level); a plan naming an entry past
                                          // them (a plan made for other page tables) makes its query NaN
  const int32_t* plan;           // the workspace's int32 words: PlanHeader, items, merge lists
  float* partial_s;              // [slot_capacity, qo_heads] (workspace)
  float* partial_v;              // [slot_capacity, qo_heads, head_dim] (workspace)
  int grid[4];                   // blocks for the decode, tile16 and tile64 kernels; the merge: 0 or 1
  int batch, qo_heads, kv_heads, head_dim, page_size;
  Divmod page_div;               // by page_size
  const float* sinks;            // [qo_heads] sink logits, or nullptr
  const uint8_t* custom_mask;    // the custom masks' bits (little-endian in each byte), or nullptr
  int64_t custom_mask_bytes;     // a bit past them (a plan made for another mask) hides its token
  float sm_scale;
  float logits_soft_cap;         // > 0: logits are cap * tanh(logit / cap) (Gemma2); 0: none
  float out_scale;               // FlashInfer's v_scale: 1 for plain attention
  DType dtype;                   // q, and the cache unless it is fp8: f16 or bf16
  int kv_format;                 // -1: the cache holds dtype; else an fp8 cache's numeric::Fp8 (strides in its
                                 // 1-byte elements, rows 16-byte aligned)
  const float* k_scale;          // [kv_heads] an fp8 cache's dequantization scales (read on the device), or nullptr
  const float* v_scale;          //   (a scalar scale is folded into sm_scale / out_scale by the caller)
  DType out_dtype;               // f16 or bf16 (o_data_type)
  bool pdl;                      // programmatic dependent launches where the device has them (platform.h)
  // kv_scores' epilogue: [queries, qo_heads, logits_stride] float32, or nullptr. The decode and 16-row
  // kernels write there the logit of every key a query sees (base 2: the natural logit, after the soft
  // cap, times log2 e), at the key's position in its sequence; the 64-row kernel writes none. Only for a
  // plan of one level without a custom mask or 64-row tiles (the glue checks), and the caller sizes
  // logits_stride to the plan's longest request (the kernels do not check it).
  float* logits;
  int64_t logits_stride;
};

// The random numbers of one sampling launch (philox.h): output row b draws from key seed, counter
// offset; each is a value or, when its pointer is set, read on the device from a [1] or [batch]
// int64 tensor (a CUDA graph replays with new values).
struct RandomSource {
  const int64_t* seed_arr;    // [seed_len], or nullptr: seed
  const int64_t* offset_arr;  // [offset_len], or nullptr: offset
  int64_t seed, offset;
  int64_t seed_len, offset_len;  // 1 or batch
};

// Which tokens a sample may take, in the order "before": token j comes before x when p_j > p_x, or
// p_j == p_x and j < x (ties go to the lower index). top-k keeps the tokens with fewer than k before
// them (exactly k); top-p those whose mass before them is below top_p times the row's mass; min-p
// those with p >= min_p * max(p); joint: both top-k and top-p. The first token is always kept.
enum class SampleFilter : int { none = 0, top_k = 1, top_p = 2, min_p = 3, top_k_top_p = 4 };

// One token per output row b from probs[row(b)] (row(b) = indices[b], or b), restricted by the
// filter, by rejection rounds (kernels/sampling.cuh). Rows whose kept mass is zero or not finite
// give token 0 and valid[b] = false.
struct SamplingParams {
  void* out;               // [batch] int32 or int64 (out_int64)
  bool* valid;             // [batch], or nullptr
  const float* probs;      // [rows, vocab], row stride probs_stride, contiguous rows
  int64_t probs_stride;
  const void* indices;     // [batch] int32 or int64 (indices_int64), or nullptr
  const int32_t* top_k_arr;  // [batch], or nullptr: top_k
  const float* top_p_arr;    // [batch], or nullptr: top_p
  const float* min_p_arr;    // [batch], or nullptr: min_p
  int64_t top_k;
  float top_p, min_p;
  int64_t batch, rows, vocab;
  SampleFilter filter;
  RandomSource rng;
  bool out_int64, indices_int64;
};

// Per row: keep the top-k values (exactly k, ties to the lower index) or, top-p, the tokens whose
// probability mass before them (the order above) is below top_p times the row's mass; then
// renormalize the kept probabilities to sum to 1 (top_k_renorm_probs, top_p_renorm_probs) or, for
// logits, set the others to -inf (top_k_mask_logits). Rows of vocab elements, contiguous.
enum class RenormKind : int { top_k_probs = 0, top_p_probs = 1, top_k_logits = 2 };

struct RenormParams {
  void* out;              // [rows, vocab] dtype
  const void* in;         // [rows, vocab] dtype
  int64_t out_stride, in_stride;
  const int32_t* top_k_arr;  // [rows], or nullptr: top_k
  const float* top_p_arr;    // [rows], or nullptr: top_p
  int64_t top_k;
  float top_p;
  int64_t rows, vocab;
  DType dtype;
  RenormKind kind;
};

// FlashInfer's sampling.softmax: out = softmax(in / t) per row in fp32, t = temperature_arr[row] or
// temperature. A row is processed in chunks of kSoftmaxChunk elements (kernels/softmax.cuh); rows of
// more than one chunk need partial: softmax_chunks(vocab) (max, sum) float pairs a row.
inline constexpr int64_t kSoftmaxChunk = 4096;  // untuned: 32 blocks for a 128K row at batch 1
FK_HOST_DEVICE int64_t softmax_chunks(int64_t vocab) { return (vocab + kSoftmaxChunk - 1) / kSoftmaxChunk; }

struct SoftmaxParams {
  float* out;                    // [rows, vocab] fp32, contiguous
  const void* in;                // [rows, vocab] dtype, the last dimension contiguous
  int64_t in_stride;             // elements from one row to the next
  const float* temperature_arr;  // [rows], or nullptr: temperature
  float temperature;
  float* partial;                // [rows, softmax_chunks(vocab), 2] when that is over 1, else unused
  int64_t rows, vocab;
  DType dtype;
  bool pdl;                      // programmatic dependent launches where the device has them (platform.h)
};

// Speculative decoding: per request b, a walk down a tree of candidate tokens (node 0 the root, the
// last accepted token; node i > 0 a candidate whose parent is parents[i] < i; the children of a
// node are tried in index order). Greedy: move to the first child whose token is the argmax of the
// target at the current node, else emit that argmax. Sampling: accept child c of node u with
// probability min(1, p(c) / q(c)), p the target's residual distribution at u and q the draft's
// distribution at u (children drawn from it independently) or, without draft, a point mass on
// c; on rejection the residual becomes norm(max(0, p - q)); when no child is accepted, emit a token
// drawn from the residual. A chain (parents == nullptr) has parent(i) = i - 1.
enum class SpeculativeMode : int { greedy = 0, sample = 1 };

struct SpeculativeParams {
  int32_t* out_tokens;          // [batch, out_len]: accepted candidates' tokens, then the emitted one; -1 after
  int32_t* out_nodes;           // [batch, out_len - 1]: the accepted candidates' nodes; -1 after. Or nullptr
  int32_t* num_accepted;        // [batch]
  int32_t* independent_accepted;  // [batch]: how many draft tokens of a sampled chain pass their own test
                                  // (0 for trees and greedy), or nullptr
  const int32_t* candidates;    // token of node i: candidates[b * cand_stride + i - first_candidate]
  int64_t cand_stride;
  int first_candidate;          // 0: candidates include the root; 1: they start at node 1
  const int32_t* parents;       // [nodes] (parents_stride 0) or [batch, nodes]; nullptr: a chain
  int64_t parents_stride;
  const void* target;           // [batch, nodes, vocab] target_dtype: probabilities (sample) or logits (greedy)
  int64_t target_strides[2];    // batch, node (elements); vocab contiguous
  const float* draft;           // [batch, >= internal nodes, vocab] float32 probabilities, or nullptr
  int64_t draft_strides[2];
  int64_t batch, vocab;
  int nodes, out_len;
  DType target_dtype;
  SpeculativeMode mode;
  RandomSource rng;
};

// ---- a training step: multi-tensor gradient norm and AdamW (kernels/optim.cuh) ----

// One tensor of a multi-tensor launch: an entry of the device table the launches read, rewritten by
// the glue only when an address changes (not every step). A tensor is cut into chunks of
// kOptimChunk elements, one block each: its chunks are chunk_begin .. chunk_begin + optim_chunks(numel).
struct OptimTensor {
  void* param;         // [numel] dtype (AdamW)
  const void* grad;    // [numel] dtype
  float* exp_avg;      // [numel] fp32 (AdamW)
  float* exp_avg_sq;   // [numel] fp32 (AdamW)
  float* master;       // [numel] fp32 master copy of a 16-bit param, or nullptr (AdamW)
  float* step;         // [] fp32 steps taken (AdamW)
  int64_t numel;
  int64_t chunk_begin;
  int32_t dtype;       // DType of param and grad
  int32_t wide;        // every pointer on a 16-byte boundary: 16-byte vectors
};
inline constexpr int64_t kOptimChunk = 65536;
FK_HOST_DEVICE int64_t optim_chunks(int64_t numel) { return (numel + kOptimChunk - 1) / kOptimChunk; }

// The p-norm of the gradients of all tensors taken together (the norm of their norms, as
// torch.nn.utils.clip_grad_norm_), each tensor's norm and the clip coefficients
// min(1, max_norm / (norm + 1e-6)) of the total or of each tensor. Sums of one chunk in fp32, of the
// chunks in fp64, always in the same order (the same result run to run).
enum class NormKind : int { l2 = 0, l1 = 1, lp = 2, linf = 3 };

struct GradNormParams {
  const OptimTensor* table;  // [tensors], device
  int64_t tensors, chunks;
  float* partials;           // [chunks] workspace
  float* total_norm;         // []
  float* tensor_norms;       // [tensors]
  float* clip_coef;          // [1], or [tensors] with per_tensor; nullptr: no clipping
  float* found_inf;          // []: 1 when the total norm is not finite, else 0
  float max_norm, norm_type;
  NormKind kind;
  bool per_tensor;
};

// torch.optim.AdamW's update in fp32 (decoupled weight decay, bias correction, eps added to
// sqrt(v_hat)) of every tensor, with the gradient times its clip coefficient; the step taken is each
// tensor's step + 1, stored back. A nonzero found_inf skips everything (params, state and steps).
struct AdamWParams {
  const OptimTensor* table;  // [tensors], device
  int64_t tensors, chunks;
  const float* lr_ptr;       // [] device learning rate, or nullptr: lr
  double lr;
  double beta1, beta2;       // the bias corrections (double, as torch's host code)
  float beta2_f, one_minus_beta1, one_minus_beta2, eps;  // the update (fp32 scalars, as torch's tensor ops)
  double weight_decay;
  const float* clip_coef;    // nullptr, [1] or [tensors] (per_tensor_clip)
  const float* found_inf;    // nullptr or []
  bool per_tensor_clip, maximize;
};

// KV-cache compression (kernels/kv_compress.cuh). A paged cache view: [num_pages, page_size, kv_heads,
// head_dim] with the strides of its page, slot and head (elements); per-key scores are fp32
// [num_pages, kv_heads, page_size], contiguous (they move with the pages). Request b's keys are the
// page_size * (pages - 1) + last_page_len[b] positions of its pages kv_indices[kv_indptr[b] ..].
//
// Scores: for each key j and KV head, scale * sum over request b's queries i (its last qo_len
// tokens, at positions kv_len - qo_len + i) and the group's q heads h of exp(logit(i, h, j) - lse[i, h]),
// the attention probabilities from the lse the attention kernels returned (logits as theirs: times
// sm_scale, soft-capped, causal and window_left masks). accumulate: keys before the last qo_len
// (those already cached) add to what scores holds, the step's own keys start from 0; else every key
// is written. A page index outside [0, num_pages) leaves its keys unread and unwritten.
struct KvScoresParams {
  float* scores;
  const void* q;                 // [nnz_q, qo_heads, head_dim] dtype, 16-byte aligned rows
  int64_t q_strides[2];          // token, head (elements)
  const float* lse;              // [nnz_q, qo_heads], contiguous, natural log
  const void* k_cache;
  int64_t k_strides[3];          // page, slot, head (elements)
  const int32_t* qo_indptr;      // [batch + 1]
  const int32_t* kv_indptr;      // [batch + 1]
  const int32_t* kv_indices;
  const int32_t* kv_last_page_len;  // [batch]
  // max_kv_len sizes the grid (0: nothing runs): the score kernel loops over the keys of a longer request
  // (a capped grid, for CUDA graphs); from logits, keys at or past max_kv_len (<= logits_stride) are not
  // scored
  int64_t num_pages, max_kv_len;
  int batch, qo_heads, kv_heads, head_dim, page_size;
  int window_left;               // -1: none
  float sm_scale, logits_soft_cap, scale;
  bool causal, accumulate;
  DType dtype;                   // q and k: f16 or bf16
  // or, in place of q . k, the attention's own logits (BatchAttentionParams::logits: base 2, the soft cap
  // applied), [nnz_q, qo_heads, logits_stride]: no read of q or K
  const float* logits;
  int64_t logits_stride;
};

// Selection: per request b and KV head, the kept_indptr[b + 1] - kept_indptr[b] positions of the
// highest scores, ascending, ties to the lower position; the first keep_first and the last window
// positions rank above every score (the lower positions first among them), a NaN score below all.
// pool > 1 (odd, at most 63): a key before the last `window` is scored by the average of the scores of the keys
// within pool / 2 of it among those keys, as avg_pool1d(pool, stride 1, padding pool / 2) (SnapKV).
// A budget past the request's length keeps every key and pads with -1.
struct KvSelectParams {
  int32_t* kept;                 // [kept_indptr[batch], kv_heads]
  const int32_t* kept_indptr;    // [batch + 1]
  const float* scores;
  const int32_t* kv_indptr;
  const int32_t* kv_indices;
  const int32_t* kv_last_page_len;
  int batch, kv_heads, page_size;
  int window, keep_first, pool;
};

// Compaction: per request b and KV head, the keys and values (and scores, when given) at the kept
// positions move, in order, to positions 0, 1, .. of the pages out_indices[out_indptr[b] ..]. The
// destination pages are the request's own first pages (in place: position i is written only after
// every kept position the block reads for i's chunk has been read, and a kept position is never
// before its destination) or pages no request reads. The in-place argument needs each head's kept
// positions strictly ascending in [0, kv_len), then only -1 (what kv_select writes; Python checks it).
struct KvCompactParams {
  void* k_cache;
  void* v_cache;
  int64_t k_strides[3], v_strides[3];
  float* scores;                 // or nullptr
  const int32_t* kv_indptr;
  const int32_t* kv_indices;
  const int32_t* kept;           // [kept_indptr[batch], kv_heads]
  const int32_t* kept_indptr;    // [batch + 1]
  const int32_t* out_indptr;     // [batch + 1]
  const int32_t* out_indices;
  int batch, kv_heads, head_dim, page_size;
  DType dtype;                   // f16 or bf16
};

// Appending to a paged KV cache (kernels/page.cuh), FlashInfer's append_paged_kv_cache: token i of
// append_key / append_value goes to position positions[i] of request batch_indices[i], i.e. page
// kv_indices[kv_indptr[b] + positions[i] / page_size], slot positions[i] % page_size. A 16-bit cache
// (quantize false: the input's dtype) gets the bits as they are; an fp8 cache (quantize true, format
// fp8) gets (x / scale) in fp32, saturated to the format's finite range, rounded to nearest even
// (numeric.h: float_to_fp8_bits), with scale k_scale[head] / v_scale[head] or, where that is nullptr,
// k_scale_value / v_scale_value. A token whose batch index is outside [0, batch), whose position is
// negative or past its request's pages, whose page entry is outside kv_indices or whose page is outside
// [0, num_pages) is not written (the CPU reference raises instead: the glue would have to read the
// page tables and positions on the host).
struct AppendPagedKvParams {
  void* k_cache;                   // [num_pages, page_size, kv_heads, head_dim] views, 8-element aligned rows
  void* v_cache;
  int64_t k_strides[3], v_strides[3];           // page, slot, head (elements)
  const void* append_key;          // [nnz, kv_heads, head_dim] dtype, 16-byte aligned rows
  const void* append_value;
  int64_t key_strides[2], value_strides[2];     // token, head (elements)
  const int32_t* batch_indices;    // [nnz]
  const int32_t* positions;        // [nnz]
  const int32_t* kv_indptr;        // [batch + 1]
  const int32_t* kv_indices;       // [num_indices]
  const float* k_scale;            // [kv_heads] or nullptr (then k_scale_value)
  const float* v_scale;
  float k_scale_value, v_scale_value;
  int64_t num_pages, num_indices, nnz;  // nnz * kv_heads * head_dim / 8 <= 2^30
  int batch, kv_heads, head_dim, page_size;  // head_dim a multiple of 8
  DType dtype;                     // the appended K/V: f16 or bf16
  bool quantize;                   // the cache is fp8 (else dtype)
  numeric::Fp8 fp8;
};

// ---- tensor parallelism: all-reduce (+ residual add + RMSNorm) over symmetric memory ----
// Every rank of a group runs the kernel at once on its own GPU; each reads its peers' workspaces
// (peer-mapped symmetric memory, kernels/allreduce.cuh). A workspace, the same on every rank:
//   [0, 2 KB)      flags[kCommMaxBlocks][kCommMaxRanks], uint32: written by the peers (block b of
//                  rank s stores its barrier count into flags[b][s] of every other rank)
//   [2 KB, 2.5 KB) state[kCommMaxBlocks][2], uint32: block b's own barrier count and call count
//   [4 KB, ...)    two regions, used by alternate calls, each a stage (this rank's input, read by
//                  the peers) of message_bytes and, for two-shot, the reduced rows it owns (its
//                  results, read by the peers) of 2 * message_bytes
// All zero when made. A call's launch grid is kCommBlocks whatever the shapes or the rank, so every
// block's counts stay equal across blocks and ranks (the alternation follows the call count).
inline constexpr int kCommMaxRanks = 8;
inline constexpr int kCommMaxBlocks = 64;
inline constexpr int64_t kCommHeaderBytes = 4096;
inline constexpr int kCommMaxVecsPerThread = 4;  // a row of up to threads * 4 16-byte vectors, in registers

struct CommLayout {
  int64_t message_bytes;  // the largest message (tokens x hidden x element size), a multiple of 16
  FK_HOST_DEVICE static constexpr int64_t round16(int64_t b) { return (b + 15) / 16 * 16; }
  FK_HOST_DEVICE constexpr int64_t region_bytes() const { return 3 * message_bytes; }
  FK_HOST_DEVICE constexpr int64_t stage(int parity) const { return kCommHeaderBytes + parity * region_bytes(); }
  FK_HOST_DEVICE constexpr int64_t results(int parity) const { return stage(parity) + message_bytes; }
  FK_HOST_DEVICE constexpr int64_t total_bytes() const { return kCommHeaderBytes + 2 * region_bytes(); }
  FK_HOST_DEVICE static constexpr int64_t flag(int block, int rank) { return 4 * (int64_t(block) * kCommMaxRanks + rank); }
  FK_HOST_DEVICE static constexpr int64_t state(int block) { return 2048 + 8 * int64_t(block); }
};

// Pattern: residual_in == nullptr: out = sum over the ranks of input; else residual_out =
// residual_in + that sum (fp32, rounded once) and norm_out = rmsnorm of the unrounded fp32 sum
// (out is the first pattern's alone). Rows of `cols` elements, contiguous, cols a multiple of 8;
// the sum is fp32, in rank order, so every rank gets the same bits. Outputs may alias inputs
// (residual_out == residual_in, norm_out == input: in place).
struct AllReduceParams {
  void* peers[kCommMaxRanks];  // every rank's workspace, this rank's included, at the same layout
  int world, rank;
  int64_t message_bytes;       // the workspace's CommLayout
  const void* input;           // [rows, cols] dtype, this rank's addend
  const void* residual_in;     // [rows, cols] dtype, the same on every rank; nullptr: all-reduce only
  const void* weight;          // [cols] weight_dtype
  void* out;                   // [rows, cols] dtype, or nullptr
  void* residual_out;          // [rows, cols] dtype
  void* norm_out;              // [rows, cols] dtype
  int64_t rows, cols;
  DType dtype, weight_dtype;   // dtype f16 or bf16
  float eps, weight_offset;
  bool two_shot;               // reduce-scatter + all-gather (else one-shot: every rank reads every row)
  bool pdl;
  int blocks, threads;         // comm_plan(): never the rank's
  int64_t timeout_ns;          // a barrier that waits longer reports and traps; 0: waits forever
};

// How long a rank waits at a barrier for a peer that never comes (one that failed before its call,
// or called with other shapes) before it traps: torch's default NCCL timeout, 10 minutes.
inline constexpr int64_t kCommTimeoutNs = int64_t(600) * 1000 * 1000 * 1000;

// The launch of every call: kCommBlocks blocks of `threads`, a pure function of cols. Tests
// emulate with fewer blocks and threads (any blocks <= kCommMaxBlocks, threads a multiple of the
// warp, <= 1024), the same on every rank.
inline constexpr int kCommBlocks = 32;
inline constexpr int kCommThreads = 512;
FK_HOST_DEVICE constexpr bool comm_fits(int64_t cols, int threads) {
  return cols > 0 && cols % 8 == 0 && cols <= int64_t(threads) * 8 * kCommMaxVecsPerThread;
}
// The fewest threads (128, 256 or 512: whole wave64s) whose registers hold a row of cols.
FK_HOST_DEVICE constexpr int comm_threads(int64_t cols) {
  return comm_fits(cols, 128) ? 128 : comm_fits(cols, 256) ? 256 : kCommThreads;
}
// The message a workspace of `bytes` holds (CommLayout::total_bytes inverted), 0 if none.
FK_HOST_DEVICE constexpr int64_t comm_message_bytes(int64_t bytes) {
  return bytes <= kCommHeaderBytes ? 0 : (bytes - kCommHeaderBytes) / 6 / 16 * 16;
}

const char* launch_grad_norm(const GradNormParams& p, void* stream);
const char* launch_adamw(const AdamWParams& p, void* stream);

const char* launch_rmsnorm(const RmsnormParams& p, void* stream);
size_t rmsnorm_backward_workspace_bytes(const RmsnormBackwardParams& p);
const char* launch_rmsnorm_backward(const RmsnormBackwardParams& p, void* stream);
const char* launch_act_and_mul(const ActAndMulParams& p, void* stream);
const char* launch_act_and_mul_backward(const ActAndMulBackwardParams& p, void* stream);
const char* launch_rope(const RopeParams& p, void* stream);
const char* launch_merge_states(const MergeStatesParams& p, void* stream);
const char* launch_batch_attention(const BatchAttentionParams& p, void* stream);
// The fp8 caches this build's batch attention reads: bit f for numeric::Fp8 f (OCP's formats on CUDA,
// AMD's FNUZ ones too on HIP).
uint32_t batch_attention_fp8_formats();
const char* launch_sampling(const SamplingParams& p, void* stream);
const char* launch_renorm(const RenormParams& p, void* stream);
const char* launch_softmax(const SoftmaxParams& p, void* stream);
const char* launch_speculative(const SpeculativeParams& p, void* stream);
const char* launch_kv_scores(const KvScoresParams& p, void* stream);
const char* launch_kv_select(const KvSelectParams& p, void* stream);
const char* launch_kv_compact(const KvCompactParams& p, void* stream);
const char* launch_allreduce(const AllReduceParams& p, void* stream);
const char* launch_append_paged_kv(const AppendPagedKvParams& p, void* stream);

}  // namespace fk
