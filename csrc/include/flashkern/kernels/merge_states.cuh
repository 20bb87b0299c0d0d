// Merge attention states: per (token, head), v = sum_i w_i v_i / sum_i w_i with w_i = exp(s_i - max s),
// s = max s + log(sum_i w_i) (attention_state.h); all-empty gives (0, -inf), a NaN gives NaN.
// Threads: a group of threads per (token, head) row, each walking 16-byte vectors of head_dim, as
// many rows per 256-thread block as fit; blocks stride over rows. fp32 math. Any number of states
// and heads, any head_dim (no 1024-thread limit). In place (merge_state_in_place) the output is
// state 0: every thread reads the s values before any thread of the block writes one.
// Bytes: read num_states * (head_dim * sizeof(T) + 4), write head_dim * sizeof(T) + 4 per row.
#pragma once

#include "flashkern/attention_state.h"
#include "flashkern/dispatch.h"
#include "flashkern/ops.h"
#include "flashkern/vec.h"

namespace fk {

inline constexpr int kMergeThreads = 256;

template <typename T, int kVec>
__global__ void __launch_bounds__(kMergeThreads) merge_states_kernel(MergeStatesParams p, int threads_per_row) {
  pdl_wait();  // before any global memory access (platform.h: PDL)
  const int tpr = threads_per_row, rows_per_block = kMergeThreads / tpr, lane = threadIdx.x % tpr;
  const int64_t rows = p.tokens * p.heads, row_vecs = ceil_div(p.head_dim, kVec);
  for (int64_t base = int64_t(blockIdx.x) * rows_per_block; base < rows; base += int64_t(gridDim.x) * rows_per_block) {
    const int64_t row = base + threadIdx.x / tpr;
    const int64_t t = row / p.heads, h = row % p.heads;
    const bool active = row < rows && (p.mask == nullptr || p.mask[t]);
    // the row's states: p.s / p.v state by state, then the other one (merge_state) if any
    const float* s_row = p.s + t * p.s_strides[0] + h * p.s_strides[2];
    const T* v_row = static_cast<const T*>(p.v) + t * p.v_strides[0] + h * p.v_strides[2];
    const bool other = p.v_other != nullptr;
    float m = -INFINITY, sum = 0.f;
    bool nan = false;
    if (active) {
      auto see = [&](float s) {
        nan |= s != s;
        m = s > m ? s : m;
      };
      for (int i = 0; i < p.num_states; ++i) see(s_row[i * p.s_strides[1]]);
      if (other) see(p.s_other[t * p.s_other_strides[0] + h * p.s_other_strides[1]]);
      for (int64_t v = lane; v < row_vecs; v += tpr) {
        const int elems = int(p.head_dim - v * kVec < kVec ? p.head_dim - v * kVec : kVec);
        float acc[kVec] = {};
        sum = 0.f;  // the same total for every vector: lane 0 keeps it for s
        auto add = [&](float s, const T* state_v) {
          const float w = expf(s - m);
          sum += w;
          Vec<T, kVec> x;
          x.load(state_v + v * kVec, elems);
#pragma unroll
          for (int j = 0; j < kVec; ++j) acc[j] += w * x.f(j);
        };
        if (m != -INFINITY && !nan) {
          for (int i = 0; i < p.num_states; ++i) add(s_row[i * p.s_strides[1]], v_row + i * p.v_strides[1]);
          if (other)
            add(p.s_other[t * p.s_other_strides[0] + h * p.s_other_strides[1]],
                static_cast<const T*>(p.v_other) + t * p.v_other_strides[0] + h * p.v_other_strides[1]);
        }
        Vec<T, kVec> out;
#pragma unroll
        for (int j = 0; j < kVec; ++j) out.set(j, nan ? NAN : (sum > 0.f ? acc[j] / sum : 0.f));
        out.store(static_cast<T*>(p.v_out) + t * p.v_out_strides[0] + h * p.v_out_strides[1] + v * kVec, elems);
      }
    }
    __syncthreads();  // every s of this block's rows has been read: state 0's s may be overwritten
    if (active && lane == 0)
      p.s_out[t * p.s_out_strides[0] + h * p.s_out_strides[1]] =
          nan ? NAN : (m == -INFINITY ? -INFINITY : m + logf(sum));
  }
}

inline const char* run_merge_states(const MergeStatesParams& p, gpuStream_t stream) {
  if (p.tokens == 0 || p.heads == 0) return nullptr;
  return with_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int kVec = kVec16<T>;
    bool wide = p.head_dim % kVec == 0 && aligned16(p.v_out) && aligned16(p.v) &&
                (p.v_other == nullptr || aligned16(p.v_other));
    for (const int64_t s : {p.v_strides[0], p.v_strides[1], p.v_strides[2], p.v_other_strides[0],
                            p.v_other_strides[1], p.v_out_strides[0], p.v_out_strides[1]})
      wide = wide && s % kVec == 0;
    return with_bool(wide, [&](auto wide_c) {
      constexpr int kV = decltype(wide_c)::value ? kVec : 1;
      const int64_t row_vecs = ceil_div(p.head_dim, kV);
      const int tpr = int(next_pow2(row_vecs) < kMergeThreads ? next_pow2(row_vecs) : kMergeThreads);
      const int64_t blocks = ceil_div(p.tokens * p.heads, kMergeThreads / tpr);
      const auto kernel = merge_states_kernel<T, kV>;
      FK_LAUNCH(kernel, dim3(unsigned(blocks < kMaxBlocks ? blocks : kMaxBlocks)), dim3(kMergeThreads), stream)(p, tpr);
      return last_launch_error();
    });
  });
}

}  // namespace fk
