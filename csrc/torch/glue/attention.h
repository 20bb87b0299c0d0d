// Attention: merging attention states, and batch attention as planned in a workspace
// (decode, cascade and prefill: python/flashkern/_paged_attention.py plans, this launches).
// Part of the torch glue: included once, by gpu_ops.cpp (one translation unit).
#pragma once

#include "common.h"

namespace {

// ---- attention states ----

void check_state(const char* op, const char* v_name, const Tensor& v, const char* s_name, const Tensor& s,
                 int64_t rank) {
  FK_CHECK_VALUE(v.dim() == rank, op, ": ", v_name, " must be ", rank, "-D ",
                    rank == 4 ? "[tokens, num_states, heads, head_dim]" : "[tokens, heads, head_dim]", ", got shape ",
                    as_tuple(v.sizes()));
  check_float(op, v_name, v);
  check_last_dim_contiguous(op, v_name, v);
  FK_CHECK_VALUE(v.size(-1) > 0, op, ": head_dim (last dimension of ", v_name, ") must be positive");
  FK_CHECK_TYPE(s.scalar_type() == at::kFloat, op, ": ", s_name, " (the log-sum-exp) must be float32, got ",
                   dtype_name(s.scalar_type()));
  FK_CHECK_VALUE(s.device() == v.device(), op, ": ", s_name, " is on ", s.device(), " but ", v_name, " is on ",
                    v.device());
  FK_CHECK_VALUE(s.sizes() == v.sizes().slice(0, rank - 1), op, ": ", s_name, " must have shape ",
                    as_tuple(v.sizes().slice(0, rank - 1)), " (", v_name, "'s without head_dim), got ",
                    as_tuple(s.sizes()));
}

// The stacked states v [tokens, n, heads, head_dim] (or one state [tokens, heads, head_dim] as n = 1),
// plus an optional extra state, merged into v_out / s_out.
void launch_merge(const char* op, const Tensor& v_out, const Tensor& s_out, const Tensor& v, const Tensor& s,
                  const Tensor* v_other, const Tensor* s_other, const std::optional<Tensor>& mask) {
  const c10::DeviceGuard guard(v.device());
  const Tensor v4 = v.dim() == 4 ? v : v.unsqueeze(1), s3 = s.dim() == 3 ? s : s.unsqueeze(1);
  fk::MergeStatesParams p{};
  p.v_out = v_out.data_ptr();
  p.s_out = s_out.data_ptr<float>();
  p.v = v4.const_data_ptr();
  p.s = s3.const_data_ptr<float>();
  p.v_other = v_other ? v_other->const_data_ptr() : nullptr;
  p.s_other = s_other ? s_other->const_data_ptr<float>() : nullptr;
  const Tensor mask_c = mask ? mask->contiguous() : Tensor();
  p.mask = mask ? mask_c.const_data_ptr<bool>() : nullptr;
  for (int i = 0; i < 3; ++i) {
    p.v_strides[i] = v4.stride(i);
    p.s_strides[i] = s3.stride(i);
  }
  for (int i = 0; i < 2; ++i) {
    p.v_out_strides[i] = v_out.stride(i);
    p.s_out_strides[i] = s_out.stride(i);
    p.v_other_strides[i] = v_other ? v_other->stride(i) : 0;
    p.s_other_strides[i] = s_other ? s_other->stride(i) : 0;
  }
  p.tokens = v4.size(0);
  p.num_states = int(v4.size(1));
  p.heads = int(v4.size(2));
  p.head_dim = int(v4.size(3));
  p.dtype = to_dtype(v.scalar_type());
  check_launch(fk::launch_merge_states(p, current_stream(v)), op);
}

std::tuple<Tensor, Tensor> merge_state(const Tensor& v_a, const Tensor& s_a, const Tensor& v_b, const Tensor& s_b) {
  const char* op = "merge_state";
  check_state(op, "v_a", v_a, "s_a", s_a, 3);
  check_same(op, "v_b", v_b, "v_a", v_a);
  check_state(op, "v_b", v_b, "s_b", s_b, 3);
  Tensor v = at::empty(v_a.sizes(), v_a.options()), s = at::empty(s_a.sizes(), s_a.options());
  launch_merge(op, v, s, v_a, s_a, &v_b, &s_b, std::nullopt);
  return {v, s};
}

void merge_state_in_place(Tensor& v, Tensor& s, const Tensor& v_other, const Tensor& s_other,
                          const std::optional<Tensor>& mask) {
  const char* op = "merge_state_in_place";
  check_state(op, "v", v, "s", s, 3);
  check_same(op, "v_other", v_other, "v", v);
  check_state(op, "v_other", v_other, "s_other", s_other, 3);
  if (mask) {
    FK_CHECK_VALUE(mask->scalar_type() == at::kBool && mask->dim() == 1 && mask->size(0) == v.size(0) &&
                          mask->device() == v.device(),
                      op, ": mask must be a bool tensor of shape (", v.size(0), ",) on ", v.device(), ", got ",
                      dtype_name(mask->scalar_type()), " of shape ", as_tuple(mask->sizes()), " on ", mask->device());
  }
  at::assert_no_internal_overlap(v);
  at::assert_no_internal_overlap(s);
  launch_merge(op, v, s, v, s, &v_other, &s_other, mask);
}

std::tuple<Tensor, Tensor> merge_states(const Tensor& v, const Tensor& s) {
  const char* op = "merge_states";
  check_state(op, "v", v, "s", s, 4);
  Tensor v_out = at::empty({v.size(0), v.size(2), v.size(3)}, v.options());
  Tensor s_out = at::empty({s.size(0), s.size(2)}, s.options());
  if (v.size(1) == 0) return {v_out.zero_(), s_out.fill_(-INFINITY)};  // no states: the empty state
  launch_merge(op, v_out, s_out, v, s, nullptr, nullptr, std::nullopt);
  return {v_out, s_out};
}

// ---- batch attention over a paged KV cache ----

// 16-byte aligned start and rows (every stride but the last a multiple of 16 bytes: 8 16-bit
// elements, 16 fp8 ones): the kernels copy 16 bytes at a time.
bool rows_aligned16(const Tensor& t) {
  bool ok = reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) ok = ok && (t.size(d) <= 1 || t.stride(d) * t.element_size() % 16 == 0);
  return ok;
}

// An fp8 cache's numeric::Fp8, or -1 for any other dtype.
int fp8_format(at::ScalarType t) {
  switch (t) {
    case at::kFloat8_e4m3fn:
      return int(fk::numeric::Fp8::e4m3fn);
    case at::kFloat8_e5m2:
      return int(fk::numeric::Fp8::e5m2);
    case at::kFloat8_e4m3fnuz:
      return int(fk::numeric::Fp8::e4m3fnuz);
    case at::kFloat8_e5m2fnuz:
      return int(fk::numeric::Fp8::e5m2fnuz);
    default:
      return -1;
  }
}

// An fp8 cache's k_scale / v_scale: [kv_heads] float32 on the cache's device, or nullptr.
const float* kv_scale(const char* op, const char* name, const std::optional<Tensor>& scale, int kv_format,
                      int64_t kv_heads, const Tensor& cache) {
  if (!scale.has_value()) return nullptr;
  FK_CHECK_VALUE(kv_format >= 0, op, ": ", name, " as a tensor needs an fp8 cache (a 16-bit one takes a number)");
  FK_CHECK_VALUE(scale->scalar_type() == at::kFloat && scale->dim() == 1 && scale->size(0) == kv_heads &&
                     scale->is_contiguous() && scale->device() == cache.device(),
                 op, ": ", name, " must be a contiguous float32 tensor of shape (", kv_heads, ",) (one per KV head) on ",
                 cache.device());
  return scale->const_data_ptr<float>();
}

void batch_attention(const Tensor& q_in, const Tensor& k_cache, const Tensor& v_cache, at::TensorList kv_indices,
                     Tensor& workspace, Tensor& out, Tensor& lse, at::IntArrayRef grid, double sm_scale,
                     const std::optional<Tensor>& sinks, double out_scale, bool enable_pdl,
                     const std::optional<Tensor>& custom_mask, double logits_soft_cap,
                     const std::optional<Tensor>& logits, const std::optional<Tensor>& k_scale,
                     const std::optional<Tensor>& v_scale) {
  const char* op = "batch_attention";
  FK_CHECK_VALUE(q_in.dim() == 3, op, ": q must be 3-D [batch, num_qo_heads, head_dim], got shape ",
                    as_tuple(q_in.sizes()));
  FK_CHECK_TYPE(q_in.scalar_type() == at::kHalf || q_in.scalar_type() == at::kBFloat16, op,
                   ": q must be float16 or bfloat16, got ", dtype_name(q_in.scalar_type()));
  check_last_dim_contiguous(op, "q", q_in);
  const int64_t batch = q_in.size(0), qo_heads = q_in.size(1), head_dim = q_in.size(2);
  FK_CHECK_VALUE(head_dim == 64 || head_dim == 128 || head_dim == 256 || head_dim == 512, op,
                 ": head_dim must be 64, 128, 256 or 512, got ", head_dim);
  const int kv_format = fp8_format(k_cache.scalar_type());
  if (kv_format < 0) {
    check_same(op, "k_cache", k_cache, "q", q_in, /*same_shape=*/false);
  } else {
    FK_CHECK_VALUE(k_cache.device() == q_in.device(), op, ": k_cache is on ", k_cache.device(), " but q is on ",
                   q_in.device());
    FK_CHECK_TYPE(fk::batch_attention_fp8_formats() >> kv_format & 1, op, ": kv_data_type ",
                  dtype_name(k_cache.scalar_type()), " is not supported on this device (NVIDIA GPUs read "
                  "torch.float8_e4m3fn and torch.float8_e5m2; the fnuz formats are AMD's)");
  }
  check_same(op, "v_cache", v_cache, "k_cache", k_cache);
  FK_CHECK_VALUE(k_cache.dim() == 4 && k_cache.size(3) == head_dim, op,
                    ": k_cache must be 4-D [pages, page_size, num_kv_heads, head_dim] with q's head_dim ", head_dim,
                    ", got shape ", as_tuple(k_cache.sizes()));
  check_last_dim_contiguous(op, "k_cache", k_cache);
  check_last_dim_contiguous(op, "v_cache", v_cache);
  const int64_t kv_heads = k_cache.size(2), page_size = k_cache.size(1);
  FK_CHECK_VALUE(kv_heads > 0 && qo_heads % kv_heads == 0, op, ": num_qo_heads (", qo_heads,
                    ") must be a multiple of num_kv_heads (", kv_heads, ")");
  FK_CHECK_VALUE(page_size > 0 && page_size < (int64_t(1) << 31), op, ": page_size must be in [1, 2^31), got ",
                    page_size);
  FK_CHECK_VALUE(rows_aligned16(k_cache) && rows_aligned16(v_cache), op,
                    ": paged_kv_cache must start on a 16-byte boundary and have strides that are multiples of 16 "
                    "bytes (", 16 / k_cache.element_size(), " elements; the kernels read 16 bytes at a time), got strides ",
                    as_tuple(k_cache.strides()));
  FK_CHECK_VALUE(kv_indices.size() >= 1 && kv_indices.size() <= size_t(fk::kMaxLevels), op,
                    ": kv_indices must be a list of 1 to ", fk::kMaxLevels, " tensors (one per level)");
  for (size_t i = 0; i < kv_indices.size(); ++i) {
    FK_CHECK_TYPE(kv_indices[i].scalar_type() == at::kInt, op, ": kv_indices[", i, "] must be int32, got ",
                     dtype_name(kv_indices[i].scalar_type()));
    FK_CHECK_VALUE(kv_indices[i].dim() == 1 && kv_indices[i].device() == q_in.device() &&
                          (kv_indices[i].numel() <= 1 || kv_indices[i].stride(0) == 1),
                      op, ": kv_indices[", i, "] must be a contiguous 1-D tensor on ", q_in.device());
    FK_CHECK_VALUE(kv_indices[i].numel() < (int64_t(1) << 31), op, ": kv_indices[", i,
                      "] must have fewer than 2^31 entries, got ", kv_indices[i].numel());
  }
  FK_CHECK_VALUE(workspace.scalar_type() == at::kByte && workspace.dim() == 1 && workspace.is_contiguous() &&
                        workspace.device() == q_in.device(),
                    op, ": workspace must be a contiguous 1-D uint8 tensor on ", q_in.device());
  FK_CHECK_VALUE(reinterpret_cast<uintptr_t>(workspace.const_data_ptr()) % 16 == 0, op,
                    ": workspace must start on a 16-byte boundary");
  FK_CHECK_VALUE((out.scalar_type() == at::kHalf || out.scalar_type() == at::kBFloat16) &&
                        out.sizes() == q_in.sizes() && out.is_contiguous() && out.device() == q_in.device(),
                    op, ": out must be a contiguous float16 or bfloat16 tensor of shape ", as_tuple(q_in.sizes()),
                    " on ", q_in.device());
  FK_CHECK_VALUE(reinterpret_cast<uintptr_t>(out.const_data_ptr()) % 16 == 0, op,
                    ": out must start on a 16-byte boundary");
  FK_CHECK_VALUE(lse.scalar_type() == at::kFloat && lse.sizes() == q_in.sizes().slice(0, 2) && lse.is_contiguous() &&
                        lse.device() == q_in.device(),
                    op, ": lse must be a contiguous float32 tensor of shape ", as_tuple(q_in.sizes().slice(0, 2)));
  FK_CHECK_VALUE(grid.size() == 4, op, ": grid must be four non-negative block counts, got ", grid);
  for (const int64_t g : grid)
    FK_CHECK_VALUE(g >= 0 && g < (int64_t(1) << 31), op, ": grid must be four non-negative block counts, got ", grid);
  FK_CHECK_VALUE(head_dim <= fk::kMaxWideHeadDim || (grid[0] == 0 && grid[2] == 0), op, ": head_dim ", head_dim,
                 " runs 16-row tiles only (its plans have no other items): grid[0] and grid[2] must be 0, got ", grid);
  FK_CHECK_VALUE(std::isfinite(sm_scale), op, ": sm_scale must be finite, got ", sm_scale);
  FK_CHECK_VALUE(std::isfinite(out_scale), op, ": out_scale must be finite, got ", out_scale);
  if (sinks.has_value())
    FK_CHECK_VALUE(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == qo_heads &&
                          sinks->is_contiguous() && sinks->device() == q_in.device(),
                      op, ": sinks must be a contiguous float32 tensor of shape (", qo_heads, ",) on ", q_in.device());
  if (custom_mask.has_value())
    FK_CHECK_VALUE(custom_mask->scalar_type() == at::kByte && custom_mask->dim() == 1 &&
                          custom_mask->is_contiguous() && custom_mask->device() == q_in.device(),
                      op, ": custom_mask must be a contiguous 1-D uint8 tensor (packed bits) on ", q_in.device());
  FK_CHECK_VALUE(std::isfinite(logits_soft_cap) && (logits_soft_cap == 0 || logits_soft_cap >= 1e-6), op,
                    ": logits_soft_cap must be 0 (none) or a finite number >= 1e-6, got ", logits_soft_cap);
  if (logits.has_value()) {  // the positions the kernels write are checked by the caller (kv_scores: max_kv_len)
    FK_CHECK_VALUE(logits->scalar_type() == at::kFloat && logits->dim() == 3 && logits->size(0) == batch &&
                       logits->size(1) == qo_heads && logits->is_contiguous() && logits->device() == q_in.device(),
                   op, ": logits must be a contiguous float32 tensor [", batch, ", ", qo_heads, ", max_kv_len] on ",
                   q_in.device());
    FK_CHECK_VALUE(kv_indices.size() == 1 && !custom_mask.has_value() && grid[2] == 0, op,
                   ": logits need a plan of one level, no custom mask and no 64-row tiles (grid[2] == 0): the "
                   "kernels write a key's logit at its position in that level");
  }
  const float* k_scales = kv_scale(op, "k_scale", k_scale, kv_format, kv_heads, k_cache);
  const float* v_scales = kv_scale(op, "v_scale", v_scale, kv_format, kv_heads, k_cache);
  if (batch == 0) return;

  const c10::DeviceGuard guard(q_in.device());
  // q is small: a misaligned view is copied (contiguous() alone would keep a contiguous misaligned one)
  const Tensor q = rows_aligned16(q_in) ? q_in : at::empty(q_in.sizes(), q_in.options()).copy_(q_in);
  const fk::WorkspaceLayout layout = fk::workspace_layout(workspace.numel(), batch, qo_heads, head_dim);
  uint8_t* base = workspace.data_ptr<uint8_t>();
#if defined(FLASHKERN_EMULATED_OPS)  // the plan is in host memory here: checked as the reference checks it
  const auto* header = reinterpret_cast<const fk::PlanHeader*>(base);
  FK_CHECK_VALUE(workspace.numel() >= int64_t(sizeof(fk::PlanHeader)) && header->magic == fk::kPlanMagic &&
                     header->batch == batch,
                 op, ": the workspace holds no flashkern plan for ", batch, " queries (a wrapper's plan() writes it)");
#endif
  fk::BatchAttentionParams p{};
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.q = q.const_data_ptr();
  p.q_strides[0] = q.stride(0), p.q_strides[1] = q.stride(1);
  p.k_cache = k_cache.const_data_ptr(), p.v_cache = v_cache.const_data_ptr();
  for (int i = 0; i < 3; ++i) p.k_strides[i] = k_cache.stride(i), p.v_strides[i] = v_cache.stride(i);
  p.num_pages = k_cache.size(0);
  for (size_t i = 0; i < kv_indices.size(); ++i) {
    p.kv_indices[i] = kv_indices[i].const_data_ptr<int32_t>();
    p.kv_indices_len[i] = int32_t(kv_indices[i].numel());
  }
  p.plan = reinterpret_cast<const int32_t*>(base);
  p.partial_s = reinterpret_cast<float*>(base + layout.partial_s_offset);
  p.partial_v = reinterpret_cast<float*>(base + layout.partial_v_offset);
  for (int i = 0; i < 4; ++i) p.grid[i] = int(grid[i]);
  p.batch = int(batch), p.qo_heads = int(qo_heads), p.kv_heads = int(kv_heads), p.head_dim = int(head_dim);
  p.page_size = int(page_size);
  p.page_div = fk::Divmod(uint32_t(page_size));
  p.sinks = sinks.has_value() ? sinks->const_data_ptr<float>() : nullptr;
  p.custom_mask = custom_mask.has_value() ? custom_mask->const_data_ptr<uint8_t>() : nullptr;
  p.custom_mask_bytes = custom_mask.has_value() ? custom_mask->numel() : 0;
  p.sm_scale = float(sm_scale);
  p.logits_soft_cap = float(logits_soft_cap);
  p.out_scale = float(out_scale);
  p.dtype = to_dtype(q.scalar_type());
  p.kv_format = kv_format;
  p.k_scale = k_scales, p.v_scale = v_scales;
  p.out_dtype = to_dtype(out.scalar_type());
  p.pdl = enable_pdl;
  p.logits = logits.has_value() ? logits->data_ptr<float>() : nullptr;
  p.logits_stride = logits.has_value() ? logits->size(2) : 0;
  check_launch(fk::launch_batch_attention(p, current_stream(q)), op);
}

void register_attention(torch::Library& m) {
  m.impl("merge_state", &merge_state);
  m.impl("merge_state_in_place", &merge_state_in_place);
  m.impl("merge_states", &merge_states);
  m.impl("batch_attention", &batch_attention);
}

}  // namespace
