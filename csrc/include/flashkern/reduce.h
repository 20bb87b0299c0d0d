// Sums across the threads that share a row (see rows.h): butterfly shuffles inside a warp, one
// shared-memory exchange when a row spans several warps. The warp width is a template parameter
// (32 on NVIDIA and RDNA, 64 on CDNA), never the runtime warpSize.
#pragma once

#include "flashkern/platform.h"

namespace fk {

template <int kWarp>
struct RowGroup {
  static constexpr int kMaxWarps = 1024 / kWarp;
  int threads;  // threads per row, a power of two
  int lane;     // this thread's index within its row group

  // Sum of `v` over the row group; every thread of the block must call it (it may synchronize).
  // `scratch` holds kMaxWarps floats of shared memory per value summed.
  template <int kN>
  FK_DEVICE void sum(float (&v)[kN], float* scratch) const {
    sum_impl<kN, true>(v, scratch);
  }

  // The same with one barrier: calls alternate between the two halves of a scratch twice as large
  // (`call` counts them), so a half is written again only after the barrier of the call between,
  // which every thread reaches after reading it.
  template <int kN>
  FK_DEVICE void sum_alternating(float (&v)[kN], float* scratch, int64_t call) const {
    sum_impl<kN, false>(v, scratch + (call & 1) * kN * kMaxWarps);
  }

 private:
  template <int kN, bool kGuardScratch>
  FK_DEVICE void sum_impl(float (&v)[kN], float* scratch) const {
#pragma unroll
    for (int offset = kWarp / 2; offset >= 1; offset >>= 1) {
      if (offset < threads) {
#pragma unroll
        for (int i = 0; i < kN; ++i) v[i] += shfl_xor(v[i], offset);
      }
      // each lane now holds the sum over its aligned run of 2 * offset lanes (capped at the group)
    }
    if (threads > kWarp) {  // uniform across the block: rows this long get whole warps
      const int warp = threadIdx.x / kWarp;
      const int warps_per_row = threads / kWarp;
      const int first = warp - warp % warps_per_row;
      if (kGuardScratch) __syncthreads();  // scratch may still be read by a previous call
      if (threadIdx.x % kWarp == 0) {
#pragma unroll
        for (int i = 0; i < kN; ++i) scratch[i * kMaxWarps + warp] = v[i];
      }
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        float total = 0.f;
        for (int w = 0; w < warps_per_row; ++w) total += scratch[i * kMaxWarps + first + w];
        v[i] = total;  // every thread of the row now holds the row's sum
      }
    }
  }
};

}  // namespace fk
