// Storage types for 16-bit floats and their conversions to and from fp32.
// half_t and bf16_t are plain 16-bit words, so kernels never depend on cuda_fp16.h / hip_bf16.h
// types; arithmetic is always done in fp32. The software conversions here are bit-exact
// round-to-nearest-even (subnormals, overflow to inf and NaN included) and are the host path,
// the bf16 path on AMD, and the oracle for tests/test_host_code.py; device passes with a
// conversion instruction (FK_HW_HALF, FK_HW_BF16 from platform.h) use it instead.
#pragma once

#include <cstdint>

#include "flashkern/platform.h"

namespace fk {

struct half_t {
  uint16_t bits;
  static constexpr bool kIsBf16 = false;
};
struct bf16_t {
  uint16_t bits;
  static constexpr bool kIsBf16 = true;
};

template <typename To, typename From>
FK_HOST_DEVICE To bit_cast(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs equal sizes");
  To to;
  __builtin_memcpy(&to, &from, sizeof(To));
  return to;
}

namespace numeric {

FK_HOST_DEVICE float bf16_bits_to_float(uint16_t b) { return bit_cast<float>(uint32_t(b) << 16); }

FK_HOST_DEVICE uint16_t float_to_bf16_bits(float f) {
  uint32_t u = bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // NaN stays NaN (quiet)
  u += 0x7fffu + ((u >> 16) & 1u);  // round half to even on the 16 dropped bits
  return uint16_t(u >> 16);
}

FK_HOST_DEVICE float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in fp32
    const float mag = float(mant) * 5.9604644775390625e-8f;
    return bit_cast<float>(bit_cast<uint32_t>(mag) | sign);
  }
  if (exp == 31) return bit_cast<float>(sign | 0x7f800000u | (mant << 13));  // inf, NaN
  return bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

FK_HOST_DEVICE uint16_t float_to_half_bits(float f) {
  const uint32_t x = bit_cast<uint32_t>(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t mag = x & 0x7fffffffu;
  const uint32_t exp = mag >> 23;
  if (mag > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
  if (exp >= 143) return uint16_t(sign | 0x7c00u);         // >= 2^16 (or inf): inf
  if (exp >= 113) {                                        // normal half (carry may round up to inf)
    uint32_t h = ((exp - 112u) << 10) | ((mag >> 13) & 0x3ffu);
    const uint32_t rest = mag & 0x1fffu;
    h += (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ? 1u : 0u;
    return uint16_t(sign | h);
  }
  if (exp < 102) return sign;  // below 2^-25: rounds to zero
  // Subnormal half: m * 2^-24 with m = mant24 * 2^(exp - 126), rounded half to even.
  const uint32_t mant = (mag & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - exp;  // 14..24
  uint32_t m = mant >> shift;
  const uint32_t rest = mant & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  m += (rest > halfway || (rest == halfway && (m & 1u))) ? 1u : 0u;
  return uint16_t(sign | m);
}

}  // namespace numeric

FK_HOST_DEVICE float to_float(float x) { return x; }
FK_HOST_DEVICE float to_float(bf16_t x) { return numeric::bf16_bits_to_float(x.bits); }
FK_HOST_DEVICE float to_float(half_t x) {
#if defined(FK_HW_HALF)
  return hw::half_bits_to_float(x.bits);
#else
  return numeric::half_bits_to_float(x.bits);
#endif
}

template <typename T>
FK_HOST_DEVICE T from_float(float x);
template <>
FK_HOST_DEVICE float from_float<float>(float x) {
  return x;
}
template <>
FK_HOST_DEVICE half_t from_float<half_t>(float x) {
#if defined(FK_HW_HALF)
  return half_t{hw::float_to_half_bits(x)};
#else
  return half_t{numeric::float_to_half_bits(x)};
#endif
}
template <>
FK_HOST_DEVICE bf16_t from_float<bf16_t>(float x) {
#if defined(FK_HW_BF16)
  return bf16_t{hw::float_to_bf16_bits(x)};
#else
  return bf16_t{numeric::float_to_bf16_bits(x)};
#endif
}

}  // namespace fk
