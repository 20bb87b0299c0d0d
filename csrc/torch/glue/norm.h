// RMSNorm, fused add + RMSNorm and the RMSNorm backward: checks, params, launch.
// The Gemma variants are weight_offset = 1.
// Part of the torch glue: included once, by gpu_ops.cpp (one translation unit).
#pragma once

#include "common.h"

namespace {

void check_rmsnorm(const char* op, const Tensor& input, const Tensor& weight, double eps) {
  FK_CHECK_VALUE(input.dim() == 2 || input.dim() == 3, op,
                    ": input must be 2-D [tokens, hidden] or 3-D [tokens, heads, head_dim], got shape ",
                    as_tuple(input.sizes()));
  check_float(op, "input", input);
  FK_CHECK_VALUE(input.size(-1) > 0, op, ": the hidden size (last dimension of input) must be positive");
  FK_CHECK_VALUE(weight.device() == input.device(), op, ": weight is on ", weight.device(), " but input is on ",
                    input.device());
  FK_CHECK_TYPE(weight.scalar_type() == input.scalar_type() || weight.scalar_type() == at::kFloat, op,
                   ": weight must be float32 or the dtype of input (", dtype_name(input.scalar_type()), "), got ",
                   dtype_name(weight.scalar_type()));
  FK_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == input.size(-1), op, ": weight must have shape [",
                    input.size(-1), "] to match the last dimension of input, got ", as_tuple(weight.sizes()));
  FK_CHECK_VALUE(weight.is_contiguous(), op, ": weight must be contiguous, got strides ",
                    as_tuple(weight.strides()));
  check_last_dim_contiguous(op, "input", input);
  FK_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0, op, ": eps must be a finite number >= 0, got ", eps);
}

void rmsnorm_launch(const char* op, const Tensor& out, const Tensor& input, const std::optional<Tensor>& residual,
                    const Tensor& weight, double eps, double weight_offset, bool enable_pdl) {
  const c10::DeviceGuard guard(input.device());
  Rows out_rows(out, Access::write), input_rows(input, Access::read);
  std::optional<Rows> residual_rows;
  if (residual) residual_rows.emplace(*residual, Access::read_write);
  fk::RmsnormParams p{};
  p.out = out_rows.tensor.data_ptr();
  p.input = input_rows.tensor.const_data_ptr();
  p.residual = residual_rows ? residual_rows->tensor.data_ptr() : nullptr;
  p.weight = weight.const_data_ptr();
  p.out_rows = out_rows.layout;
  p.input_rows = input_rows.layout;
  if (residual_rows) p.residual_rows = residual_rows->layout;
  p.rows = num_rows(input);
  p.cols = input.size(-1);
  p.dtype = to_dtype(input.scalar_type());
  p.weight_dtype = to_dtype(weight.scalar_type());
  p.eps = float(eps);
  p.weight_offset = float(weight_offset);
  p.pdl = enable_pdl;
  check_launch(fk::launch_rmsnorm(p, current_stream(input)), op);
  if (residual_rows) residual_rows->finish();
  out_rows.finish();
}

void rmsnorm_out(Tensor& out, const Tensor& input, const Tensor& weight, double eps, double weight_offset,
                 bool enable_pdl) {
  check_rmsnorm("rmsnorm", input, weight, eps);
  check_same("rmsnorm", "out", out, "input", input);
  check_last_dim_contiguous("rmsnorm", "out", out);
  at::assert_no_internal_overlap(out);
  at::assert_no_partial_overlap(out, input);  // out may be input itself (in place)
  rmsnorm_launch("rmsnorm", out, input, std::nullopt, weight, eps, weight_offset, enable_pdl);
}

Tensor rmsnorm(const Tensor& input, const Tensor& weight, double eps, double weight_offset, bool enable_pdl) {
  check_rmsnorm("rmsnorm", input, weight, eps);
  Tensor out = at::empty(input.sizes(), input.options());
  rmsnorm_launch("rmsnorm", out, input, std::nullopt, weight, eps, weight_offset, enable_pdl);
  return out;
}

void fused_add_rmsnorm(Tensor& input, Tensor& residual, const Tensor& weight, double eps, double weight_offset,
                       bool enable_pdl) {
  check_rmsnorm("fused_add_rmsnorm", input, weight, eps);
  check_same("fused_add_rmsnorm", "residual", residual, "input", input);
  check_last_dim_contiguous("fused_add_rmsnorm", "residual", residual);
  at::assert_no_internal_overlap(input);
  at::assert_no_internal_overlap(residual);
  at::assert_no_overlap(input, residual);
  rmsnorm_launch("fused_add_rmsnorm", input, input, residual, weight, eps, weight_offset, enable_pdl);
}

std::tuple<Tensor, Tensor> rmsnorm_backward(const Tensor& grad_out, const Tensor& input, const Tensor& weight,
                                            double eps, double weight_offset) {
  const char* op = "rmsnorm_backward";
  check_rmsnorm(op, input, weight, eps);
  check_same(op, "grad_out", grad_out, "input", input);
  check_last_dim_contiguous(op, "grad_out", grad_out);
  const c10::DeviceGuard guard(input.device());
  Tensor grad_input = at::empty(input.sizes(), input.options());
  Tensor grad_weight = at::empty(weight.sizes(), weight.options());
  Rows dx_rows(grad_input, Access::write), dy_rows(grad_out, Access::read), x_rows(input, Access::read);
  fk::RmsnormBackwardParams p{};
  p.grad_input = dx_rows.tensor.data_ptr();
  p.grad_weight = grad_weight.data_ptr();
  p.grad_out = dy_rows.tensor.const_data_ptr();
  p.input = x_rows.tensor.const_data_ptr();
  p.weight = weight.const_data_ptr();
  p.grad_input_rows = dx_rows.layout;
  p.grad_out_rows = dy_rows.layout;
  p.input_rows = x_rows.layout;
  p.rows = num_rows(input);
  p.cols = input.size(-1);
  p.dtype = to_dtype(input.scalar_type());
  p.weight_dtype = to_dtype(weight.scalar_type());
  p.eps = float(eps);
  p.weight_offset = float(weight_offset);
  if (p.rows == 0) return {grad_input, grad_weight.zero_()};
  const size_t workspace_bytes = fk::rmsnorm_backward_workspace_bytes(p);
  Tensor workspace = at::empty({int64_t(workspace_bytes / sizeof(float))}, input.options().dtype(at::kFloat));
  p.workspace = workspace.data_ptr<float>();
  check_launch(fk::launch_rmsnorm_backward(p, current_stream(input)), op);
  return {grad_input, grad_weight};
}

void register_norm(torch::Library& m) {
  m.impl("rmsnorm", &rmsnorm);
  m.impl("rmsnorm_out", &rmsnorm_out);
  m.impl("fused_add_rmsnorm", &fused_add_rmsnorm);
  m.impl("rmsnorm_backward", &rmsnorm_backward);
}

}  // namespace
