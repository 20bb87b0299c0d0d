// Rotary position embedding (see RopeParams in ops.h for the math), q and k in one launch.
// Threads: a block per token (blocks stride over tokens); its threads walk the token's
// (head, vector) work items: a NeoX item is kVec pairs (a 16-byte vector from each half), a GPT-J
// item one 16-byte vector of kVec / 2 adjacent pairs, a pass-through item a copied vector.
// cos/sin in fp32: sincosf of float(position) * inv_freq, or read from the cache.
// Bytes per element: 2 * sizeof(T) (read and write), plus the position and the cos/sin table (cached).
#pragma once

#include "flashkern/dispatch.h"
#include "flashkern/ops.h"
#include "flashkern/vec.h"

namespace fk {

inline constexpr int kRopeThreads = 256;

// cos and sin of pair i at `position`; NaN for a position outside the cache (never read past it).
FK_DEVICE void rope_cos_sin(const RopeParams& p, int64_t position, int i, float& c, float& s) {
  if (p.inv_freq != nullptr) {
    sincosf(float(position) * p.inv_freq[i], &s, &c);
  } else if (position >= 0 && position < p.cache_rows) {
    const float* row = p.cos_sin_cache + position * p.rotary_dim;
    c = row[i];
    s = row[p.rotary_dim / 2 + i];
  } else {
    c = s = __int_as_float(0x7fc00000);
  }
  if (p.inverse) s = -s;
}

// Interleaved pairs are never split: a GPT-J item holds at least one whole pair.
template <int kVec>
inline constexpr int kPairVec = kVec < 2 ? 2 : kVec;

template <int kVec>
FK_DEVICE int rope_rotary_items(const RopeParams& p) {
  return p.interleave ? p.rotary_dim / kPairVec<kVec> : p.rotary_dim / 2 / kVec;
}

template <typename T, int kVec>
FK_DEVICE void rope_head(const RopeParams& p, const T* x, T* y, int64_t position, int item) {
  const int half = p.rotary_dim / 2;
  const int rot_items = rope_rotary_items<kVec>(p);
  if (item >= rot_items) {  // pass-through dimensions (out of place only)
    const int64_t c = p.rotary_dim + int64_t(item - rot_items) * kVec;
    Vec<T, kVec> v;
    v.load(x + c, kVec);
    v.store(y + c, kVec);
    return;
  }
  if (p.interleave) {
    constexpr int kP = kPairVec<kVec>;
    Vec<T, kP> v, out;
    v.load(x + item * kP, kP);
#pragma unroll
    for (int j = 0; j < kP; j += 2) {
      float c, s;
      rope_cos_sin(p, position, (item * kP + j) / 2, c, s);
      out.set(j, v.f(j) * c - v.f(j + 1) * s);
      out.set(j + 1, v.f(j + 1) * c + v.f(j) * s);
    }
    out.store(y + item * kP, kP);
  } else {
    Vec<T, kVec> a, b, out_a, out_b;
    a.load(x + item * kVec, kVec);
    b.load(x + half + item * kVec, kVec);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float c, s;
      rope_cos_sin(p, position, item * kVec + j, c, s);
      out_a.set(j, a.f(j) * c - b.f(j) * s);
      out_b.set(j, b.f(j) * c + a.f(j) * s);
    }
    out_a.store(y + item * kVec, kVec);
    out_b.store(y + half + item * kVec, kVec);
  }
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kRopeThreads) rope_kernel(RopeParams p) {
  pdl_wait();  // before any global memory access (platform.h: PDL)
  const int items = rope_rotary_items<kVec>(p) + (p.in_place ? 0 : (p.head_dim - p.rotary_dim) / kVec);
  const int token_items = (p.q_heads + p.k_heads) * items;
  for (int64_t t = blockIdx.x; t < p.tokens; t += gridDim.x) {
    const int64_t position = p.positions_int64 ? static_cast<const int64_t*>(p.positions)[t]
                                               : static_cast<const int32_t*>(p.positions)[t];
    for (int w = threadIdx.x; w < token_items; w += kRopeThreads) {
      const int head = w / items, item = w % items;
      const bool is_q = head < p.q_heads;
      const int h = is_q ? head : head - p.q_heads;
      const int64_t* in_strides = is_q ? p.q_strides : p.k_strides;
      const int64_t* out_strides = is_q ? p.q_out_strides : p.k_out_strides;
      const T* x = static_cast<const T*>(is_q ? p.q : p.k) + t * in_strides[0] + h * in_strides[1];
      T* y = static_cast<T*>(is_q ? p.q_out : p.k_out) + t * out_strides[0] + h * out_strides[1];
      rope_head<T, kVec>(p, x, y, position, item);
    }
  }
}

// 16-byte vectors need every head start, both halves (NeoX) and the pass-through part aligned
// (a stride of a dimension of size 1 is never used).
template <typename T>
bool rope_wide(const RopeParams& p) {
  constexpr int kVec = kVec16<T>;
  const int unit = p.interleave ? kVec : 2 * kVec;
  if (p.rotary_dim % unit != 0 || (p.head_dim - p.rotary_dim) % kVec != 0) return false;
  for (const void* ptr : {static_cast<const void*>(p.q_out), static_cast<const void*>(p.k_out), p.q, p.k})
    if (!aligned16(ptr)) return false;
  const int64_t* q_like[] = {p.q_out_strides, p.q_strides};
  const int64_t* k_like[] = {p.k_out_strides, p.k_strides};
  for (const int64_t* s : q_like)
    if ((p.tokens > 1 && s[0] % kVec != 0) || (p.q_heads > 1 && s[1] % kVec != 0)) return false;
  for (const int64_t* s : k_like)
    if ((p.tokens > 1 && s[0] % kVec != 0) || (p.k_heads > 1 && s[1] % kVec != 0)) return false;
  return true;
}

inline const char* run_rope(const RopeParams& p, gpuStream_t stream) {
  if (p.tokens == 0 || p.q_heads + p.k_heads == 0) return nullptr;
  return with_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    return with_bool(rope_wide<T>(p), [&](auto wide_c) {
      constexpr int kV = decltype(wide_c)::value ? kVec16<T> : 1;
      const int64_t blocks = p.tokens < kMaxBlocks ? p.tokens : kMaxBlocks;
      const auto kernel = rope_kernel<T, kV>;
      FK_LAUNCH(kernel, dim3(unsigned(blocks)), dim3(kRopeThreads), stream)(p);
      return last_launch_error();
    });
  });
}

}  // namespace fk
