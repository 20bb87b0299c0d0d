// Run-time dtype -> compile-time type, for the launchers. Instantiations stay bounded: one per
// storage type, and norm weights are either the input's type or fp32.
#pragma once

#include <cstdint>
#include <type_traits>

#include "flashkern/numeric.h"
#include "flashkern/ops.h"

namespace fk {

template <typename F>
decltype(auto) with_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f16:
      return f(half_t{});
    case DType::bf16:
      return f(bf16_t{});
    default:
      return f(float{});
  }
}

// The 16-bit types only (the attention kernels).
template <typename F>
decltype(auto) with_dtype16(DType dtype, F&& f) {
  if (dtype == DType::bf16) return f(bf16_t{});
  return f(half_t{});
}

// The supported attention head dims, 64, 128 or 256, as compile-time constants.
template <typename F>
decltype(auto) with_head_dim(int head_dim, F&& f) {
  if (head_dim == 64) return f(std::integral_constant<int, 64>{});
  if (head_dim == 128) return f(std::integral_constant<int, 128>{});
  return f(std::integral_constant<int, 256>{});
}

// The attention kernels' head dims: those and 512 (16-row tiles only: attention_work.h).
template <typename F>
decltype(auto) with_attention_head_dim(int head_dim, F&& f) {
  if (head_dim == 512) return f(std::integral_constant<int, 512>{});
  return with_head_dim(head_dim, static_cast<F&&>(f));
}

// The storage type of a norm weight: fp32, or the same type as the input.
template <typename T, typename F>
decltype(auto) with_weight_dtype(DType weight_dtype, F&& f) {
  if (weight_dtype == DType::f32) return f(float{});
  return f(T{});
}

template <typename F>
decltype(auto) with_activation(Activation act, F&& f) {
  switch (act) {
    case Activation::gelu:
      return f(std::integral_constant<Activation, Activation::gelu>{});
    case Activation::gelu_tanh:
      return f(std::integral_constant<Activation, Activation::gelu_tanh>{});
    default:
      return f(std::integral_constant<Activation, Activation::silu>{});
  }
}

// The gradient norm kinds of the training step (kernels/optim.cuh).
template <typename F>
decltype(auto) with_norm_kind(NormKind kind, F&& f) {
  switch (kind) {
    case NormKind::l1:
      return f(std::integral_constant<NormKind, NormKind::l1>{});
    case NormKind::lp:
      return f(std::integral_constant<NormKind, NormKind::lp>{});
    case NormKind::linf:
      return f(std::integral_constant<NormKind, NormKind::linf>{});
    default:
      return f(std::integral_constant<NormKind, NormKind::l2>{});
  }
}

template <typename F>
decltype(auto) with_bool(bool b, F&& f) {
  if (b) return f(std::true_type{});
  return f(std::false_type{});
}

#if defined(FK_GPU)
// nullptr, or why the launch just made failed (bad configuration, no kernel image for the device).
inline const char* last_launch_error() {
  const gpuError_t e = gpuGetLastError();
  return e == gpuSuccess ? nullptr : gpuGetErrorString(e);
}
#endif

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace fk
