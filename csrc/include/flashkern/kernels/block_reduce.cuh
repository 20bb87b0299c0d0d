// Block-wide reductions and prefix sums for the one-block-per-row kernels (sampling, speculative
// decoding): butterfly shuffles inside a warp, one shared-memory exchange across warps, and a fixed
// order of additions, so results are the same run to run. 32- and 64-bit values go through the
// float shuffles of platform.h as bits. The warp width is a template parameter; every thread of
// the block must call each function (they synchronize).
#pragma once

#include "flashkern/numeric.h"
#include "flashkern/platform.h"

namespace fk {

template <typename T>
FK_DEVICE T shfl_bits(T v, int src_lane) {
  if constexpr (sizeof(T) == 4) {
    return bit_cast<T>(shfl(bit_cast<float>(v), src_lane));
  } else {
    static_assert(sizeof(T) == 8, "32- or 64-bit values");
    const uint64_t u = bit_cast<uint64_t>(v);
    const uint32_t lo = bit_cast<uint32_t>(shfl(bit_cast<float>(uint32_t(u)), src_lane));
    const uint32_t hi = bit_cast<uint32_t>(shfl(bit_cast<float>(uint32_t(u >> 32)), src_lane));
    return bit_cast<T>(uint64_t(hi) << 32 | lo);
  }
}

template <typename T>
FK_DEVICE T shfl_xor_bits(T v, int lane_mask) {
  if constexpr (sizeof(T) == 4) {
    return bit_cast<T>(shfl_xor(bit_cast<float>(v), lane_mask));
  } else {
    static_assert(sizeof(T) == 8, "32- or 64-bit values");
    const uint64_t u = bit_cast<uint64_t>(v);
    const uint32_t lo = bit_cast<uint32_t>(shfl_xor(bit_cast<float>(uint32_t(u)), lane_mask));
    const uint32_t hi = bit_cast<uint32_t>(shfl_xor(bit_cast<float>(uint32_t(u >> 32)), lane_mask));
    return bit_cast<T>(uint64_t(hi) << 32 | lo);
  }
}

struct SumOp {
  template <typename T>
  FK_DEVICE T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {
  template <typename T>
  FK_DEVICE T operator()(T a, T b) const { return a > b ? a : b; }
};
struct MinOp {
  template <typename T>
  FK_DEVICE T operator()(T a, T b) const { return a < b ? a : b; }
};

// op over the kN values of every thread of the block; every thread gets the results. scratch:
// kN * (kThreads / kWarp) values of shared memory.
template <int kThreads, int kWarp, int kN, typename T, typename Op>
FK_DEVICE void block_reduce(T (&v)[kN], T* scratch, Op op) {
  constexpr int kWarps = kThreads / kWarp;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int offset = kWarp / 2; offset >= 1; offset >>= 1) {
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] = op(v[i], shfl_xor_bits(v[i], offset));
  }
  __syncthreads();  // a previous call's readers are done with scratch
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < kN; ++i) scratch[i * kWarps + warp] = v[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    T r = scratch[i * kWarps];
    // 8 at a time: all kWarps - 1 loads at once cost the sampling kernel a spill on sm_120 (64-register cap)
#pragma unroll 8
    for (int w = 1; w < kWarps; ++w) r = op(r, scratch[i * kWarps + w]);
    v[i] = r;
  }
}

template <int kThreads, int kWarp, typename T, typename Op>
FK_DEVICE T block_reduce(T v, T* scratch, Op op) {
  T a[1] = {v};
  block_reduce<kThreads, kWarp>(a, scratch, op);
  return a[0];
}

template <int kWarp, typename T>
FK_DEVICE T warp_inclusive_sum(T v, int lane) {
#pragma unroll
  for (int offset = 1; offset < kWarp; offset <<= 1) {
    const T other = shfl_bits(v, lane >= offset ? lane - offset : lane);
    if (lane >= offset) v += other;
  }
  return v;
}

template <typename T>
struct PrefixSum {
  T inclusive, exclusive, total;
};

// Prefix sums of one value per thread in thread order. The exclusive sum of thread t + 1 is the
// inclusive sum of thread t bit for bit (the same additions), so the intervals [exclusive,
// inclusive) tile [0, total) with neither gaps nor overlaps, and `total` is the last thread's
// inclusive sum. scratch: kThreads / kWarp values of shared memory.
template <int kThreads, int kWarp, typename T>
FK_DEVICE PrefixSum<T> block_prefix_sum(T v, T* scratch) {
  constexpr int kWarps = kThreads / kWarp;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const T in_warp = warp_inclusive_sum<kWarp>(v, lane);
  const T lane_below = shfl_bits(in_warp, lane > 0 ? lane - 1 : 0);
  __syncthreads();  // a previous call's readers are done with scratch
  if (lane == kWarp - 1) scratch[warp] = in_warp;
  __syncthreads();
  T before = T(0), total = T(0);
  for (int w = 0; w < kWarps; ++w) {
    if (w == warp) before = total;
    total += scratch[w];
  }
  return {before + in_warp, lane > 0 ? before + lane_below : before, total};
}

}  // namespace fk
