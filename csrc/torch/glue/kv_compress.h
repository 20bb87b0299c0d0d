// KV-cache compression: per-key scores, selection, compaction (ops.h: KvScoresParams, KvSelectParams,
// KvCompactParams). Part of the torch glue: included once, by gpu_ops.cpp. The checks mirror
// python/flashkern/_validate.py (check_kv_scores, check_kv_select, check_kv_compact); what needs the
// page tables' contents (pages in range, budgets within a request) is checked by the Python functions,
// which hold host copies.
#pragma once

#include "attention.h"
#include "common.h"

namespace {

// An int32 CSR array or index list on `ref`'s device: contiguous 1-D, `length` entries when >= 0.
void check_index(const char* op, const char* name, const Tensor& t, const Tensor& ref, int64_t length) {
  FK_CHECK_TYPE(t.scalar_type() == at::kInt, op, ": ", name, " must be int32, got ", dtype_name(t.scalar_type()));
  FK_CHECK_VALUE(t.dim() == 1 && t.is_contiguous() && t.device() == ref.device(), op, ": ", name,
                 " must be a contiguous 1-D tensor on ", ref.device());
  FK_CHECK_VALUE(length < 0 || t.size(0) == length, op, ": ", name, " must have ", length, " entries, got ",
                 t.size(0));
  FK_CHECK_VALUE(t.numel() < (int64_t(1) << 31), op, ": ", name, " must have fewer than 2^31 entries");
}

// A paged cache view [pages, page_size, kv_heads, head_dim] the kernels read 16 bytes at a time.
void check_cache_view(const char* op, const char* name, const Tensor& t) {
  FK_CHECK_TYPE(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, op, ": ", name,
                " must be float16 or bfloat16, got ", dtype_name(t.scalar_type()));
  FK_CHECK_VALUE(t.dim() == 4, op, ": ", name, " must be 4-D [pages, page_size, num_kv_heads, head_dim], got shape ",
                 as_tuple(t.sizes()));
  const int64_t head_dim = t.size(3);
  FK_CHECK_VALUE(head_dim == 64 || head_dim == 128 || head_dim == 256, op, ": head_dim must be 64, 128 or 256, got ",
                 head_dim);
  check_last_dim_contiguous(op, name, t);
  FK_CHECK_VALUE(rows_aligned16(t), op, ": ", name,
                 " must start on a 16-byte boundary and have strides that are multiples of 8 elements, got strides ",
                 as_tuple(t.strides()));
  FK_CHECK_VALUE(t.size(1) > 0 && t.size(1) < (int64_t(1) << 31) && t.size(2) > 0 && t.size(2) <= 65535, op, ": ",
                 name, " must have a page_size in [1, 2^31) and 1 to 65535 KV heads, got shape ", as_tuple(t.sizes()));
}

// Per-key scores: float32 [pages, kv_heads, page_size], contiguous, matching the cache view.
void check_scores(const char* op, const Tensor& scores, const Tensor& cache) {
  const std::vector<int64_t> shape = {cache.size(0), cache.size(2), cache.size(1)};
  FK_CHECK_VALUE(scores.scalar_type() == at::kFloat && scores.sizes() == at::IntArrayRef(shape) &&
                     scores.is_contiguous() && scores.device() == cache.device(),
                 op, ": scores must be a contiguous float32 tensor of shape ", as_tuple(shape),
                 " ([num_pages, num_kv_heads, page_size]) on ", cache.device(), ", got ", dtype_name(scores.scalar_type()),
                 " ", as_tuple(scores.sizes()));
}

int64_t check_page_table(const char* op, const Tensor& kv_indptr, const Tensor& kv_indices,
                         const Tensor& kv_last_page_len, const Tensor& ref) {
  check_index(op, "kv_indptr", kv_indptr, ref, -1);
  const int64_t batch = kv_indptr.size(0) - 1;
  FK_CHECK_VALUE(batch >= 0 && batch <= 65535, op, ": kv_indptr must have batch_size + 1 entries, batch_size <= 65535");
  check_index(op, "kv_indices", kv_indices, ref, -1);
  check_index(op, "kv_last_page_len", kv_last_page_len, ref, batch);
  return batch;
}

void kv_scores(const Tensor& q, const Tensor& lse, const Tensor& k_cache, const Tensor& qo_indptr,
               const Tensor& kv_indptr, const Tensor& kv_indices, const Tensor& kv_last_page_len, Tensor& scores,
               int64_t max_kv_len, double sm_scale, double scale, bool causal, int64_t window_left,
               double logits_soft_cap, bool accumulate, const std::optional<Tensor>& logits) {
  const char* op = "kv_scores";
  check_cache_view(op, "k_cache", k_cache);
  FK_CHECK_VALUE(q.dim() == 3 && q.size(2) == k_cache.size(3), op,
                 ": q must be 3-D [tokens, num_qo_heads, head_dim] with k_cache's head_dim, got shape ",
                 as_tuple(q.sizes()));
  check_same(op, "q", q, "k_cache", k_cache, /*same_shape=*/false);
  check_last_dim_contiguous(op, "q", q);
  FK_CHECK_VALUE(rows_aligned16(q), op, ": q must start on a 16-byte boundary and have strides that are multiples of 8");
  const int64_t qo_heads = q.size(1), kv_heads = k_cache.size(2);
  FK_CHECK_VALUE(qo_heads % kv_heads == 0, op, ": num_qo_heads (", qo_heads, ") must be a multiple of num_kv_heads (",
                 kv_heads, ")");
  FK_CHECK_VALUE(lse.scalar_type() == at::kFloat && lse.sizes() == q.sizes().slice(0, 2) && lse.is_contiguous() &&
                     lse.device() == q.device(),
                 op, ": lse must be a contiguous float32 tensor of shape ", as_tuple(q.sizes().slice(0, 2)));
  const int64_t batch = check_page_table(op, kv_indptr, kv_indices, kv_last_page_len, q);
  check_index(op, "qo_indptr", qo_indptr, q, batch + 1);
  check_scores(op, scores, k_cache);
  FK_CHECK_VALUE(max_kv_len >= 0 && max_kv_len <= (int64_t(1) << 30), op, ": max_kv_len must be in [0, 2^30], got ",
                 max_kv_len);
  FK_CHECK_VALUE(window_left >= -1 && window_left < (int64_t(1) << 30), op,
                 ": window_left must be -1 (none) or in [0, 2^30), got ", window_left);
  FK_CHECK_VALUE(std::isfinite(sm_scale) && std::isfinite(scale), op, ": sm_scale and scale must be finite");
  FK_CHECK_VALUE(std::isfinite(logits_soft_cap) && (logits_soft_cap == 0 || logits_soft_cap >= 1e-6), op,
                 ": logits_soft_cap must be 0 (none) or a finite number >= 1e-6, got ", logits_soft_cap);
  if (logits.has_value())
    FK_CHECK_VALUE(logits->scalar_type() == at::kFloat && logits->dim() == 3 && logits->size(0) == q.size(0) &&
                       logits->size(1) == qo_heads && logits->size(2) >= max_kv_len && logits->is_contiguous() &&
                       logits->device() == q.device(),
                   op, ": logits must be a contiguous float32 tensor [", q.size(0), ", ", qo_heads,
                   ", >= max_kv_len (", max_kv_len, ")] on ", q.device());
  const c10::DeviceGuard guard(q.device());
  fk::KvScoresParams p{};
  p.scores = scores.data_ptr<float>();
  p.q = q.const_data_ptr();
  p.q_strides[0] = q.stride(0), p.q_strides[1] = q.stride(1);
  p.lse = lse.const_data_ptr<float>();
  p.k_cache = k_cache.const_data_ptr();
  for (int d = 0; d < 3; ++d) p.k_strides[d] = k_cache.stride(d);
  p.qo_indptr = qo_indptr.const_data_ptr<int32_t>();
  p.kv_indptr = kv_indptr.const_data_ptr<int32_t>();
  p.kv_indices = kv_indices.const_data_ptr<int32_t>();
  p.kv_last_page_len = kv_last_page_len.const_data_ptr<int32_t>();
  p.num_pages = k_cache.size(0);
  p.max_kv_len = max_kv_len;
  p.batch = int(batch), p.qo_heads = int(qo_heads), p.kv_heads = int(kv_heads);
  p.head_dim = int(q.size(2)), p.page_size = int(k_cache.size(1));
  p.window_left = int(window_left);
  p.sm_scale = float(sm_scale), p.logits_soft_cap = float(logits_soft_cap), p.scale = float(scale);
  p.causal = causal, p.accumulate = accumulate;
  p.dtype = to_dtype(q.scalar_type());
  p.logits = logits.has_value() ? logits->const_data_ptr<float>() : nullptr;
  p.logits_stride = logits.has_value() ? logits->size(2) : 0;
  check_launch(fk::launch_kv_scores(p, current_stream(q)), op);
}

Tensor kv_select(const Tensor& scores, const Tensor& kv_indptr, const Tensor& kv_indices,
                 const Tensor& kv_last_page_len, const Tensor& kept_indptr, int64_t num_kept, int64_t window,
                 int64_t keep_first, int64_t pool) {
  const char* op = "kv_select";
  FK_CHECK_VALUE(scores.scalar_type() == at::kFloat && scores.dim() == 3 && scores.is_contiguous() &&
                     scores.size(1) > 0 && scores.size(1) <= 65535 && scores.size(2) > 0,
                 op, ": scores must be a contiguous float32 tensor [num_pages, num_kv_heads, page_size], got ",
                 dtype_name(scores.scalar_type()), " ", as_tuple(scores.sizes()));
  const int64_t batch = check_page_table(op, kv_indptr, kv_indices, kv_last_page_len, scores);
  check_index(op, "kept_indptr", kept_indptr, scores, batch + 1);
  FK_CHECK_VALUE(num_kept >= 0 && num_kept < (int64_t(1) << 31), op, ": num_kept must be in [0, 2^31), got ", num_kept);
  FK_CHECK_VALUE(window >= 0 && keep_first >= 0 && window < (int64_t(1) << 30) && keep_first < (int64_t(1) << 30),
                 op, ": window and keep_first must be in [0, 2^30), got ", window, " and ", keep_first);
  FK_CHECK_VALUE(pool >= 1 && pool % 2 == 1 && pool <= 63, op, ": kernel_size must be an odd int in [1, 63], got ",
                 pool);
  const c10::DeviceGuard guard(scores.device());
  Tensor kept = at::empty({num_kept, scores.size(1)}, scores.options().dtype(at::kInt));
  fk::KvSelectParams p{};
  p.kept = kept.data_ptr<int32_t>();
  p.kept_indptr = kept_indptr.const_data_ptr<int32_t>();
  p.scores = scores.const_data_ptr<float>();
  p.kv_indptr = kv_indptr.const_data_ptr<int32_t>();
  p.kv_indices = kv_indices.const_data_ptr<int32_t>();
  p.kv_last_page_len = kv_last_page_len.const_data_ptr<int32_t>();
  p.batch = int(batch), p.kv_heads = int(scores.size(1)), p.page_size = int(scores.size(2));
  p.window = int(window), p.keep_first = int(keep_first), p.pool = int(pool);
  check_launch(fk::launch_kv_select(p, current_stream(scores)), op);
  return kept;
}

void kv_compact(Tensor& k_cache, Tensor& v_cache, const std::optional<Tensor>& scores, const Tensor& kv_indptr,
                const Tensor& kv_indices, const Tensor& kept, const Tensor& kept_indptr, const Tensor& out_indptr,
                const Tensor& out_indices) {
  const char* op = "kv_compact";
  check_cache_view(op, "k_cache", k_cache);
  check_same(op, "v_cache", v_cache, "k_cache", k_cache);
  check_cache_view(op, "v_cache", v_cache);
  if (scores) check_scores(op, *scores, k_cache);
  check_index(op, "kv_indptr", kv_indptr, k_cache, -1);
  const int64_t batch = kv_indptr.size(0) - 1;
  FK_CHECK_VALUE(batch >= 0 && batch <= (int64_t(1) << 31) - 1, op, ": kv_indptr must have batch_size + 1 entries");
  check_index(op, "kv_indices", kv_indices, k_cache, -1);
  check_index(op, "kept_indptr", kept_indptr, k_cache, batch + 1);
  check_index(op, "out_indptr", out_indptr, k_cache, batch + 1);
  check_index(op, "out_indices", out_indices, k_cache, -1);
  FK_CHECK_TYPE(kept.scalar_type() == at::kInt, op, ": kept must be int32, got ", dtype_name(kept.scalar_type()));
  FK_CHECK_VALUE(kept.dim() == 2 && kept.size(1) == k_cache.size(2) && kept.is_contiguous() &&
                     kept.device() == k_cache.device(),
                 op, ": kept must be a contiguous int32 tensor [num_kept, num_kv_heads] on ", k_cache.device(),
                 ", got shape ", as_tuple(kept.sizes()));
  const c10::DeviceGuard guard(k_cache.device());
  fk::KvCompactParams p{};
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  for (int d = 0; d < 3; ++d) p.k_strides[d] = k_cache.stride(d), p.v_strides[d] = v_cache.stride(d);
  p.scores = scores ? scores->data_ptr<float>() : nullptr;
  p.kv_indptr = kv_indptr.const_data_ptr<int32_t>();
  p.kv_indices = kv_indices.const_data_ptr<int32_t>();
  p.kept = kept.const_data_ptr<int32_t>();
  p.kept_indptr = kept_indptr.const_data_ptr<int32_t>();
  p.out_indptr = out_indptr.const_data_ptr<int32_t>();
  p.out_indices = out_indices.const_data_ptr<int32_t>();
  p.batch = int(batch), p.kv_heads = int(k_cache.size(2)), p.head_dim = int(k_cache.size(3));
  p.page_size = int(k_cache.size(1));
  p.dtype = to_dtype(k_cache.scalar_type());
  check_launch(fk::launch_kv_compact(p, current_stream(k_cache)), op);
}

void register_kv_compress(torch::Library& m) {
  m.impl("kv_scores", &kv_scores);
  m.impl("kv_select", &kv_select);
  m.impl("kv_compact", &kv_compact);
}

}  // namespace
