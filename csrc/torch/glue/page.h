// Appending to a paged KV cache (ops.h: AppendPagedKvParams). Part of the torch glue: included once, by
// gpu_ops.cpp. The checks mirror python/flashkern/_validate.py (check_append_paged_kv_cache); what needs
// the page tables' or positions' contents is checked by the CPU reference only (the kernel skips such a
// token, ops.h), since reading them here would synchronize with the device.
#pragma once

#include "common.h"
#include "kv_compress.h"

namespace {

bool is_fp8(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2 || t == at::kFloat8_e4m3fnuz || t == at::kFloat8_e5m2fnuz;
}

fk::numeric::Fp8 to_fp8(at::ScalarType t) {
  switch (t) {
    case at::kFloat8_e4m3fn:
      return fk::numeric::Fp8::e4m3fn;
    case at::kFloat8_e5m2:
      return fk::numeric::Fp8::e5m2;
    case at::kFloat8_e4m3fnuz:
      return fk::numeric::Fp8::e4m3fnuz;
    default:
      return fk::numeric::Fp8::e5m2fnuz;
  }
}

// Rows of 8-element vectors: the data 8-element aligned, every stride but the last a multiple of 8.
void check_vector_rows(const char* op, const char* name, const Tensor& t) {
  check_last_dim_contiguous(op, name, t);
  const int64_t bytes = 8 * int64_t(t.element_size());
  bool ok = reinterpret_cast<uintptr_t>(t.const_data_ptr()) % uintptr_t(bytes) == 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) ok = ok && (t.size(d) <= 1 || t.stride(d) % 8 == 0);
  FK_CHECK_VALUE(ok, op, ": ", name, " must start on a ", bytes,
                 "-byte boundary and have strides that are multiples of 8 elements, got strides ",
                 as_tuple(t.strides()));
}

// A scale: a float32 tensor [kv_heads] on the cache's device, and a value > 0, finite in float32 (used
// where the tensor is None).
void check_scale(const char* op, const char* name, const std::optional<Tensor>& t, double value, const Tensor& cache) {
  if (t.has_value()) {
    FK_CHECK_TYPE(t->scalar_type() == at::kFloat, op, ": ", name, " must be a float32 tensor, got ",
                  dtype_name(t->scalar_type()));
    FK_CHECK_VALUE(t->dim() == 1 && t->size(0) == cache.size(2) && t->is_contiguous() && t->device() == cache.device(),
                   op, ": ", name, " must be a contiguous tensor of shape (", cache.size(2), ",) ([num_kv_heads]) on ",
                   cache.device(), ", got shape ", as_tuple(t->sizes()), " on ", t->device());
  }
  const float f = float(value);  // the kernel's scale: the value as float32
  FK_CHECK_VALUE(std::isfinite(f) && f > 0.f, op, ": ", name, " must be a number > 0 that is finite in float32, got ",
                 value);
}

void append_paged_kv_cache(const Tensor& append_key, const Tensor& append_value, const Tensor& batch_indices,
                           const Tensor& positions, Tensor& k_cache, Tensor& v_cache, const Tensor& kv_indices,
                           const Tensor& kv_indptr, const Tensor& kv_last_page_len, const std::optional<Tensor>& k_scale,
                           const std::optional<Tensor>& v_scale, double k_scale_value, double v_scale_value) {
  const char* op = "append_paged_kv_cache";
  const auto dtype = append_key.scalar_type();
  FK_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16, op, ": append_key must be float16 or bfloat16, got ",
                dtype_name(dtype));
  FK_CHECK_VALUE(append_key.dim() == 3, op, ": append_key must be 3-D [nnz, num_kv_heads, head_dim], got shape ",
                 as_tuple(append_key.sizes()));
  check_same(op, "append_value", append_value, "append_key", append_key);
  const int64_t nnz = append_key.size(0), kv_heads = append_key.size(1), head_dim = append_key.size(2);
  FK_CHECK_VALUE(head_dim > 0 && head_dim % 8 == 0, op, ": head_dim must be a positive multiple of 8, got ", head_dim);
  const auto cache_dtype = k_cache.scalar_type();
  FK_CHECK_TYPE(cache_dtype == dtype || is_fp8(cache_dtype), op, ": k_cache must have the dtype of append_key (",
                dtype_name(dtype), ") or an fp8 dtype (float8_e4m3fn, float8_e5m2, float8_e4m3fnuz, float8_e5m2fnuz), got ",
                dtype_name(cache_dtype));
  FK_CHECK_VALUE(k_cache.dim() == 4 && k_cache.size(2) == kv_heads && k_cache.size(3) == head_dim, op,
                 ": k_cache must be 4-D [pages, page_size, num_kv_heads, head_dim] with append_key's num_kv_heads and "
                 "head_dim (",
                 kv_heads, ", ", head_dim, "), got shape ", as_tuple(k_cache.sizes()));
  FK_CHECK_VALUE(k_cache.device() == append_key.device(), op, ": k_cache is on ", k_cache.device(),
                 " but append_key is on ", append_key.device());
  check_same(op, "v_cache", v_cache, "k_cache", k_cache);
  FK_CHECK_VALUE(k_cache.size(1) > 0 && k_cache.size(1) < (int64_t(1) << 31), op,
                 ": k_cache must have a page_size in [1, 2^31), got shape ", as_tuple(k_cache.sizes()));
  check_vector_rows(op, "append_key", append_key);
  check_vector_rows(op, "append_value", append_value);
  check_vector_rows(op, "k_cache", k_cache);
  check_vector_rows(op, "v_cache", v_cache);
  FK_CHECK_VALUE(nnz * kv_heads * (head_dim / 8) <= (int64_t(1) << 30), op,
                 ": append_key has too many elements (nnz * num_kv_heads * head_dim must be at most 2^33), got shape ",
                 as_tuple(append_key.sizes()));
  check_index(op, "batch_indices", batch_indices, append_key, nnz);
  check_index(op, "positions", positions, append_key, nnz);
  check_index(op, "kv_indptr", kv_indptr, append_key, -1);
  const int64_t batch = kv_indptr.size(0) - 1;
  FK_CHECK_VALUE(batch >= 0, op, ": kv_indptr must have batch_size + 1 entries, got none");
  check_index(op, "kv_indices", kv_indices, append_key, -1);
  check_index(op, "kv_last_page_len", kv_last_page_len, append_key, batch);
  if (is_fp8(cache_dtype)) {
    check_scale(op, "k_scale", k_scale, k_scale_value, k_cache);
    check_scale(op, "v_scale", v_scale, v_scale_value, k_cache);
  } else {
    FK_CHECK_VALUE(!k_scale && !v_scale && k_scale_value == 1.0 && v_scale_value == 1.0, op,
                   ": k_scale and v_scale are for an fp8 cache; k_cache is ", dtype_name(cache_dtype));
  }
  const c10::DeviceGuard guard(append_key.device());
  fk::AppendPagedKvParams p{};
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  for (int d = 0; d < 3; ++d) p.k_strides[d] = k_cache.stride(d), p.v_strides[d] = v_cache.stride(d);
  p.append_key = append_key.const_data_ptr();
  p.append_value = append_value.const_data_ptr();
  for (int d = 0; d < 2; ++d) p.key_strides[d] = append_key.stride(d), p.value_strides[d] = append_value.stride(d);
  p.batch_indices = batch_indices.const_data_ptr<int32_t>();
  p.positions = positions.const_data_ptr<int32_t>();
  p.kv_indptr = kv_indptr.const_data_ptr<int32_t>();
  p.kv_indices = kv_indices.const_data_ptr<int32_t>();
  p.k_scale = k_scale ? k_scale->const_data_ptr<float>() : nullptr;
  p.v_scale = v_scale ? v_scale->const_data_ptr<float>() : nullptr;
  p.k_scale_value = float(k_scale_value), p.v_scale_value = float(v_scale_value);
  p.num_pages = k_cache.size(0), p.num_indices = kv_indices.size(0), p.nnz = nnz;
  p.batch = int(batch), p.kv_heads = int(kv_heads), p.head_dim = int(head_dim), p.page_size = int(k_cache.size(1));
  p.dtype = to_dtype(dtype);
  p.quantize = is_fp8(cache_dtype);
  p.fp8 = to_fp8(cache_dtype);
  check_launch(fk::launch_append_paged_kv(p, current_stream(append_key)), op);
}

void register_page(torch::Library& m) { m.impl("append_paged_kv_cache", &append_paged_kv_cache); }

}  // namespace
