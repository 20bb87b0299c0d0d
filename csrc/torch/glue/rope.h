// Rotary embedding, out of place and in place: positions and a float32 frequency table.
// inv_freq [rotary_dim / 2] or a cos_sin_cache [rows, rotary_dim].
// Part of the torch glue: included once, by gpu_ops.cpp (one translation unit).
#pragma once

#include "common.h"

namespace {

int64_t check_rope(const char* op, const Tensor& q, const Tensor& k, const Tensor& positions, const Tensor& freqs) {
  FK_CHECK_VALUE(q.dim() == 3, op, ": q must be 3-D [tokens, heads, head_dim], got shape ",
                    as_tuple(q.sizes()));
  check_float(op, "q", q);
  check_same(op, "k", k, "q", q, /*same_shape=*/false);
  FK_CHECK_VALUE(k.dim() == 3 && k.size(0) == q.size(0) && k.size(2) == q.size(2), op,
                    ": k must be [tokens, heads, head_dim] with q's tokens and head_dim, got shape ",
                    as_tuple(k.sizes()));
  check_last_dim_contiguous(op, "q", q);
  check_last_dim_contiguous(op, "k", k);
  FK_CHECK_TYPE(positions.scalar_type() == at::kInt || positions.scalar_type() == at::kLong, op,
                   ": positions must be int32 or int64, got ", dtype_name(positions.scalar_type()));
  FK_CHECK_VALUE(positions.device() == q.device(), op, ": positions is on ", positions.device(), " but q is on ",
                    q.device());
  FK_CHECK_VALUE(positions.dim() == 1 && positions.size(0) == q.size(0), op, ": positions must have shape [",
                    q.size(0), "] (one per token), got ", as_tuple(positions.sizes()));
  FK_CHECK_TYPE(freqs.scalar_type() == at::kFloat, op,
                   ": the frequency table (inv_freq or cos_sin_cache) must be float32, got ",
                   dtype_name(freqs.scalar_type()));
  FK_CHECK_VALUE(freqs.device() == q.device(), op, ": the frequency table is on ", freqs.device(), " but q is on ",
                    q.device());
  FK_CHECK_VALUE((freqs.dim() == 1 || freqs.dim() == 2) && freqs.is_contiguous(), op,
                    ": the frequency table must be a contiguous inv_freq [rotary_dim / 2] or cos_sin_cache "
                    "[max_position, rotary_dim], got shape ",
                    as_tuple(freqs.sizes()));
  const int64_t rotary_dim = freqs.dim() == 1 ? 2 * freqs.size(0) : freqs.size(1);
  FK_CHECK_VALUE(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= q.size(2), op,
                    ": rotary_dim must be even, positive and at most head_dim ", q.size(2), ", got ", rotary_dim);
  return rotary_dim;
}

// Positions outside a cos_sin_cache cannot be checked without a host sync: the kernel writes NaN
// for such a token's rotated dimensions instead of reading past the cache.
void rope_launch(const Tensor& q_out, const Tensor& k_out, const Tensor& q, const Tensor& k, const Tensor& positions,
                 const Tensor& freqs, int64_t rotary_dim, bool interleave, bool inverse, bool in_place) {
  const c10::DeviceGuard guard(q.device());
  const Tensor pos = positions.contiguous();
  fk::RopeParams p{};
  p.q_out = q_out.data_ptr();
  p.k_out = k_out.data_ptr();
  p.q = q.const_data_ptr();
  p.k = k.const_data_ptr();
  p.positions = pos.const_data_ptr();
  const bool cache = freqs.dim() == 2;
  p.inv_freq = cache ? nullptr : freqs.const_data_ptr<float>();
  p.cos_sin_cache = cache ? freqs.const_data_ptr<float>() : nullptr;
  p.cache_rows = cache ? freqs.size(0) : 0;
  const Tensor* tensors[] = {&q_out, &k_out, &q, &k};
  int64_t* strides[] = {p.q_out_strides, p.k_out_strides, p.q_strides, p.k_strides};
  for (int i = 0; i < 4; ++i) {
    strides[i][0] = tensors[i]->stride(0);
    strides[i][1] = tensors[i]->stride(1);
  }
  p.tokens = q.size(0);
  p.q_heads = int(q.size(1));
  p.k_heads = int(k.size(1));
  p.head_dim = int(q.size(2));
  p.rotary_dim = int(rotary_dim);
  p.positions_int64 = pos.scalar_type() == at::kLong;
  p.interleave = interleave;
  p.inverse = inverse;
  p.in_place = in_place;
  p.dtype = to_dtype(q.scalar_type());
  check_launch(fk::launch_rope(p, current_stream(q)), "rope");
}

std::tuple<Tensor, Tensor> rope(const Tensor& q, const Tensor& k, const Tensor& positions, const Tensor& freqs,
                                bool interleave, bool inverse) {
  const int64_t rotary_dim = check_rope("rope", q, k, positions, freqs);
  Tensor q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  rope_launch(q_out, k_out, q, k, positions, freqs, rotary_dim, interleave, inverse, /*in_place=*/false);
  return {q_out, k_out};
}

void rope_(Tensor& q, Tensor& k, const Tensor& positions, const Tensor& freqs, bool interleave) {
  const int64_t rotary_dim = check_rope("rope", q, k, positions, freqs);
  at::assert_no_internal_overlap(q);
  at::assert_no_internal_overlap(k);
  at::assert_no_overlap(q, k);
  rope_launch(q, k, q, k, positions, freqs, rotary_dim, interleave, /*inverse=*/false, /*in_place=*/true);
}

void register_rope(torch::Library& m) {
  m.impl("rope", &rope);
  m.impl("rope_", &rope_);
}

}  // namespace
