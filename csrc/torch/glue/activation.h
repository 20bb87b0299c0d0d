// Gated activations (act_and_mul on [.., 2d], act_mul on two tensors) and their backward.
// One kernel family, the activation a run-time argument.
// Part of the torch glue: included once, by gpu_ops.cpp (one translation unit).
#pragma once

#include "common.h"

namespace {

fk::Activation to_activation(const char* op, const std::string& name) {
  if (name == "silu") return fk::Activation::silu;
  if (name == "gelu") return fk::Activation::gelu;
  if (name == "gelu_tanh") return fk::Activation::gelu_tanh;
  FK_CHECK_VALUE(false, op, ": activation must be 'silu', 'gelu' or 'gelu_tanh', got '", name, "'");
  return fk::Activation::silu;  // not reached
}

void check_act_and_mul(const char* op, const Tensor& input) {
  FK_CHECK_VALUE(input.dim() >= 1, op, ": input must have at least one dimension, got a scalar");
  check_float(op, "input", input);
  FK_CHECK_VALUE(input.size(-1) % 2 == 0, op,
                    ": the last dimension of input must be even (gate and up halves), got ", input.size(-1));
  check_last_dim_contiguous(op, "input", input);
}

std::vector<int64_t> half_last_dim(const Tensor& t) {
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  shape.back() /= 2;
  return shape;
}

// Errors name the public op: silu_and_mul, gelu_and_mul, gelu_tanh_and_mul.
std::string public_name(c10::string_view activation, const char* suffix = "") {
  return std::string(activation) + "_and_mul" + suffix;
}

// out or grad_out of an *_and_mul op: input's device, dtype and shape with the last dimension halved.
void check_half_output(const char* op, const char* name, const Tensor& t, const Tensor& input) {
  check_same(op, name, t, "input", input, /*same_shape=*/false);
  const std::vector<int64_t> expected = half_last_dim(input);
  FK_CHECK_VALUE(t.sizes() == expected, op, ": ", name, " must have shape ",
                    as_tuple(expected), " (input's with the last dimension halved), got ", as_tuple(t.sizes()));
  check_last_dim_contiguous(op, name, t);
}

// out = act(gate) * up over rows; gate and up are [.., cols] tensors or the halves of one input.
void launch_act_mul(const char* op, const Tensor& out, const Tensor& gate, const Tensor& up, fk::Activation act,
                    bool enable_pdl = false) {
  const c10::DeviceGuard guard(gate.device());
  Rows out_rows(out, Access::write), gate_rows(gate, Access::read), up_rows(up, Access::read);
  fk::ActAndMulParams p{};
  p.out = out_rows.tensor.data_ptr();
  p.gate = gate_rows.tensor.const_data_ptr();
  p.up = up_rows.tensor.const_data_ptr();
  p.out_rows = out_rows.layout;
  p.gate_rows = gate_rows.layout;
  p.up_rows = up_rows.layout;
  p.rows = num_rows(gate);
  p.cols = gate.size(-1);
  p.dtype = to_dtype(gate.scalar_type());
  p.act = act;
  p.pdl = enable_pdl;
  check_launch(fk::launch_act_and_mul(p, current_stream(gate)), op);
  out_rows.finish();
}

Tensor launch_act_mul_backward(const char* op, Tensor& grad_gate, Tensor& grad_up, const Tensor& grad_out,
                               const Tensor& gate, const Tensor& up, fk::Activation act) {
  const c10::DeviceGuard guard(gate.device());
  Rows dg_rows(grad_gate, Access::write), du_rows(grad_up, Access::write), dy_rows(grad_out, Access::read),
      g_rows(gate, Access::read), u_rows(up, Access::read);
  fk::ActAndMulBackwardParams p{};
  p.grad_gate = dg_rows.tensor.data_ptr();
  p.grad_up = du_rows.tensor.data_ptr();
  p.grad_out = dy_rows.tensor.const_data_ptr();
  p.gate = g_rows.tensor.const_data_ptr();
  p.up = u_rows.tensor.const_data_ptr();
  p.grad_gate_rows = dg_rows.layout;
  p.grad_up_rows = du_rows.layout;
  p.grad_out_rows = dy_rows.layout;
  p.gate_rows = g_rows.layout;
  p.up_rows = u_rows.layout;
  p.rows = num_rows(gate);
  p.cols = gate.size(-1);
  p.dtype = to_dtype(gate.scalar_type());
  p.act = act;
  check_launch(fk::launch_act_and_mul_backward(p, current_stream(gate)), op);
  dg_rows.finish();
  du_rows.finish();
  return grad_gate;
}

// The halves of input [.., 2d]: views, so the kernel reads input in place.
std::pair<Tensor, Tensor> halves(const Tensor& input) {
  const int64_t d = input.size(-1) / 2;
  return {input.narrow(-1, 0, d), input.narrow(-1, d, d)};
}

void act_and_mul_out(Tensor& out, const Tensor& input, c10::string_view activation, bool enable_pdl) {
  const fk::Activation act = to_activation("act_and_mul", std::string(activation));
  const std::string name = public_name(activation);
  const char* op = name.c_str();
  check_act_and_mul(op, input);
  check_half_output(op, "out", out, input);
  at::assert_no_internal_overlap(out);
  at::assert_no_overlap(out, input);
  const auto [gate, up] = halves(input);
  launch_act_mul(op, out, gate, up, act, enable_pdl);
}

Tensor act_and_mul(const Tensor& input, c10::string_view activation, bool enable_pdl) {
  const fk::Activation act = to_activation("act_and_mul", std::string(activation));
  const std::string name = public_name(activation);
  check_act_and_mul(name.c_str(), input);
  Tensor out = at::empty(half_last_dim(input), input.options());  // fresh: none of out='s checks apply
  const auto [gate, up] = halves(input);
  launch_act_mul(name.c_str(), out, gate, up, act, enable_pdl);
  return out;
}

Tensor act_and_mul_backward(const Tensor& grad_out, const Tensor& input, c10::string_view activation) {
  const fk::Activation act = to_activation("act_and_mul", std::string(activation));
  const std::string name = public_name(activation, "_backward");
  const char* op = name.c_str();
  check_act_and_mul(op, input);
  check_half_output(op, "grad_out", grad_out, input);
  Tensor grad_input = at::empty(input.sizes(), input.options());
  const auto [gate, up] = halves(input);
  auto [grad_gate, grad_up] = halves(grad_input);
  launch_act_mul_backward(op, grad_gate, grad_up, grad_out, gate, up, act);
  return grad_input;
}

void check_act_mul(const char* op, const Tensor& gate, const Tensor& up) {
  FK_CHECK_VALUE(gate.dim() >= 1, op, ": gate must have at least one dimension, got a scalar");
  check_float(op, "gate", gate);
  check_same(op, "up", up, "gate", gate);
  check_last_dim_contiguous(op, "gate", gate);
  check_last_dim_contiguous(op, "up", up);
}

Tensor act_mul(const Tensor& gate, const Tensor& up, c10::string_view activation) {
  const fk::Activation act = to_activation("act_mul", std::string(activation));
  check_act_mul("act_mul", gate, up);
  Tensor out = at::empty(gate.sizes(), gate.options());
  launch_act_mul("act_mul", out, gate, up, act);
  return out;
}

std::tuple<Tensor, Tensor> act_mul_backward(const Tensor& grad_out, const Tensor& gate, const Tensor& up,
                                            c10::string_view activation) {
  const fk::Activation act = to_activation("act_mul", std::string(activation));
  check_act_mul("act_mul_backward", gate, up);
  check_same("act_mul_backward", "grad_out", grad_out, "gate", gate);
  check_last_dim_contiguous("act_mul_backward", "grad_out", grad_out);
  Tensor grad_gate = at::empty(gate.sizes(), gate.options()), grad_up = at::empty(up.sizes(), up.options());
  launch_act_mul_backward("act_mul_backward", grad_gate, grad_up, grad_out, gate, up, act);
  return {grad_gate, grad_up};
}

void register_activation(torch::Library& m) {
  m.impl("act_and_mul", &act_and_mul);
  m.impl("act_and_mul_out", &act_and_mul_out);
  m.impl("act_and_mul_backward", &act_and_mul_backward);
  m.impl("act_mul", &act_mul);
  m.impl("act_mul_backward", &act_mul_backward);
}

}  // namespace
