// The training step: the multi-tensor gradient norm and AdamW. Part of the torch glue: included once,
// by gpu_ops.cpp (one translation unit). The checks mirror python/flashkern/_validate.py
// (check_grad_norm, check_adamw).
#pragma once

#include <ATen/ops/zeros.h>

#include <cstring>

#include "common.h"

namespace {

bool optim_dtype(at::ScalarType s) { return s == at::kFloat || s == at::kHalf || s == at::kBFloat16; }

bool is_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// A tensor of a multi-tensor op: on `device`, dense and contiguous, not sparse.
void check_listed(const char* op, const char* list, size_t i, const Tensor& t, const Tensor& ref) {
  FK_CHECK_VALUE(t.layout() == at::kStrided, op, ": ", list, "[", i, "] is sparse; sparse gradients are not supported");
  FK_CHECK_VALUE(t.device() == ref.device(), op, ": ", list, "[", i, "] is on ", t.device(), " but ", list,
                    "[0] is on ", ref.device(), " (one device per call)");
  FK_CHECK_VALUE(t.is_contiguous(), op, ": ", list, "[", i, "] must be contiguous");
}

void check_fp32_like(const char* op, const char* list, size_t i, const Tensor& t, const Tensor& param) {
  check_listed(op, list, i, t, param);
  FK_CHECK_TYPE(t.scalar_type() == at::kFloat, op, ": ", list, "[", i, "] must be torch.float32, got ",
                   dtype_name(t.scalar_type()));
  FK_CHECK_VALUE(t.numel() == param.numel(), op, ": ", list, "[", i, "] must have ", param.numel(),
                    " elements (its parameter's), got ", t.numel());
}

void check_scalar(const char* op, const char* name, const Tensor& t, const Tensor& ref, int64_t numel = 1) {
  FK_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but the tensors are on ",
                    ref.device());
  FK_CHECK_TYPE(t.scalar_type() == at::kFloat, op, ": ", name, " must be torch.float32, got ",
                   dtype_name(t.scalar_type()));
  FK_CHECK_VALUE(t.numel() == numel && t.is_contiguous(), op, ": ", name, " must be a contiguous tensor of ", numel,
                    " element(s), got shape ", as_tuple(t.sizes()));
}

// The table entries of `grads` (and, for AdamW, the rest), their chunks numbered in order.
std::vector<fk::OptimTensor> optim_entries(at::TensorList grads) {
  std::vector<fk::OptimTensor> entries(grads.size());
  int64_t chunk = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    fk::OptimTensor& e = entries[i];
    e.grad = grads[i].const_data_ptr();
    e.numel = grads[i].numel();
    e.chunk_begin = chunk;
    e.dtype = int32_t(to_dtype(grads[i].scalar_type()));
    e.wide = is_aligned16(e.grad);
    chunk += fk::optim_chunks(e.numel);
  }
  return entries;
}

int64_t total_chunks(const std::vector<fk::OptimTensor>& entries) {
  return entries.empty() ? 0 : entries.back().chunk_begin + fk::optim_chunks(entries.back().numel);
}

// The entries into the device table: compared with table_host (what the table holds), written to
// both only when an address or size changed, so a fixed parameter set uploads once. The upload is
// an asynchronous copy from a pinned staging buffer that the caching host allocator keeps until the
// copy has run. table_host is cleared before the copy and written after it: a copy that raises
// leaves a mirror that matches no entries, so the next call uploads again instead of trusting it.
void upload_table(const char* op, const std::vector<fk::OptimTensor>& entries, Tensor& table, Tensor& table_host,
                  const Tensor& ref, bool allow_upload) {
  const int64_t bytes = int64_t(entries.size() * sizeof(fk::OptimTensor));
  FK_CHECK_VALUE(table.scalar_type() == at::kByte && table.is_contiguous() && table.numel() >= bytes &&
                        table.device() == ref.device() && (reinterpret_cast<uintptr_t>(table.const_data_ptr()) & 7u) == 0,
                    op, ": table must be a contiguous, 8-byte aligned torch.uint8 tensor of at least ", bytes,
                    " bytes on ", ref.device());
  FK_CHECK_VALUE(table_host.scalar_type() == at::kByte && table_host.is_contiguous() &&
                        table_host.numel() >= bytes && table_host.device().is_cpu(),
                    op, ": table_host must be a contiguous torch.uint8 CPU tensor of at least ", bytes, " bytes");
  if (bytes == 0 || std::memcmp(table_host.const_data_ptr(), entries.data(), size_t(bytes)) == 0) return;
  FK_CHECK_VALUE(allow_upload, op, ": the tensors' addresses changed while a CUDA graph is being captured; run a "
                    "step eagerly with the same tensors (gradients included) before capturing");
  std::memset(table_host.data_ptr(), 0, size_t(bytes));  // no entry is zeros: an address, or wide if none
  Tensor staging = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(!table.device().is_cpu()));
  std::memcpy(staging.data_ptr(), entries.data(), size_t(bytes));
  table.narrow(0, 0, bytes).copy_(staging, /*non_blocking=*/true);
  std::memcpy(table_host.data_ptr(), entries.data(), size_t(bytes));
}

fk::NormKind norm_kind(double p) {
  if (std::isinf(p)) return fk::NormKind::linf;
  if (p == 2.0) return fk::NormKind::l2;
  if (p == 1.0) return fk::NormKind::l1;
  return fk::NormKind::lp;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> grad_norm(at::TensorList tensors, double norm_type,
                                                     std::optional<double> max_norm, bool per_tensor, Tensor& table,
                                                     Tensor& table_host, bool allow_upload) {
  const char* op = "grad_norm";
  FK_CHECK_VALUE(!tensors.empty(), op, ": no tensors");
  FK_CHECK_VALUE(norm_type > 0 && !std::isnan(norm_type), op, ": norm_type must be positive or inf, got ", norm_type);
  const Tensor& ref = tensors[0];
  for (size_t i = 0; i < tensors.size(); ++i) {
    check_listed(op, "tensors", i, tensors[i], ref);
    FK_CHECK_TYPE(optim_dtype(tensors[i].scalar_type()), op, ": tensors[", i,
                     "] must be float16, bfloat16 or float32, got ", dtype_name(tensors[i].scalar_type()));
  }
  const c10::DeviceGuard guard(ref.device());
  const std::vector<fk::OptimTensor> entries = optim_entries(tensors);
  upload_table(op, entries, table, table_host, ref, allow_upload);
  const auto f32 = ref.options().dtype(at::kFloat);
  const int64_t n = int64_t(tensors.size()), chunks = total_chunks(entries);
  Tensor total = at::empty({}, f32), norms = at::empty({n}, f32), found_inf = at::empty({}, f32);
  Tensor coef = at::empty({max_norm ? (per_tensor ? n : 1) : 0}, f32);
  Tensor partials = at::empty({chunks}, f32);
  fk::GradNormParams p{};
  p.table = static_cast<const fk::OptimTensor*>(table.const_data_ptr());
  p.tensors = n;
  p.chunks = chunks;
  p.partials = partials.data_ptr<float>();
  p.total_norm = total.data_ptr<float>();
  p.tensor_norms = norms.data_ptr<float>();
  p.clip_coef = max_norm ? coef.data_ptr<float>() : nullptr;
  p.found_inf = found_inf.data_ptr<float>();
  p.max_norm = float(max_norm.value_or(0.0));
  p.norm_type = float(norm_type);
  p.kind = norm_kind(norm_type);
  p.per_tensor = per_tensor;
  check_launch(fk::launch_grad_norm(p, current_stream(ref)), op);
  return {total, norms, coef, found_inf};
}

void adamw(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
           at::TensorList masters, at::TensorList steps, const std::optional<Tensor>& lr_tensor, double lr,
           double beta1, double beta2, double eps, double weight_decay, bool maximize,
           const std::optional<Tensor>& clip_coef, bool per_tensor_clip, const std::optional<Tensor>& found_inf,
           Tensor& table, Tensor& table_host, bool allow_upload) {
  const char* op = "adamw";
  const size_t n = params.size();
  FK_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n &&
                        (masters.empty() || masters.size() == n),
                    op, ": params, grads, exp_avgs, exp_avg_sqs and steps (and masters, unless empty) must be lists "
                    "of the same length");
  if (n == 0) return;
  const Tensor& ref = params[0];
  for (size_t i = 0; i < n; ++i) {
    const Tensor& p = params[i];
    check_listed(op, "params", i, p, ref);
    FK_CHECK_TYPE(optim_dtype(p.scalar_type()), op, ": params[", i, "] must be float16, bfloat16 or float32, got ",
                     dtype_name(p.scalar_type()));
    check_listed(op, "grads", i, grads[i], ref);
    FK_CHECK_TYPE(grads[i].scalar_type() == p.scalar_type(), op, ": grads[", i, "] must have its parameter's dtype (",
                     dtype_name(p.scalar_type()), "), got ", dtype_name(grads[i].scalar_type()));
    FK_CHECK_VALUE(grads[i].sizes() == p.sizes(), op, ": grads[", i, "] must have its parameter's shape ",
                      as_tuple(p.sizes()), ", got ", as_tuple(grads[i].sizes()));
    check_fp32_like(op, "exp_avgs", i, exp_avgs[i], p);
    check_fp32_like(op, "exp_avg_sqs", i, exp_avg_sqs[i], p);
    if (!masters.empty() && masters[i].numel() > 0) check_fp32_like(op, "masters", i, masters[i], p);
    check_scalar(op, "steps[i]", steps[i], ref);
  }
  if (lr_tensor) check_scalar(op, "lr", *lr_tensor, ref);
  if (clip_coef) check_scalar(op, "clip_coef", *clip_coef, ref, per_tensor_clip ? int64_t(n) : 1);
  if (found_inf) check_scalar(op, "found_inf", *found_inf, ref);
  const c10::DeviceGuard guard(ref.device());
  std::vector<fk::OptimTensor> entries = optim_entries(grads);
  for (size_t i = 0; i < n; ++i) {
    fk::OptimTensor& e = entries[i];
    e.param = params[i].data_ptr();
    e.exp_avg = exp_avgs[i].data_ptr<float>();
    e.exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
    e.master = !masters.empty() && masters[i].numel() > 0 ? masters[i].data_ptr<float>() : nullptr;
    e.step = steps[i].data_ptr<float>();
    e.wide = e.wide && is_aligned16(e.param) && is_aligned16(e.exp_avg) && is_aligned16(e.exp_avg_sq) &&
             (e.master == nullptr || is_aligned16(e.master));
  }
  upload_table(op, entries, table, table_host, ref, allow_upload);
  fk::AdamWParams p{};
  p.table = static_cast<const fk::OptimTensor*>(table.const_data_ptr());
  p.tensors = int64_t(n);
  p.chunks = total_chunks(entries);
  p.lr_ptr = lr_tensor ? lr_tensor->const_data_ptr<float>() : nullptr;
  p.lr = lr;
  p.beta1 = beta1;
  p.beta2 = beta2;
  p.beta2_f = float(beta2);
  p.one_minus_beta1 = float(1.0 - beta1);
  p.one_minus_beta2 = float(1.0 - beta2);
  p.eps = float(eps);
  p.weight_decay = weight_decay;
  p.clip_coef = clip_coef ? clip_coef->const_data_ptr<float>() : nullptr;
  p.found_inf = found_inf ? found_inf->const_data_ptr<float>() : nullptr;
  p.per_tensor_clip = per_tensor_clip;
  p.maximize = maximize;
  check_launch(fk::launch_adamw(p, current_stream(ref)), op);
}

void register_optim(torch::Library& m) {
  m.impl("grad_norm", &grad_norm);
  m.impl("adamw", &adamw);
}

}  // namespace
