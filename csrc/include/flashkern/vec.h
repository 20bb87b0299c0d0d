// Fixed-size vectors of a storage type, loaded and stored as 16-byte words where the width allows
// (ld.global.v4 / global_load_dwordx4), or element by element for a partial tail vector.
#pragma once

#include "flashkern/numeric.h"
#include "flashkern/platform.h"

namespace fk {

// The bits of one element, and back.
FK_DEVICE uint32_t element_bits(float x) { return bit_cast<uint32_t>(x); }
FK_DEVICE uint32_t element_bits(half_t x) { return x.bits; }
FK_DEVICE uint32_t element_bits(bf16_t x) { return x.bits; }
template <typename T>
FK_DEVICE T element_from_bits(uint32_t b) {
  if constexpr (sizeof(T) == 4) {
    return bit_cast<T>(b);
  } else {
    return T{uint16_t(b)};
  }
}

// N elements of T packed in 32-bit words (two 16-bit elements a word), as they sit in registers:
// a 16-byte vector of bf16 is 4 registers, not 8.
template <typename T, int N>
struct Vec {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "16- or 32-bit element types");
  static constexpr int kPerWord = 4 / int(sizeof(T));
  static constexpr int kWords = (N + kPerWord - 1) / kPerWord;
  static constexpr bool kWide = (sizeof(T) * N) % 16 == 0;
  uint32_t w[kWords];

  FK_DEVICE T get(int i) const { return element_from_bits<T>(w[i / kPerWord] >> (16 * (i % kPerWord))); }
  FK_DEVICE void put(int i, T x) {
    if constexpr (kPerWord == 1) {
      w[i] = element_bits(x);
    } else {
      const int shift = 16 * (i % kPerWord);
      w[i / kPerWord] = (w[i / kPerWord] & ~(0xffffu << shift)) | (element_bits(x) << shift);
    }
  }
  FK_DEVICE float f(int i) const { return to_float(get(i)); }
  FK_DEVICE void set(int i, float x) { put(i, from_float<T>(x)); }

  FK_DEVICE void zero() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = 0u;
  }
  // Load the `n` valid elements at p (n == N takes the 16-byte path); the rest are zero.
  FK_DEVICE void load(const T* p, int n = N) {
    if (kWide && n == N) {
#pragma unroll
      for (int c = 0; c < kWords / 4; ++c) {
        const uint4 q = reinterpret_cast<const uint4*>(p)[c];
        w[4 * c] = q.x, w[4 * c + 1] = q.y, w[4 * c + 2] = q.z, w[4 * c + 3] = q.w;
      }
    } else {
      zero();
#pragma unroll
      for (int i = 0; i < N; ++i)
        if (i < n) put(i, p[i]);
    }
  }
  // Store the first `n` elements at p: one 16-byte store per 16 bytes on the wide path.
  FK_DEVICE void store(T* p, int n = N) const {
    if (kWide && n == N) {
#pragma unroll
      for (int c = 0; c < kWords / 4; ++c)
        store16(reinterpret_cast<uint4*>(p) + c, make_uint4(w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3]));
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i)
        if (i < n) p[i] = get(i);
    }
  }
};

// Elements per 16-byte vector of T.
template <typename T>
inline constexpr int kVec16 = 16 / int(sizeof(T));

}  // namespace fk
