// Appending to a paged KV cache (ops.h: AppendPagedKvParams; flashkern.page.append_paged_kv_cache).
//
// A thread per 8-element vector of one (token, KV head) row: it reads the vector of K and of V (two
// independent 16-byte loads of the 16-bit input) and writes them to the token's slot, 16 bytes each
// for a 16-bit cache, 8 bytes each for an fp8 one (converted in fp32 by numeric.h's
// float_to_fp8_bits: divided by the head's scale, saturated, round to nearest even). Consecutive
// threads take consecutive vectors of a row, then the next head, then the next token: a row's
// threads read and write contiguous bytes, and a warp reads one token's batch index, position and
// page entry (one line each, shared by the warp's threads). Nothing is reduced or shared between
// threads; the cost is the bytes moved, 2 x (16 + 16 or 8) per vector, plus the page lookups (L1/L2).
#pragma once

#include "flashkern/dispatch.h"
#include "flashkern/divmod.h"
#include "flashkern/ops.h"
#include "flashkern/vec.h"

namespace fk {

inline constexpr int kAppendThreads = 256;
inline constexpr int kAppendVec = 8;  // elements a thread moves per tensor: 16 bytes of input
inline constexpr int kCopyFormat = -1;  // the format template argument of a 16-bit cache (no conversion)

// Where token `t` goes: its page (or -1: not written) and slot. Host-device: the CPU reference's checks
// raise for exactly the tokens this skips.
struct AppendTarget {
  int64_t page;
  int32_t slot;
};
FK_HOST_DEVICE AppendTarget append_target(const int32_t* batch_indices, const int32_t* positions,
                                          const int32_t* kv_indptr, const int32_t* kv_indices, int64_t num_indices,
                                          int batch, int page_size, int64_t num_pages, int64_t t) {
  const int32_t b = batch_indices[t], pos = positions[t];
  if (b < 0 || b >= batch || pos < 0) return {-1, 0};
  const int32_t first = kv_indptr[b], count = kv_indptr[b + 1] - first;
  const int32_t n = pos / page_size;  // 32-bit division: positions are int32
  if (n >= count) return {-1, 0};     // past the request's pages
  const int64_t entry = int64_t(first) + n;
  if (entry < 0 || entry >= num_indices) return {-1, 0};
  const int64_t page = kv_indices[entry];
  if (page < 0 || page >= num_pages) return {-1, 0};
  return {page, pos - n * page_size};
}

// 8 elements of x into the cache at dst: the bits (16-bit cache) or fp8 codes of x / scale.
template <int kFormat, typename T>
FK_DEVICE void append_vector(void* dst, const Vec<T, kAppendVec>& x, float scale) {
  if constexpr (kFormat == kCopyFormat) {
    x.store(static_cast<T*>(dst));
  } else {
    constexpr auto format = numeric::Fp8(kFormat);
    uint32_t w[2] = {0u, 0u};
#pragma unroll
    for (int e = 0; e < kAppendVec; ++e)
      w[e / 4] |= uint32_t(numeric::float_to_fp8_bits(x.f(e) / scale, format)) << (8 * (e % 4));
    uint2 u;
    u.x = w[0], u.y = w[1];
    *static_cast<uint2*>(dst) = u;  // one 8-byte store
  }
}

template <typename T, int kFormat>
__global__ void __launch_bounds__(kAppendThreads) append_paged_kv_kernel(AppendPagedKvParams p, Divmod vecs,
                                                                         Divmod heads) {
  pdl_wait();  // before any global memory access (platform.h: PDL)
  using C = std::conditional_t<kFormat == kCopyFormat, T, uint8_t>;  // the cache's element
  const uint32_t item = blockIdx.x * uint32_t(kAppendThreads) + threadIdx.x;  // < 2^30 + 256 (the glue checks)
  uint32_t row, c, t, head;
  vecs.divmod(item, row, c);
  heads.divmod(row, t, head);
  if (t >= p.nnz) return;
  const AppendTarget at = append_target(p.batch_indices, p.positions, p.kv_indptr, p.kv_indices, p.num_indices,
                                        p.batch, p.page_size, p.num_pages, t);
  if (at.page < 0) return;
  Vec<T, kAppendVec> k, v;
  k.load(static_cast<const T*>(p.append_key) + t * p.key_strides[0] + head * p.key_strides[1] + c * kAppendVec);
  v.load(static_cast<const T*>(p.append_value) + t * p.value_strides[0] + head * p.value_strides[1] +
         c * kAppendVec);
  float k_scale = 1.f, v_scale = 1.f;
  if constexpr (kFormat != kCopyFormat) {
    k_scale = p.k_scale != nullptr ? p.k_scale[head] : p.k_scale_value;
    v_scale = p.v_scale != nullptr ? p.v_scale[head] : p.v_scale_value;
  }
  C* const k_dst = static_cast<C*>(p.k_cache) + at.page * p.k_strides[0] + at.slot * p.k_strides[1] +
                   head * p.k_strides[2] + c * kAppendVec;
  C* const v_dst = static_cast<C*>(p.v_cache) + at.page * p.v_strides[0] + at.slot * p.v_strides[1] +
                   head * p.v_strides[2] + c * kAppendVec;
  append_vector<kFormat>(k_dst, k, k_scale);
  append_vector<kFormat>(v_dst, v, v_scale);
}

// The cache's format as a compile-time constant: kCopyFormat (16-bit, the input's dtype) or an Fp8.
template <typename F>
decltype(auto) with_cache_format(const AppendPagedKvParams& p, F&& f) {
  if (!p.quantize) return f(std::integral_constant<int, kCopyFormat>{});
  switch (p.fp8) {
    case numeric::Fp8::e4m3fn:
      return f(std::integral_constant<int, int(numeric::Fp8::e4m3fn)>{});
    case numeric::Fp8::e5m2:
      return f(std::integral_constant<int, int(numeric::Fp8::e5m2)>{});
    case numeric::Fp8::e4m3fnuz:
      return f(std::integral_constant<int, int(numeric::Fp8::e4m3fnuz)>{});
    default:
      return f(std::integral_constant<int, int(numeric::Fp8::e5m2fnuz)>{});
  }
}

inline const char* run_append_paged_kv(const AppendPagedKvParams& p, gpuStream_t stream) {
  const int64_t row_vecs = p.head_dim / kAppendVec, items = p.nnz * p.kv_heads * row_vecs;
  if (items == 0) return nullptr;
  const unsigned blocks = unsigned(ceil_div(items, int64_t(kAppendThreads)));  // items < 2^31: < 2^23 blocks
  return with_dtype16(p.dtype, [&](auto t) {
    using T = decltype(t);
    return with_cache_format(p, [&](auto format) {
      constexpr auto kernel = append_paged_kv_kernel<T, decltype(format)::value>;
      FK_LAUNCH(kernel, dim3(blocks), dim3(kAppendThreads), stream)(p, Divmod(uint32_t(row_vecs)),
                                                                     Divmod(uint32_t(p.kv_heads)));
      return last_launch_error();
    });
  });
}

}  // namespace fk
