// Batch attention over a paged KV cache, as planned (attention_work.h): the decode kernel, the
// multi-query kernel in its two tile shapes, then the merge of every query with more than one
// state. Every launch has a grid fixed by the caller and reads its items from the plan, so the
// same launches serve any plan (and CUDA graph replays after a new plan).
#pragma once

#include <atomic>
#include <type_traits>

#include "flashkern/dispatch.h"
#include "flashkern/kernels/decode_attention.cuh"
#include "flashkern/kernels/multi_query_attention.cuh"

namespace fk {

inline constexpr int kMergeBlock = 256;

// Per (query, q head) with n != 1 states: s = log(sum_i exp(s_i)), v = sum_i exp(s_i - s) v_i over
// its slots (natural log, fp32); no state: (0, -inf); a NaN state: NaN. Then the head's sink and
// out_scale (final_state). head_dim / 8 threads a row.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kMergeBlock) merge_partials_kernel(BatchAttentionParams p) {
  pdl_wait();  // before any global memory access (platform.h: PDL)
  pdl_launch_dependents();  // at the start: at the end it costs ptxas a spill here, and the next kernel still waits
  constexpr int kLanes = kHeadDim / kVec16Bit, kRowsPerBlock = kMergeBlock / kLanes;
  const int* indptr = p.plan + plan_header(p).merge_indptr;
  const int* slots = p.plan + plan_header(p).merge_indices;
  const int64_t rows = int64_t(p.batch) * p.qo_heads;
  const int lane = threadIdx.x % kLanes;
  for (int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes; row < rows;
       row += int64_t(gridDim.x) * kRowsPerBlock) {
    const int t = int(row / p.qo_heads), h = int(row % p.qo_heads);
    const int begin = indptr[t], n = indptr[t + 1] - begin;
    if (n == 1) continue;  // written by the attention kernel
    float m = -INFINITY;
    bool nan = false;  // fmaxf skips a NaN state: carry it explicitly
    for (int i = 0; i < n; ++i) {
      const float s = p.partial_s[int64_t(slots[begin + i]) * p.qo_heads + h];
      m = fmaxf(m, s);
      nan |= s != s;
    }
    float total = 0.f, acc[kVec16Bit] = {};
    for (int i = 0; i < n; ++i) {
      const int64_t srow = int64_t(slots[begin + i]) * p.qo_heads + h;
      const float s = p.partial_s[srow];
      const float w = m == -INFINITY ? 0.f : expf(s - m);
      total += w;
      const float4* v = reinterpret_cast<const float4*>(p.partial_v + srow * kHeadDim + lane * kVec16Bit);
      const float4 a = v[0], b = v[1];
      const float x[kVec16Bit] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int e = 0; e < kVec16Bit; ++e) acc[e] += w * x[e];
    }
    const float sink = p.sinks != nullptr ? p.sinks[h] : -INFINITY;
    const FinalState fin = final_state(nan ? NAN : total == 0.f ? -INFINITY : m + logf(total), sink, p.out_scale);
    const float inv = total == 0.f ? 0.f : fin.scale / total;
#pragma unroll
    for (int e = 0; e < kVec16Bit; ++e) acc[e] = nan ? NAN : acc[e] * inv;
    store_output(p.out, p.out_dtype, row * kHeadDim + lane * kVec16Bit, acc);
    if (lane == 0) p.lse[row] = fin.lse;
  }
}

template <typename F>
decltype(auto) with_decode_group(int group, F&& f) {
  switch (group) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 3:
      return f(std::integral_constant<int, 3>{});
    default:
      return f(std::integral_constant<int, 4>{});
  }
}

// Launches kKernel with `bytes` of dynamic shared memory. Above 48 KB a CUDA kernel needs its own
// opt-in (cudaFuncAttributeMaxDynamicSharedMemorySize), given here once per kernel and device
// (devices 0-63) rather than on every launch: the flag is a static of this instantiation, and each
// kernel is its own instantiation, whose launches all ask the same bytes (the fp8 cache's kernels are
// instantiations of their own, with their staging).
template <auto kKernel>
const char* launch_tiles(int blocks, int kv_heads, int threads, int bytes, const BatchAttentionParams& p,
                         gpuStream_t stream) {
  static std::atomic<uint64_t> raised{0};  // a bit per device
  const int device = gpuCurrentDevice();
  const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
  if (bytes > 48 * 1024 && (bit == 0 || !(raised.load(std::memory_order_relaxed) & bit))) {
    const gpuError_t e = gpuSetMaxDynamicShared(kKernel, bytes);
    if (e != gpuSuccess) {
      (void)gpuGetLastError();  // the runtime keeps it as the last error too: not the next op's
      return gpuGetErrorString(e);
    }
    raised.fetch_or(bit, std::memory_order_relaxed);
  }
  FK_LAUNCH_PDL(kKernel, dim3(unsigned(blocks), unsigned(kv_heads)), dim3(unsigned(threads)), bytes, stream, p.pdl)(p);
  return last_launch_error();
}

template <int kWarp, typename T, int D, bool kFp8>
const char* run_attention_kernels(const BatchAttentionParams& p, gpuStream_t stream) {
  const char* error = nullptr;
  if constexpr (D > kMaxWideHeadDim) {  // the planner gives wider heads 16-row tiles only (attention_work.h)
    if (p.grid[0] > 0 || p.grid[2] > 0) return "batch_attention: head dims above 256 run 16-row tiles only";
  } else if (p.grid[0] > 0) {
    error = with_decode_group(p.qo_heads / p.kv_heads, [&](auto g) {
      constexpr int G = decltype(g)::value;
      using S = DecodeShape<D>;
      return launch_tiles<decode_attention_kernel<T, D, G, kFp8>>(p.grid[0], p.kv_heads, S::kThreads,
                                                                  S::shared_bytes(G, kFp8), p, stream);
    });
    if (error) return error;
  }
  if (p.grid[1] > 0) {
    using S = TileShape<D, 16, kWarp, kFp8>;
    error = launch_tiles<multi_query_attention_kernel<T, D, 16, kWarp, kFp8>>(p.grid[1], p.kv_heads, S::kThreads,
                                                                             S::kBlockBytes, p, stream);
    if (error) return error;
  }
  if constexpr (D <= kMaxWideHeadDim) {
    if (p.grid[2] > 0) {
      using S = TileShape<D, 64, kWarp, kFp8>;
      error = launch_tiles<multi_query_attention_kernel<T, D, 64, kWarp, kFp8>>(p.grid[2], p.kv_heads, S::kThreads,
                                                                               S::kBlockBytes, p, stream);
    }
  }
  return error;
}

template <int kWarp>
const char* run_batch_attention(const BatchAttentionParams& p, gpuStream_t stream) {
  return with_dtype16(p.dtype, [&](auto t) {
    using T = decltype(t);
    return with_attention_head_dim(p.head_dim, [&](auto d) -> const char* {
      constexpr int D = decltype(d)::value;
      const char* error = p.kv_format >= 0 ? run_attention_kernels<kWarp, T, D, true>(p, stream)
                                           : run_attention_kernels<kWarp, T, D, false>(p, stream);
      if (error) return error;
      if (p.grid[3] > 0 && p.batch > 0) {
        constexpr int kRowsPerBlock = kMergeBlock / (D / kVec16Bit);
        const int64_t blocks = ceil_div(int64_t(p.batch) * p.qo_heads, kRowsPerBlock);
        constexpr auto merge = merge_partials_kernel<T, D>;
        FK_LAUNCH_PDL(merge, dim3(unsigned(blocks < kMaxBlocks ? blocks : kMaxBlocks)), dim3(kMergeBlock), 0, stream,
                      p.pdl)(p);
        error = last_launch_error();
      }
      return error;
    });
  });
}

}  // namespace fk
