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

// ---- fp8 (an 8-bit KV cache): OCP's E4M3FN and E5M2, and AMD's FNUZ variants ----
// E4M3FN: bias 7, no inf, NaN S.1111.111, max 448. E5M2: IEEE-like, bias 15, inf and NaN, max 57344.
// E4M3FNUZ / E5M2FNUZ: bias 8 / 16, no inf, no -0, the one NaN 0x80, max 240 / 57344.
enum class Fp8 : uint8_t { e4m3fn, e5m2, e4m3fnuz, e5m2fnuz };

struct Fp8Format {
  int mant_bits, bias;
  bool fnuz;
  uint8_t max_bits;  // the largest finite magnitude's code
  uint32_t max_f32;  // ... as fp32 bits
};
FK_HOST_DEVICE constexpr Fp8Format fp8_format(Fp8 f) {
  switch (f) {
    case Fp8::e4m3fn: return {3, 7, false, 0x7e, 0x43e00000u};     // 448
    case Fp8::e5m2: return {2, 15, false, 0x7b, 0x47600000u};      // 57344
    case Fp8::e4m3fnuz: return {3, 8, true, 0x7f, 0x43700000u};    // 240
    default: return {2, 16, true, 0x7f, 0x47600000u};              // e5m2fnuz: 57344
  }
}

// Exact: every fp8 value is an fp32 value.
FK_HOST_DEVICE float fp8_bits_to_float(uint8_t b, Fp8 f) {
  const Fp8Format F = fp8_format(f);
  const uint32_t sign = uint32_t(b & 0x80u) << 24;
  const int m_bits = F.mant_bits;
  const uint32_t e_max = (1u << (7 - m_bits)) - 1u;
  const uint32_t e = (b >> m_bits) & e_max, m = b & ((1u << m_bits) - 1u);
  if (F.fnuz && b == 0x80u) return bit_cast<float>(0x7fc00000u);
  if (!F.fnuz && f == Fp8::e4m3fn && (b & 0x7fu) == 0x7fu) return bit_cast<float>(sign | 0x7fc00000u);
  if (!F.fnuz && f == Fp8::e5m2 && e == e_max) return bit_cast<float>(sign | 0x7f800000u | (m << 21));  // inf, NaN
  if (e == 0) {  // zero or subnormal: m * 2^(1 - bias - m_bits)
    const float mag = float(m) * bit_cast<float>(uint32_t(127 + 1 - F.bias - m_bits) << 23);
    return bit_cast<float>(bit_cast<uint32_t>(mag) | sign);
  }
  return bit_cast<float>(sign | ((e + 127u - uint32_t(F.bias)) << 23) | (m << (23 - m_bits)));
}

// Saturating and round-to-nearest-even: a magnitude past the format's largest finite value (inf included)
// becomes that value, NaN stays NaN; torch's x.clamp(-max, max).to(fp8), bit for bit.
FK_HOST_DEVICE uint8_t float_to_fp8_bits(float x, Fp8 f) {
  const Fp8Format F = fp8_format(f);
  const uint32_t u = bit_cast<uint32_t>(x);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return F.fnuz ? uint8_t(0x80u) : uint8_t(sign | 0x7fu);  // NaN
  if (mag >= F.max_f32) return uint8_t(sign | F.max_bits);
  const int m_bits = F.mant_bits, emin = 1 - F.bias;
  const uint32_t biased = mag >> 23;
  const int exp = biased ? int(biased) - 127 : -126;
  const uint32_t sig = biased ? (mag & 0x7fffffu) | 0x800000u : mag & 0x7fffffu;  // mag = sig * 2^(exp - 23)
  const int shift = 23 - m_bits + (exp < emin ? emin - exp : 0);  // to units of the target's last place
  if (shift > 25) return F.fnuz ? uint8_t(0) : sign;  // below half the smallest subnormal
  uint32_t q = sig >> shift;
  const uint32_t rest = sig & ((1u << shift) - 1u), half = 1u << (shift - 1);
  q += (rest > half || (rest == half && (q & 1u))) ? 1u : 0u;
  // normal: q in [2^m, 2^(m+1)], a carry into the exponent included; subnormal: q in [0, 2^m]
  const uint32_t bits = q + (uint32_t(exp > emin ? exp - emin : 0) << m_bits);
  if (bits == 0 && F.fnuz) return 0;  // no -0
  return uint8_t(sign | bits);
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
