// C entry points over the kernels' launchers (launch_* in csrc/cuda/*.cu or csrc/hip/*.hip) built with
// -DFK_EMULATE, for tests/test_emulated_kernels.py: every pointer is host memory from torch CPU tensors.
#include <dlfcn.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "flashkern/attention_plan.h"
#include "flashkern/ops.h"

using fk::DType;
using fk::RowLayout;

#pragma GCC visibility push(default)  // the library is built with hidden visibility; these are its interface
extern "C" {

// The emulated device (emulate.h: kDevices, e.g. "sm_90", "gfx1030"); false if this build does not emulate it.
bool emu_set_device(const char* name) { return fk::emu::set_device(name); }

// The seed of the thread schedule (emulate.h): each seed is another order of the threads between barriers.
void emu_set_seed(uint64_t seed) { fk::emu::seed = seed; }

const char* emu_rmsnorm(void* out, const void* input, void* residual, const void* weight, int64_t rows, int64_t cols,
                        const int64_t* out_layout, const int64_t* in_layout, const int64_t* res_layout, int dtype,
                        int weight_dtype, float eps, float offset) {
  fk::RmsnormParams p{};
  p.out = out, p.input = input, p.residual = residual, p.weight = weight;
  p.out_rows = RowLayout{out_layout[0], out_layout[1], out_layout[2]};
  p.input_rows = RowLayout{in_layout[0], in_layout[1], in_layout[2]};
  p.residual_rows = RowLayout{res_layout[0], res_layout[1], res_layout[2]};
  p.rows = rows, p.cols = cols, p.dtype = DType(dtype), p.weight_dtype = DType(weight_dtype);
  p.eps = eps, p.weight_offset = offset;
  return fk::launch_rmsnorm(p, nullptr);
}

const char* emu_rmsnorm_backward(void* grad_input, void* grad_weight, const void* grad_out, const void* input,
                                 const void* weight, int64_t rows, int64_t cols, int64_t stride, int dtype,
                                 int weight_dtype, float eps, float offset) {
  fk::RmsnormBackwardParams p{};
  p.grad_input = grad_input, p.grad_weight = grad_weight, p.grad_out = grad_out, p.input = input, p.weight = weight;
  p.grad_input_rows = p.grad_out_rows = p.input_rows = RowLayout{stride, 0, 1};
  p.rows = rows, p.cols = cols, p.dtype = DType(dtype), p.weight_dtype = DType(weight_dtype);
  p.eps = eps, p.weight_offset = offset;
  const size_t bytes = fk::rmsnorm_backward_workspace_bytes(p);
  p.workspace = static_cast<float*>(std::aligned_alloc(16, (bytes + 15) / 16 * 16 + 16));
  const char* error = fk::launch_rmsnorm_backward(p, nullptr);
  std::free(p.workspace);
  return error;
}

const char* emu_act_mul(void* out, const void* gate, const void* up, int64_t rows, int64_t cols,
                        const int64_t* strides /* out, gate, up */, int dtype, int activation) {
  fk::ActAndMulParams p{};
  p.out = out, p.gate = gate, p.up = up;
  p.out_rows = RowLayout{strides[0], 0, 1}, p.gate_rows = RowLayout{strides[1], 0, 1};
  p.up_rows = RowLayout{strides[2], 0, 1};
  p.rows = rows, p.cols = cols, p.dtype = DType(dtype), p.act = fk::Activation(activation);
  return fk::launch_act_and_mul(p, nullptr);
}

const char* emu_act_mul_backward(void* grad_gate, void* grad_up, const void* grad_out, const void* gate,
                                 const void* up, int64_t rows, int64_t cols, int64_t stride, int dtype,
                                 int activation) {
  fk::ActAndMulBackwardParams p{};
  p.grad_gate = grad_gate, p.grad_up = grad_up, p.grad_out = grad_out, p.gate = gate, p.up = up;
  p.grad_gate_rows = p.grad_up_rows = p.gate_rows = p.up_rows = RowLayout{stride, 0, 1};
  p.grad_out_rows = RowLayout{cols, 0, 1};
  p.rows = rows, p.cols = cols, p.dtype = DType(dtype), p.act = fk::Activation(activation);
  return fk::launch_act_and_mul_backward(p, nullptr);
}

// strides: q_out, k_out, q, k (token, head)
const char* emu_rope(void* q_out, void* k_out, const void* q, const void* k, const void* positions, int positions_int64,
                     const float* inv_freq, const float* cache, int64_t cache_rows, int64_t tokens, int q_heads,
                     int k_heads, int head_dim, int rotary_dim, const int64_t* strides, int interleave, int inverse,
                     int in_place, int dtype) {
  fk::RopeParams p{};
  p.q_out = q_out, p.k_out = k_out, p.q = q, p.k = k, p.positions = positions;
  p.inv_freq = inv_freq, p.cos_sin_cache = cache, p.cache_rows = cache_rows;
  int64_t* dst[] = {p.q_out_strides, p.k_out_strides, p.q_strides, p.k_strides};
  for (int i = 0; i < 4; ++i) dst[i][0] = strides[2 * i], dst[i][1] = strides[2 * i + 1];
  p.tokens = tokens, p.q_heads = q_heads, p.k_heads = k_heads, p.head_dim = head_dim, p.rotary_dim = rotary_dim;
  p.positions_int64 = positions_int64, p.interleave = interleave, p.inverse = inverse, p.in_place = in_place;
  p.dtype = DType(dtype);
  return fk::launch_rope(p, nullptr);
}

// v [tokens, n, heads, head_dim] and s [tokens, n, heads] contiguous; other state optional; out contiguous
const char* emu_merge_states(void* v_out, float* s_out, const void* v, const float* s, const void* v_other,
                             const float* s_other, const bool* mask, int64_t tokens, int n, int heads, int head_dim,
                             int dtype) {
  fk::MergeStatesParams p{};
  p.v_out = v_out, p.s_out = s_out, p.v = v, p.s = s, p.v_other = v_other, p.s_other = s_other, p.mask = mask;
  const int64_t d = head_dim;
  int64_t vs[] = {n * heads * d, heads * d, d}, ss[] = {int64_t(n) * heads, heads, 1};
  for (int i = 0; i < 3; ++i) p.v_strides[i] = vs[i], p.s_strides[i] = ss[i];
  p.v_other_strides[0] = p.v_out_strides[0] = heads * d, p.v_other_strides[1] = p.v_out_strides[1] = d;
  p.s_other_strides[0] = p.s_out_strides[0] = heads, p.s_other_strides[1] = p.s_out_strides[1] = 1;
  p.tokens = tokens, p.num_states = n, p.heads = heads, p.head_dim = head_dim, p.dtype = DType(dtype);
  return fk::launch_merge_states(p, nullptr);
}

// q [batch, qo_heads, head_dim] with strides q_strides; k/v caches [pages, page_size, kv_heads, head_dim] with
// strides kv_strides (k: page, slot, head; then v's); plan, partial_s and partial_v: a planned CPU workspace;
// custom_mask: the plan's packed masks (custom_mask_bytes of them) or nullptr.
const char* emu_batch_attention(void* out, float* lse, const void* q, const int64_t* q_strides, const void* k_cache,
                                const void* v_cache, const int64_t* kv_strides, int64_t num_pages,
                                const int32_t* const* kv_indices, const int32_t* kv_indices_len, int levels,
                                const int32_t* plan, float* partial_s, float* partial_v, const int* grid, int batch,
                                int qo_heads, int kv_heads, int head_dim, int page_size, float sm_scale, int dtype,
                                const float* sinks, float out_scale, int out_dtype, const uint8_t* custom_mask,
                                int64_t custom_mask_bytes, float logits_soft_cap, float* logits,
                                int64_t logits_stride, int kv_format, const float* k_scale, const float* v_scale) {
  fk::BatchAttentionParams p{};
  p.out = out, p.lse = lse, p.q = q, p.k_cache = k_cache, p.v_cache = v_cache;
  p.q_strides[0] = q_strides[0], p.q_strides[1] = q_strides[1];
  for (int i = 0; i < 3; ++i) p.k_strides[i] = kv_strides[i], p.v_strides[i] = kv_strides[3 + i];
  p.num_pages = num_pages;
  for (int i = 0; i < levels; ++i) p.kv_indices[i] = kv_indices[i], p.kv_indices_len[i] = kv_indices_len[i];
  p.plan = plan, p.partial_s = partial_s, p.partial_v = partial_v;
  for (int i = 0; i < 4; ++i) p.grid[i] = grid[i];
  p.batch = batch, p.qo_heads = qo_heads, p.kv_heads = kv_heads, p.head_dim = head_dim, p.page_size = page_size;
  p.page_div = fk::Divmod(uint32_t(page_size));
  p.sm_scale = sm_scale, p.dtype = DType(dtype);
  p.sinks = sinks, p.out_scale = out_scale, p.out_dtype = DType(out_dtype);
  p.custom_mask = custom_mask, p.custom_mask_bytes = custom_mask_bytes, p.logits_soft_cap = logits_soft_cap;
  p.logits = logits, p.logits_stride = logits_stride;
  p.kv_format = kv_format, p.k_scale = k_scale, p.v_scale = v_scale;
  return fk::launch_batch_attention(p, nullptr);
}

// The host planner (attention_plan.h) as this library was built (a mutant's, in tests/test_emulator_checks.py),
// with _C.plan_attention's arguments: levels [num_levels * 9]: the addresses of qo_indptr, kv_indptr and
// last_page_len, then groups, num_indices, causal, window_left, custom_mask, identity; shape: batch, page_size,
// group_size, kv_heads, head_dim, cta_budget, min_chunk, item_capacity, slot_capacity, invariant. result:
// words, the counts per kind, slots, chunk, needs_merge. nullptr, or the planner's error.
const char* emu_plan_attention(const int64_t* levels, int num_levels, const int64_t* shape, int32_t* out,
                               int64_t out_words, int64_t* result) {
  static std::string error;
  std::vector<fk::PlanLevel> plan_levels;
  for (int i = 0; i < num_levels; ++i) {
    const int64_t* l = levels + 9 * i;
    plan_levels.push_back({reinterpret_cast<const int32_t*>(l[0]), reinterpret_cast<const int32_t*>(l[1]),
                           reinterpret_cast<const int32_t*>(l[2]), l[3], l[4], l[5] != 0, l[6], l[7] != 0, l[8] != 0});
  }
  fk::PlanShape s{};
  s.batch = shape[0], s.page_size = shape[1], s.group_size = shape[2], s.kv_heads = shape[3], s.head_dim = shape[4];
  s.cta_budget = shape[5], s.min_chunk = shape[6], s.item_capacity = shape[7], s.slot_capacity = shape[8];
  s.invariant = shape[9] != 0;
  const fk::PlanResult r = fk::plan_attention(plan_levels.data(), num_levels, s, out, out_words);
  if (!r.error.empty()) return (error = r.error).c_str();
  result[0] = r.words, result[1] = r.count[0], result[2] = r.count[1], result[3] = r.count[2];
  result[4] = r.slots, result[5] = r.chunk, result[6] = r.needs_merge;
  return nullptr;
}

// probs [rows, vocab] contiguous; indices [batch] int32 or nullptr (batch = rows); filter: SampleFilter;
// the random numbers from (seed, offset 0), or from seeds [batch] (a seed per row) where not nullptr. out [batch] int32.
const char* emu_sampling(int32_t* out, bool* valid, const float* probs, int64_t rows, int64_t vocab,
                         const int32_t* indices, int64_t batch, int filter, int64_t top_k, float top_p, float min_p,
                         int64_t seed, const int64_t* seeds) {
  fk::SamplingParams p{};
  p.out = out, p.valid = valid, p.probs = probs, p.probs_stride = vocab, p.indices = indices;
  p.top_k = top_k, p.top_p = top_p, p.min_p = min_p;
  p.batch = indices != nullptr ? batch : rows, p.rows = rows, p.vocab = vocab;
  p.filter = fk::SampleFilter(filter);
  p.rng.seed = seed, p.rng.seed_len = p.rng.offset_len = 1;
  if (seeds != nullptr) p.rng.seed_arr = seeds, p.rng.seed_len = p.batch;
  return fk::launch_sampling(p, nullptr);
}

// The table of n tensors (arrays of n host pointers; params, exp_avg, exp_avg_sq, masters and steps may be
// null arrays, a masters entry null) for the multi-tensor launches, 16-byte vectors where all are aligned.
static std::vector<fk::OptimTensor> optim_table(void** params, const void** grads, float** m, float** v, float** masters,
                                                float** steps, const int64_t* numel, const int* dtype, int64_t n) {
  std::vector<fk::OptimTensor> table(n);
  int64_t chunk = 0;
  auto aligned = [](const void* p) { return p == nullptr || (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  for (int64_t i = 0; i < n; ++i) {
    fk::OptimTensor& e = table[i];
    e.param = params ? params[i] : nullptr, e.grad = grads[i];
    e.exp_avg = m ? m[i] : nullptr, e.exp_avg_sq = v ? v[i] : nullptr, e.master = masters ? masters[i] : nullptr;
    e.step = steps ? steps[i] : nullptr;
    e.numel = numel[i], e.chunk_begin = chunk, e.dtype = dtype[i];
    e.wide = aligned(e.param) && aligned(e.grad) && aligned(e.exp_avg) && aligned(e.exp_avg_sq) && aligned(e.master);
    chunk += fk::optim_chunks(numel[i]);
  }
  return table;
}

// total [], norms [n], coef [1] or [n] (or null: no clipping), found_inf []; kind: NormKind
const char* emu_grad_norm(float* total, float* norms, float* coef, float* found_inf, const void** grads,
                          const int64_t* numel, const int* dtype, int64_t n, float norm_type, int kind, float max_norm,
                          int per_tensor) {
  const std::vector<fk::OptimTensor> table = optim_table(nullptr, grads, nullptr, nullptr, nullptr, nullptr, numel, dtype, n);
  const int64_t chunks = n ? table.back().chunk_begin + fk::optim_chunks(table.back().numel) : 0;
  std::vector<float> partials(chunks);
  fk::GradNormParams p{};
  p.table = table.data(), p.tensors = n, p.chunks = chunks, p.partials = partials.data();
  p.total_norm = total, p.tensor_norms = norms, p.clip_coef = coef, p.found_inf = found_inf;
  p.max_norm = max_norm, p.norm_type = norm_type, p.kind = fk::NormKind(kind), p.per_tensor = per_tensor != 0;
  return fk::launch_grad_norm(p, nullptr);
}

const char* emu_adamw(void** params, const void** grads, float** m, float** v, float** masters, float** steps,
                      const int64_t* numel, const int* dtype, int64_t n, const float* lr_ptr, double lr, double beta1,
                      double beta2, float eps, double weight_decay, const float* clip, int per_tensor,
                      const float* found_inf, int maximize) {
  const std::vector<fk::OptimTensor> table = optim_table(params, grads, m, v, masters, steps, numel, dtype, n);
  fk::AdamWParams p{};
  p.table = table.data(), p.tensors = n;
  p.chunks = n ? table.back().chunk_begin + fk::optim_chunks(table.back().numel) : 0;
  p.lr_ptr = lr_ptr, p.lr = lr, p.beta1 = beta1, p.beta2 = beta2, p.beta2_f = float(beta2);
  p.one_minus_beta1 = float(1.0 - beta1), p.one_minus_beta2 = float(1.0 - beta2), p.eps = eps;
  p.weight_decay = weight_decay, p.clip_coef = clip, p.found_inf = found_inf;
  p.per_tensor_clip = per_tensor != 0, p.maximize = maximize != 0;
  return fk::launch_adamw(p, nullptr);
}

// in and out [rows, vocab] contiguous; kind: RenormKind
const char* emu_renorm(void* out, const void* in, int64_t rows, int64_t vocab, int dtype, int kind, int64_t top_k,
                       float top_p) {
  fk::RenormParams p{};
  p.out = out, p.in = in, p.out_stride = p.in_stride = vocab;
  p.top_k = top_k, p.top_p = top_p, p.rows = rows, p.vocab = vocab, p.dtype = DType(dtype);
  p.kind = fk::RenormKind(kind);
  return fk::launch_renorm(p, nullptr);
}

// out [rows, vocab] float32 contiguous; in [rows, vocab] dtype, rows in_stride apart; temperature_arr [rows]
// or nullptr; partial: room for softmax_chunks(vocab) (max, sum) pairs a row
int64_t emu_softmax_chunks(int64_t vocab) { return fk::softmax_chunks(vocab); }

const char* emu_softmax(float* out, const void* in, int64_t rows, int64_t vocab, int64_t in_stride, int dtype,
                        const float* temperature_arr, float temperature, float* partial) {
  fk::SoftmaxParams p{};
  p.out = out, p.in = in, p.in_stride = in_stride, p.temperature_arr = temperature_arr, p.temperature = temperature;
  p.partial = partial, p.rows = rows, p.vocab = vocab, p.dtype = DType(dtype);
  return fk::launch_softmax(p, nullptr);
}

// target [batch, nodes, vocab] (dtype), draft [batch, nodes, vocab] float32 or nullptr, candidates
// [batch, nodes - first] int32, parents [nodes] int32 or nullptr (a chain); mode: SpeculativeMode.
const char* emu_speculative(int32_t* tokens, int32_t* path, int32_t* accepted, int32_t* independent,
                            const int32_t* candidates, int first, const int32_t* parents, const void* target,
                            const float* draft, int64_t batch, int nodes, int64_t vocab, int dtype, int mode,
                            int64_t seed) {
  fk::SpeculativeParams p{};
  p.out_tokens = tokens, p.out_nodes = path, p.num_accepted = accepted, p.independent_accepted = independent;
  p.candidates = candidates, p.cand_stride = nodes - first, p.first_candidate = first, p.parents = parents;
  p.target = target, p.target_strides[0] = nodes * vocab, p.target_strides[1] = vocab;
  p.draft = draft, p.draft_strides[0] = nodes * vocab, p.draft_strides[1] = vocab;
  p.batch = batch, p.vocab = vocab, p.nodes = nodes, p.out_len = nodes;
  p.target_dtype = DType(dtype), p.mode = fk::SpeculativeMode(mode);
  p.rng.seed = seed, p.rng.seed_len = p.rng.offset_len = 1;
  return fk::launch_speculative(p, nullptr);
}

// KV-cache compression (ops.h: KvScoresParams, KvSelectParams, KvCompactParams); caches are views
// [pages, page_size, kv_heads, head_dim] with (page, slot, head) strides, scores [pages, kv_heads, page_size].
const char* emu_kv_scores(float* scores, const void* q, const int64_t* q_strides, const float* lse, const void* k,
                          const int64_t* k_strides, const int32_t* qo_indptr, const int32_t* kv_indptr,
                          const int32_t* kv_indices, const int32_t* last, int64_t num_pages, int64_t max_kv_len,
                          int batch, int qo_heads, int kv_heads, int head_dim, int page_size, int window_left,
                          float sm_scale, float cap, float scale, int causal, int accumulate, int dtype,
                          const float* logits, int64_t logits_stride) {
  fk::KvScoresParams p{};
  p.scores = scores, p.q = q, p.q_strides[0] = q_strides[0], p.q_strides[1] = q_strides[1], p.lse = lse;
  p.k_cache = k;
  for (int d = 0; d < 3; ++d) p.k_strides[d] = k_strides[d];
  p.qo_indptr = qo_indptr, p.kv_indptr = kv_indptr, p.kv_indices = kv_indices, p.kv_last_page_len = last;
  p.num_pages = num_pages, p.max_kv_len = max_kv_len, p.batch = batch, p.qo_heads = qo_heads, p.kv_heads = kv_heads;
  p.head_dim = head_dim, p.page_size = page_size, p.window_left = window_left;
  p.sm_scale = sm_scale, p.logits_soft_cap = cap, p.scale = scale, p.causal = causal, p.accumulate = accumulate;
  p.dtype = DType(dtype);
  p.logits = logits, p.logits_stride = logits_stride;
  return fk::launch_kv_scores(p, nullptr);
}

const char* emu_kv_select(int32_t* kept, const int32_t* kept_indptr, const float* scores, const int32_t* kv_indptr,
                          const int32_t* kv_indices, const int32_t* last, int batch, int kv_heads, int page_size,
                          int window, int keep_first, int pool) {
  fk::KvSelectParams p{};
  p.kept = kept, p.kept_indptr = kept_indptr, p.scores = scores;
  p.kv_indptr = kv_indptr, p.kv_indices = kv_indices, p.kv_last_page_len = last;
  p.batch = batch, p.kv_heads = kv_heads, p.page_size = page_size;
  p.window = window, p.keep_first = keep_first, p.pool = pool;
  return fk::launch_kv_select(p, nullptr);
}

const char* emu_kv_compact(void* k, void* v, const int64_t* k_strides, const int64_t* v_strides, float* scores,
                           const int32_t* kv_indptr, const int32_t* kv_indices, const int32_t* kept,
                           const int32_t* kept_indptr, const int32_t* out_indptr, const int32_t* out_indices, int batch,
                           int kv_heads, int head_dim, int page_size, int dtype) {
  fk::KvCompactParams p{};
  p.k_cache = k, p.v_cache = v;
  for (int d = 0; d < 3; ++d) p.k_strides[d] = k_strides[d], p.v_strides[d] = v_strides[d];
  p.scores = scores, p.kv_indptr = kv_indptr, p.kv_indices = kv_indices, p.kept = kept, p.kept_indptr = kept_indptr;
  p.out_indptr = out_indptr, p.out_indices = out_indices;
  p.batch = batch, p.kv_heads = kv_heads, p.head_dim = head_dim, p.page_size = page_size, p.dtype = DType(dtype);
  return fk::launch_kv_compact(p, nullptr);
}

// Appending to a paged KV cache (ops.h: AppendPagedKvParams); caches are views [pages, page_size, kv_heads,
// head_dim] with (page, slot, head) strides, the input [nnz, kv_heads, head_dim] with (token, head) strides;
// fp8 -1: a cache of the input's dtype, else the numeric::Fp8 format.
const char* emu_append_paged_kv(void* k, void* v, const int64_t* k_strides, const int64_t* v_strides, const void* key,
                                const void* value, const int64_t* key_strides, const int64_t* value_strides,
                                const int32_t* batch_indices, const int32_t* positions, const int32_t* kv_indptr,
                                const int32_t* kv_indices, const float* k_scale, const float* v_scale,
                                float k_scale_value, float v_scale_value, int64_t num_pages, int64_t num_indices,
                                int64_t nnz, int batch, int kv_heads, int head_dim, int page_size, int dtype, int fp8) {
  fk::AppendPagedKvParams p{};
  p.k_cache = k, p.v_cache = v, p.append_key = key, p.append_value = value;
  for (int d = 0; d < 3; ++d) p.k_strides[d] = k_strides[d], p.v_strides[d] = v_strides[d];
  for (int d = 0; d < 2; ++d) p.key_strides[d] = key_strides[d], p.value_strides[d] = value_strides[d];
  p.batch_indices = batch_indices, p.positions = positions, p.kv_indptr = kv_indptr, p.kv_indices = kv_indices;
  p.k_scale = k_scale, p.v_scale = v_scale, p.k_scale_value = k_scale_value, p.v_scale_value = v_scale_value;
  p.num_pages = num_pages, p.num_indices = num_indices, p.nnz = nnz;
  p.batch = batch, p.kv_heads = kv_heads, p.head_dim = head_dim, p.page_size = page_size, p.dtype = DType(dtype);
  p.quantize = fp8 >= 0, p.fp8 = fk::numeric::Fp8(fp8 >= 0 ? fp8 : 0);
  return fk::launch_append_paged_kv(p, nullptr);
}

}  // extern "C"

namespace {
// Counts its threads: a launch that ran ran every thread of every block.
__global__ void probe_kernel(int* threads_run) {
  FK_DYNAMIC_SHARED(smem);
  (void)smem;
  if (threadIdx.x == 0) *threads_run += int(blockDim.x);
}
}  // namespace

extern "C" {
// One launch of probe_kernel (grid 1 x grid_y) with `opt_in` bytes of dynamic shared memory allowed
// first (-1: none asked): nullptr, or the error a GPU would give.
const char* emu_launch_probe(int threads, int grid_y, int shared_bytes, int opt_in) {
  if (opt_in >= 0) {
    if (const fk::gpuError_t e = fk::gpuSetMaxDynamicShared(probe_kernel, opt_in)) {
      (void)fk::gpuGetLastError();  // as launch_tiles does
      return fk::gpuGetErrorString(e);
    }
  }
  int threads_run = 0;
  const dim3 grid{1, unsigned(grid_y)}, block{unsigned(threads)};
  FK_LAUNCH_SMEM(probe_kernel, grid, block, size_t(shared_bytes), nullptr)(&threads_run);
  if (const fk::gpuError_t e = fk::gpuGetLastError()) return fk::gpuGetErrorString(e);
  if (threads_run != threads * grid_y) return "the probe did not run on every block";
  return nullptr;
}

// CommLayout's bytes of a workspace for messages of up to message_bytes.
int64_t emu_comm_workspace_bytes(int64_t message_bytes) { return fk::CommLayout{message_bytes}.total_bytes(); }

// The ranks of a tensor-parallel group, each on its own host thread, running `calls` all-reduces in
// a row over the workspaces (one per rank, zeroed, CommLayout of message_bytes: peer memory here is
// this process's). Call c uses rows[c] rows and two_shot[c]; every per-rank buffer holds the calls'
// rows one after another (call c at the sum of the rows before it, times cols). residual_ins null:
// all-reduce only, into outs; else residual_outs = outs and norm_outs (either may be the input:
// in place). Rank r sleeps start_delay_us[r] before its first call. Returns the first error.
const char* emu_allreduce(int world, void* const* workspaces, const void* const* inputs, const void* const* residual_ins,
                          const void* weight, void* const* outs, void* const* norm_outs, int calls, const int64_t* rows,
                          const uint8_t* two_shot, int64_t cols, int dtype, int weight_dtype, float eps, float offset,
                          int64_t message_bytes, int blocks, int threads, const int64_t* start_delay_us,
                          int64_t timeout_ns) {
  std::vector<const char*> errors(size_t(world), nullptr);
  std::vector<std::thread> ranks;
  const int64_t element = 2;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      std::this_thread::sleep_for(std::chrono::microseconds(start_delay_us[r]));
      int64_t at = 0;  // bytes into each rank's buffers
      for (int c = 0; c < calls && errors[size_t(r)] == nullptr; ++c) {
        fk::AllReduceParams p{};
        for (int i = 0; i < world; ++i) p.peers[i] = workspaces[i];
        p.world = world, p.rank = r, p.message_bytes = message_bytes;
        auto shift = [&](const void* base) { return base ? static_cast<const uint8_t*>(base) + at : nullptr; };
        p.input = shift(inputs[r]);
        p.residual_in = residual_ins ? shift(residual_ins[r]) : nullptr;
        p.weight = weight;
        void* out = const_cast<uint8_t*>(shift(outs[r]));
        if (residual_ins) {
          p.residual_out = out;
          p.norm_out = const_cast<uint8_t*>(shift(norm_outs[r]));
        } else {
          p.out = out;
        }
        p.rows = rows[c], p.cols = cols, p.dtype = DType(dtype), p.weight_dtype = DType(weight_dtype);
        p.eps = eps, p.weight_offset = offset, p.two_shot = two_shot[c] != 0;
        p.blocks = blocks, p.threads = threads, p.timeout_ns = timeout_ns;
        errors[size_t(r)] = fk::launch_allreduce(p, nullptr);
        at += rows[c] * cols * element;
      }
    });
  }
  for (std::thread& t : ranks) t.join();
  for (const char* e : errors)
    if (e) return e;
  return nullptr;
}

// Every kernel launched so far, a line each: its offset in this library (nm names it) and the largest
// block it was launched with, in threads.
const char* emu_launches() {
  static std::string text;
  text.clear();
  for (const auto& [kernel, threads] : fk::emu::largest_block) {
    Dl_info info{};
    if (dladdr(kernel, &info) == 0) return "dladdr found no library for a kernel";
    const auto offset = reinterpret_cast<uintptr_t>(kernel) - reinterpret_cast<uintptr_t>(info.dli_fbase);
    text += std::to_string(offset) + " " + std::to_string(threads) + "\n";
  }
  return text.c_str();
}
}  // extern "C"
#pragma GCC visibility pop
