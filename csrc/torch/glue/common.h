// What the torch glue of every op family shares: tensor checks with Python's messages, dtype and
// row-layout conversions to the torch-free params of flashkern/ops.h, the current stream, launch
// errors. Included once, by gpu_ops.cpp (one translation unit), through the family files.
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
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

// Check messages: numbers are formatted here (std::to_string, snprintf), never streamed through
// std::ostream from this library. On the H200 image (torch 2.11, GCC 13.3 at /opt/gcc; 2026-12-04)
// every check whose message streamed an int or a double from this library crashed the process with
// SIGSEGV, while those that streamed strings raised as they should.
std::string as_tuple(at::IntArrayRef v);
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, std::string_view v) { s += v; }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
void append(std::string& s, T v) {
  s += std::to_string(v);
}
inline void append(std::string& s, double v) {  // "%g": what an ostream prints by default
  char text[32];
  std::snprintf(text, sizeof(text), "%g", v);
  s += text;
}
inline void append(std::string& s, at::IntArrayRef v) { s += as_tuple(v); }
inline void append(std::string& s, const c10::Device& d) { s += d.str(); }
template <class... Args>
std::string message(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}
#define FK_CHECK(cond, ...) TORCH_CHECK(cond, message(__VA_ARGS__))
#define FK_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, message(__VA_ARGS__))
#define FK_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, message(__VA_ARGS__))

void check_launch(const char* error, const char* op) { FK_CHECK(error == nullptr, op, ": kernel launch failed: ", error); }

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
    case at::kFloat8_e4m3fn:
      return "torch.float8_e4m3fn";
    case at::kFloat8_e5m2:
      return "torch.float8_e5m2";
    case at::kFloat8_e4m3fnuz:
      return "torch.float8_e4m3fnuz";
    case at::kFloat8_e5m2fnuz:
      return "torch.float8_e5m2fnuz";
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
  FK_CHECK_TYPE(s == at::kHalf || s == at::kBFloat16 || s == at::kFloat, op, ": ", name,
                   " must be float16, bfloat16 or float32, got ", dtype_name(s));
}

void check_same(const char* op, const char* name, const Tensor& t, const char* ref_name, const Tensor& ref,
                bool same_shape = true) {
  FK_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name, " is on ",
                    ref.device());
  FK_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have the dtype of ", ref_name, " (",
                   dtype_name(ref.scalar_type()), "), got ", dtype_name(t.scalar_type()));
  if (same_shape)
    FK_CHECK_VALUE(t.sizes() == ref.sizes(), op, ": ", name, " must have the shape of ", ref_name, " ",
                      as_tuple(ref.sizes()), ", got ", as_tuple(t.sizes()));
}

void check_last_dim_contiguous(const char* op, const char* name, const Tensor& t) {
  FK_CHECK_VALUE(t.dim() >= 1 && (t.size(-1) <= 1 || t.stride(-1) == 1), op, ": ", name,
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

}  // namespace
