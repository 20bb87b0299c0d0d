// Fixed-size vectors of a storage type, loaded and stored as 16-byte words where the width allows
// (ld.global.v4 / global_load_dwordx4), or element by element for a partial tail vector.
#pragma once

#include "flashkern/numeric.h"
#include "flashkern/platform.h"

namespace fk {

template <typename T, int N>
struct alignas((sizeof(T) * N) % 16 == 0 ? 16 : alignof(T)) Vec {
  T v[N];

  static constexpr bool kWide = (sizeof(T) * N) % 16 == 0;

  // Load the `n` valid elements at p (n == N takes the wide path); the rest are zero.
  FK_DEVICE void load(const T* p, int n = N) {
    if (kWide && n == N) {
#pragma unroll
      for (int i = 0; i < int(sizeof(T) * N / 16); ++i)
        reinterpret_cast<uint4*>(v)[i] = reinterpret_cast<const uint4*>(p)[i];
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] = i < n ? p[i] : from_float<T>(0.f);
    }
  }
  FK_DEVICE void store(T* p, int n = N) const {
    if (kWide && n == N) {
#pragma unroll
      for (int i = 0; i < int(sizeof(T) * N / 16); ++i)
        reinterpret_cast<uint4*>(p)[i] = reinterpret_cast<const uint4*>(v)[i];
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i)
        if (i < n) p[i] = v[i];
    }
  }
  FK_DEVICE float f(int i) const { return to_float(v[i]); }
  FK_DEVICE void set(int i, float x) { v[i] = from_float<T>(x); }
};

// Elements per 16-byte vector of T.
template <typename T>
inline constexpr int kVec16 = 16 / int(sizeof(T));

}  // namespace fk
