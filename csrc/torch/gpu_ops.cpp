// The GPU implementations (CUDA key; a ROCm torch dispatches HIP tensors through it too): check
// the arguments, turn tensors into the torch-free params of flashkern/ops.h, launch on the
// current stream. The checks mirror python/flashkern/_validate.py, which guards the CPU
// reference and the fake functions, so a direct torch.ops caller gets the same TypeError or
// ValueError on every device.
// Built with FLASHKERN_EMULATED_OPS=<namespace> and linked with the launchers compiled for the CPU
// emulation (CMakeLists.txt: FLASHKERN_EMULATE), the same code serves CPU tensors as the ops of that
// namespace, which the emulate backends call (python/flashkern/_backend.py).
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "flashkern/ops.h"

namespace {

using at::Tensor;

// The current stream of t's device as the runtime's handle (cudaStream_t or hipStream_t).
void* current_stream(const Tensor& t) {
#if defined(FLASHKERN_EMULATED_OPS)
  (void)t;
  return nullptr;  // the emulation runs each launch at once, on the calling thread
#else
  return c10::impl::getDeviceGuardImpl(t.device().type())->getStream(t.device()).native_handle();
#endif
}

void check_launch(const char* error, const char* op) { TORCH_CHECK(error == nullptr, op, ": kernel launch failed: ", error); }

// A dtype as Python prints it ("torch.float16"), so that messages match the Python checks'.
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return "torch.float16";
    case at::kBFloat16:
      return "torch.bfloat16";
    case at::kFloat:
      return "torch.float32";
    case at::kDouble:
      return "torch.float64";
    case at::kInt:
      return "torch.int32";
    case at::kLong:
      return "torch.int64";
    case at::kShort:
      return "torch.int16";
    case at::kChar:
      return "torch.int8";
    case at::kByte:
      return "torch.uint8";
    case at::kBool:
      return "torch.bool";
    default:
      return std::string("torch.") + c10::toString(t);
  }
}

// A shape or strides as Python prints the tuple ("(3, 2)", "(3,)"), for the same reason.
std::string as_tuple(at::IntArrayRef v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + (v.size() == 1 ? ",)" : ")");
}

fk::DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return fk::DType::f16;
    case at::kBFloat16:
      return fk::DType::bf16;
    default:
      return fk::DType::f32;
  }
}

void check_float(const char* op, const char* name, const Tensor& t) {
  const auto s = t.scalar_type();
  TORCH_CHECK_TYPE(s == at::kHalf || s == at::kBFloat16 || s == at::kFloat, op, ": ", name,
                   " must be float16, bfloat16 or float32, got ", dtype_name(s));
}

void check_same(const char* op, const char* name, const Tensor& t, const char* ref_name, const Tensor& ref,
                bool same_shape = true) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name, " is on ",
                    ref.device());
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have the dtype of ", ref_name, " (",
                   dtype_name(ref.scalar_type()), "), got ", dtype_name(t.scalar_type()));
  if (same_shape)
    TORCH_CHECK_VALUE(t.sizes() == ref.sizes(), op, ": ", name, " must have the shape of ", ref_name, " ",
                      as_tuple(ref.sizes()), ", got ", as_tuple(t.sizes()));
}

void check_last_dim_contiguous(const char* op, const char* name, const Tensor& t) {
  TORCH_CHECK_VALUE(t.dim() >= 1 && (t.size(-1) <= 1 || t.stride(-1) == 1), op, ": ", name,
                    " must be contiguous in its last dimension, got strides ", as_tuple(t.strides()));
}

// Rows of t (all dimensions but the last) as a two-level RowLayout, or nothing (see collapse_rows).
std::optional<fk::RowLayout> row_layout(const Tensor& t) {
  fk::RowLayout layout;
  if (!fk::collapse_rows(t.sizes().data(), t.strides().data(), int(t.dim()) - 1, &layout)) return std::nullopt;
  return layout;
}

// A tensor whose rows fit a RowLayout: t itself or, rare (three or more leading dimensions that
// do not merge), a contiguous stand-in; `finish` copies a written stand-in back into t.
enum class Access { read, write, read_write };

struct Rows {
  Tensor tensor;
  fk::RowLayout layout{0, 0, 1};
  Tensor original;  // defined when `tensor` stands in for it and must be copied back

  Rows(const Tensor& t, Access access) : tensor(t) {
    if (t.numel() == 0) return;  // nothing is launched
    if (auto l = row_layout(t)) {
      layout = *l;
      return;
    }
    tensor = access == Access::write ? at::empty(t.sizes(), t.options()) : t.contiguous();
    layout = *row_layout(tensor);
    if (access != Access::read) original = t;
  }
  void finish() {
    if (original.defined()) original.copy_(tensor);
  }
};

int64_t num_rows(const Tensor& t) { return t.size(-1) == 0 ? 0 : t.numel() / t.size(-1); }

// ---- rmsnorm ----

void check_rmsnorm(const char* op, const Tensor& input, const Tensor& weight, double eps) {
  TORCH_CHECK_VALUE(input.dim() == 2 || input.dim() == 3, op,
                    ": input must be 2-D [tokens, hidden] or 3-D [tokens, heads, head_dim], got shape ",
                    as_tuple(input.sizes()));
  check_float(op, "input", input);
  TORCH_CHECK_VALUE(input.size(-1) > 0, op, ": the hidden size (last dimension of input) must be positive");
  TORCH_CHECK_VALUE(weight.device() == input.device(), op, ": weight is on ", weight.device(), " but input is on ",
                    input.device());
  TORCH_CHECK_TYPE(weight.scalar_type() == input.scalar_type() || weight.scalar_type() == at::kFloat, op,
                   ": weight must be float32 or the dtype of input (", dtype_name(input.scalar_type()), "), got ",
                   dtype_name(weight.scalar_type()));
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == input.size(-1), op, ": weight must have shape [",
                    input.size(-1), "] to match the last dimension of input, got ", as_tuple(weight.sizes()));
  TORCH_CHECK_VALUE(weight.is_contiguous(), op, ": weight must be contiguous, got strides ",
                    as_tuple(weight.strides()));
  check_last_dim_contiguous(op, "input", input);
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0, op, ": eps must be a finite number >= 0, got ", eps);
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

// ---- act_and_mul ----

fk::Activation to_activation(const char* op, const std::string& name) {
  if (name == "silu") return fk::Activation::silu;
  if (name == "gelu") return fk::Activation::gelu;
  if (name == "gelu_tanh") return fk::Activation::gelu_tanh;
  TORCH_CHECK_VALUE(false, op, ": activation must be 'silu', 'gelu' or 'gelu_tanh', got '", name, "'");
  return fk::Activation::silu;  // not reached
}

void check_act_and_mul(const char* op, const Tensor& input) {
  TORCH_CHECK_VALUE(input.dim() >= 1, op, ": input must have at least one dimension, got a scalar");
  check_float(op, "input", input);
  TORCH_CHECK_VALUE(input.size(-1) % 2 == 0, op,
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
  TORCH_CHECK_VALUE(t.sizes() == expected, op, ": ", name, " must have shape ",
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
  TORCH_CHECK_VALUE(gate.dim() >= 1, op, ": gate must have at least one dimension, got a scalar");
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

// ---- rope ----

int64_t check_rope(const char* op, const Tensor& q, const Tensor& k, const Tensor& positions, const Tensor& freqs) {
  TORCH_CHECK_VALUE(q.dim() == 3, op, ": q must be 3-D [tokens, heads, head_dim], got shape ",
                    as_tuple(q.sizes()));
  check_float(op, "q", q);
  check_same(op, "k", k, "q", q, /*same_shape=*/false);
  TORCH_CHECK_VALUE(k.dim() == 3 && k.size(0) == q.size(0) && k.size(2) == q.size(2), op,
                    ": k must be [tokens, heads, head_dim] with q's tokens and head_dim, got shape ",
                    as_tuple(k.sizes()));
  check_last_dim_contiguous(op, "q", q);
  check_last_dim_contiguous(op, "k", k);
  TORCH_CHECK_TYPE(positions.scalar_type() == at::kInt || positions.scalar_type() == at::kLong, op,
                   ": positions must be int32 or int64, got ", dtype_name(positions.scalar_type()));
  TORCH_CHECK_VALUE(positions.device() == q.device(), op, ": positions is on ", positions.device(), " but q is on ",
                    q.device());
  TORCH_CHECK_VALUE(positions.dim() == 1 && positions.size(0) == q.size(0), op, ": positions must have shape [",
                    q.size(0), "] (one per token), got ", as_tuple(positions.sizes()));
  TORCH_CHECK_TYPE(freqs.scalar_type() == at::kFloat, op,
                   ": the frequency table (inv_freq or cos_sin_cache) must be float32, got ",
                   dtype_name(freqs.scalar_type()));
  TORCH_CHECK_VALUE(freqs.device() == q.device(), op, ": the frequency table is on ", freqs.device(), " but q is on ",
                    q.device());
  TORCH_CHECK_VALUE((freqs.dim() == 1 || freqs.dim() == 2) && freqs.is_contiguous(), op,
                    ": the frequency table must be a contiguous inv_freq [rotary_dim / 2] or cos_sin_cache "
                    "[max_position, rotary_dim], got shape ",
                    as_tuple(freqs.sizes()));
  const int64_t rotary_dim = freqs.dim() == 1 ? 2 * freqs.size(0) : freqs.size(1);
  TORCH_CHECK_VALUE(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= q.size(2), op,
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

// ---- attention states ----

void check_state(const char* op, const char* v_name, const Tensor& v, const char* s_name, const Tensor& s,
                 int64_t rank) {
  TORCH_CHECK_VALUE(v.dim() == rank, op, ": ", v_name, " must be ", rank, "-D ",
                    rank == 4 ? "[tokens, num_states, heads, head_dim]" : "[tokens, heads, head_dim]", ", got shape ",
                    as_tuple(v.sizes()));
  check_float(op, v_name, v);
  check_last_dim_contiguous(op, v_name, v);
  TORCH_CHECK_VALUE(v.size(-1) > 0, op, ": head_dim (last dimension of ", v_name, ") must be positive");
  TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, op, ": ", s_name, " (the log-sum-exp) must be float32, got ",
                   dtype_name(s.scalar_type()));
  TORCH_CHECK_VALUE(s.device() == v.device(), op, ": ", s_name, " is on ", s.device(), " but ", v_name, " is on ",
                    v.device());
  TORCH_CHECK_VALUE(s.sizes() == v.sizes().slice(0, rank - 1), op, ": ", s_name, " must have shape ",
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
    TORCH_CHECK_VALUE(mask->scalar_type() == at::kBool && mask->dim() == 1 && mask->size(0) == v.size(0) &&
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

// 16-byte aligned start and rows (every stride but the last a multiple of 8 elements).
bool rows_aligned16(const Tensor& t) {
  bool ok = reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) ok = ok && (t.size(d) <= 1 || t.stride(d) % 8 == 0);
  return ok;
}

void batch_attention(const Tensor& q_in, const Tensor& k_cache, const Tensor& v_cache, at::TensorList kv_indices,
                     Tensor& workspace, Tensor& out, Tensor& lse, at::IntArrayRef grid, double sm_scale,
                     const std::optional<Tensor>& sinks, double out_scale, bool enable_pdl) {
  const char* op = "batch_attention";
  TORCH_CHECK_VALUE(q_in.dim() == 3, op, ": q must be 3-D [batch, num_qo_heads, head_dim], got shape ",
                    as_tuple(q_in.sizes()));
  TORCH_CHECK_TYPE(q_in.scalar_type() == at::kHalf || q_in.scalar_type() == at::kBFloat16, op,
                   ": q must be float16 or bfloat16, got ", dtype_name(q_in.scalar_type()));
  check_last_dim_contiguous(op, "q", q_in);
  const int64_t batch = q_in.size(0), qo_heads = q_in.size(1), head_dim = q_in.size(2);
  TORCH_CHECK_VALUE(head_dim == 64 || head_dim == 128 || head_dim == 256, op,
                    ": head_dim must be 64, 128 or 256, got ", head_dim);
  check_same(op, "k_cache", k_cache, "q", q_in, /*same_shape=*/false);
  check_same(op, "v_cache", v_cache, "k_cache", k_cache);
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.size(3) == head_dim, op,
                    ": k_cache must be 4-D [pages, page_size, num_kv_heads, head_dim] with q's head_dim ", head_dim,
                    ", got shape ", as_tuple(k_cache.sizes()));
  check_last_dim_contiguous(op, "k_cache", k_cache);
  check_last_dim_contiguous(op, "v_cache", v_cache);
  const int64_t kv_heads = k_cache.size(2), page_size = k_cache.size(1);
  TORCH_CHECK_VALUE(kv_heads > 0 && qo_heads % kv_heads == 0, op, ": num_qo_heads (", qo_heads,
                    ") must be a multiple of num_kv_heads (", kv_heads, ")");
  TORCH_CHECK_VALUE(page_size > 0 && page_size < (int64_t(1) << 31), op, ": page_size must be in [1, 2^31), got ",
                    page_size);
  TORCH_CHECK_VALUE(rows_aligned16(k_cache) && rows_aligned16(v_cache), op,
                    ": paged_kv_cache must start on a 16-byte boundary and have strides that are multiples of 8 "
                    "elements (the kernels read it 16 bytes at a time), got strides ",
                    as_tuple(k_cache.strides()));
  TORCH_CHECK_VALUE(kv_indices.size() >= 1 && kv_indices.size() <= size_t(fk::kMaxLevels), op,
                    ": kv_indices must be a list of 1 to ", fk::kMaxLevels, " tensors (one per level)");
  for (size_t i = 0; i < kv_indices.size(); ++i) {
    TORCH_CHECK_TYPE(kv_indices[i].scalar_type() == at::kInt, op, ": kv_indices[", i, "] must be int32, got ",
                     dtype_name(kv_indices[i].scalar_type()));
    TORCH_CHECK_VALUE(kv_indices[i].dim() == 1 && kv_indices[i].device() == q_in.device() &&
                          (kv_indices[i].numel() <= 1 || kv_indices[i].stride(0) == 1),
                      op, ": kv_indices[", i, "] must be a contiguous 1-D tensor on ", q_in.device());
    TORCH_CHECK_VALUE(kv_indices[i].numel() < (int64_t(1) << 31), op, ": kv_indices[", i,
                      "] must have fewer than 2^31 entries, got ", kv_indices[i].numel());
  }
  TORCH_CHECK_VALUE(workspace.scalar_type() == at::kByte && workspace.dim() == 1 && workspace.is_contiguous() &&
                        workspace.device() == q_in.device(),
                    op, ": workspace must be a contiguous 1-D uint8 tensor on ", q_in.device());
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(workspace.const_data_ptr()) % 16 == 0, op,
                    ": workspace must start on a 16-byte boundary");
  TORCH_CHECK_VALUE((out.scalar_type() == at::kHalf || out.scalar_type() == at::kBFloat16) &&
                        out.sizes() == q_in.sizes() && out.is_contiguous() && out.device() == q_in.device(),
                    op, ": out must be a contiguous float16 or bfloat16 tensor of shape ", as_tuple(q_in.sizes()),
                    " on ", q_in.device());
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(out.const_data_ptr()) % 16 == 0, op,
                    ": out must start on a 16-byte boundary");
  TORCH_CHECK_VALUE(lse.scalar_type() == at::kFloat && lse.sizes() == q_in.sizes().slice(0, 2) && lse.is_contiguous() &&
                        lse.device() == q_in.device(),
                    op, ": lse must be a contiguous float32 tensor of shape ", as_tuple(q_in.sizes().slice(0, 2)));
  TORCH_CHECK_VALUE(grid.size() == 4, op, ": grid must be four non-negative block counts, got ", grid);
  for (const int64_t g : grid)
    TORCH_CHECK_VALUE(g >= 0 && g < (int64_t(1) << 31), op, ": grid must be four non-negative block counts, got ", grid);
  TORCH_CHECK_VALUE(std::isfinite(sm_scale), op, ": sm_scale must be finite, got ", sm_scale);
  TORCH_CHECK_VALUE(std::isfinite(out_scale), op, ": out_scale must be finite, got ", out_scale);
  if (sinks.has_value())
    TORCH_CHECK_VALUE(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == qo_heads &&
                          sinks->is_contiguous() && sinks->device() == q_in.device(),
                      op, ": sinks must be a contiguous float32 tensor of shape (", qo_heads, ",) on ", q_in.device());
  if (batch == 0) return;

  const c10::DeviceGuard guard(q_in.device());
  // q is small: a misaligned view is copied (contiguous() alone would keep a contiguous misaligned one)
  const Tensor q = rows_aligned16(q_in) ? q_in : at::empty(q_in.sizes(), q_in.options()).copy_(q_in);
  const fk::WorkspaceLayout layout = fk::workspace_layout(workspace.numel(), batch, qo_heads, head_dim);
  uint8_t* base = workspace.data_ptr<uint8_t>();
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
  p.sm_scale = float(sm_scale);
  p.out_scale = float(out_scale);
  p.dtype = to_dtype(q.scalar_type());
  p.out_dtype = to_dtype(out.scalar_type());
  p.pdl = enable_pdl;
  check_launch(fk::launch_batch_attention(p, current_stream(q)), op);
}

void register_impls(torch::Library& m) {
  m.impl("rmsnorm", &rmsnorm);
  m.impl("rmsnorm_out", &rmsnorm_out);
  m.impl("fused_add_rmsnorm", &fused_add_rmsnorm);
  m.impl("rmsnorm_backward", &rmsnorm_backward);
  m.impl("act_and_mul", &act_and_mul);
  m.impl("act_and_mul_out", &act_and_mul_out);
  m.impl("act_and_mul_backward", &act_and_mul_backward);
  m.impl("act_mul", &act_mul);
  m.impl("act_mul_backward", &act_mul_backward);
  m.impl("rope", &rope);
  m.impl("rope_", &rope_);
  m.impl("merge_state", &merge_state);
  m.impl("merge_state_in_place", &merge_state_in_place);
  m.impl("merge_states", &merge_states);
  m.impl("batch_attention", &batch_attention);
}

}  // namespace

#if defined(FLASHKERN_EMULATED_OPS)
#include <Python.h>

#include "schemas.h"

#define FK_CAT(a, b) FK_CAT_(a, b)
#define FK_CAT_(a, b) a##b
#define FK_STRINGIFY(a) FK_STRINGIFY_(a)
#define FK_STRINGIFY_(a) #a
#define FK_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define FK_TORCH_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)
FK_TORCH_LIBRARY(FLASHKERN_EMULATED_OPS, m) { flashkern::define_schemas(m); }
FK_TORCH_LIBRARY_IMPL(FLASHKERN_EMULATED_OPS, CPU, m) { register_impls(m); }

// `import flashkern._emulate` (or _emulate_wave64) loads the ops above.
PyMODINIT_FUNC FK_CAT(PyInit_, FLASHKERN_EMULATED_MODULE)(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, FK_STRINGIFY(FLASHKERN_EMULATED_MODULE),
                               "flashkern's kernels on the CPU emulation", -1, nullptr};
  return PyModule_Create(&module);
}
#else
TORCH_LIBRARY_IMPL(flashkern, CUDA, m) { register_impls(m); }
#endif
