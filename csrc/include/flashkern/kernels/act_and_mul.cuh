// Gated activations (SwiGLU, GeGLU) and their backward.
//   forward:  out = act(gate) * up,             gate = x[:, :d], up = x[:, d:] (or two tensors)
//   backward: dgate = dy * up * act'(gate),     dup = dy * act(gate)
// Threads: a block of kActThreads holds rows_per_block groups of threads_per_row threads (short
// rows share a block); a group walks its row's 16-byte vectors, blockIdx.y splitting long rows;
// blocks stride over the rows. fp32 math, no reduction, so no warp width. Bytes per output
// element: forward 3 * sizeof(T), backward 5 * sizeof(T).
#pragma once

#include "flashkern/activations.h"
#include "flashkern/dispatch.h"
#include "flashkern/ops.h"
#include "flashkern/vec.h"

namespace fk {

inline constexpr int kActThreads = 256;
inline constexpr int64_t kMaxGridY = 65535;

struct ActPlan {
  int threads_per_row, rows_per_block;
  dim3 grid;
};

inline ActPlan plan_act_and_mul(int64_t rows, int64_t cols, int vec) {
  const int64_t row_vecs = ceil_div(cols, vec);
  const int64_t tpr = next_pow2(row_vecs) < kActThreads ? next_pow2(row_vecs) : kActThreads;
  const int64_t rpb = kActThreads / tpr;
  const int64_t row_blocks = ceil_div(rows, rpb), col_blocks = ceil_div(row_vecs, tpr);
  return {int(tpr), int(rpb),
          dim3(unsigned(row_blocks < kMaxBlocks ? row_blocks : kMaxBlocks),
               unsigned(col_blocks < kMaxGridY ? col_blocks : kMaxGridY))};
}

// Calls body(row, v, n) for every (row, vector) of this thread: n of the vector's kVec elements exist.
template <int kVec, typename Body>
FK_DEVICE void for_each_vector(int64_t rows, int64_t cols, const ActPlan& plan, Body&& body) {
  const int tpr = plan.threads_per_row;
  const int64_t row_vecs = ceil_div(cols, kVec);
  for (int64_t row = int64_t(blockIdx.x) * plan.rows_per_block + threadIdx.x / tpr; row < rows;
       row += int64_t(gridDim.x) * plan.rows_per_block) {
    for (int64_t v = int64_t(blockIdx.y) * tpr + (threadIdx.x & (tpr - 1)); v < row_vecs;
         v += int64_t(gridDim.y) * tpr) {
      const int64_t rest = cols - v * kVec;
      body(row, v, rest < kVec ? int(rest) : kVec);
    }
  }
}

template <typename T, Activation A, int kVec>
__global__ void __launch_bounds__(kActThreads) act_and_mul_kernel(ActAndMulParams p, ActPlan plan) {
  pdl_wait();  // before any global memory access (platform.h: PDL)
  for_each_vector<kVec>(p.rows, p.cols, plan, [&](int64_t row, int64_t v, int n) {
    Vec<T, kVec> g, u, o;
    g.load(static_cast<const T*>(p.gate) + p.gate_rows.offset(row) + v * kVec, n);
    u.load(static_cast<const T*>(p.up) + p.up_rows.offset(row) + v * kVec, n);
#pragma unroll
    for (int i = 0; i < kVec; ++i) o.set(i, Act<A>::f(g.f(i)) * u.f(i));
    o.store(static_cast<T*>(p.out) + p.out_rows.offset(row) + v * kVec, n);
  });
  pdl_launch_dependents();  // this block has read and written what it will
}

template <typename T, Activation A, int kVec>
__global__ void __launch_bounds__(kActThreads) act_and_mul_backward_kernel(ActAndMulBackwardParams p, ActPlan plan) {
  pdl_wait();  // before any global memory access (platform.h: PDL)
  for_each_vector<kVec>(p.rows, p.cols, plan, [&](int64_t row, int64_t v, int n) {
    Vec<T, kVec> g, u, d, dg, du;
    g.load(static_cast<const T*>(p.gate) + p.gate_rows.offset(row) + v * kVec, n);
    u.load(static_cast<const T*>(p.up) + p.up_rows.offset(row) + v * kVec, n);
    d.load(static_cast<const T*>(p.grad_out) + p.grad_out_rows.offset(row) + v * kVec, n);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      dg.set(i, d.f(i) * u.f(i) * Act<A>::df(g.f(i)));
      du.set(i, d.f(i) * Act<A>::f(g.f(i)));
    }
    dg.store(static_cast<T*>(p.grad_gate) + p.grad_gate_rows.offset(row) + v * kVec, n);
    du.store(static_cast<T*>(p.grad_up) + p.grad_up_rows.offset(row) + v * kVec, n);
  });
}

// ---- launchers, shared by the CUDA and HIP translation units ----

// 16-byte vectors need every row start of every tensor on a 16-byte boundary.
template <typename T>
bool act_and_mul_wide(std::initializer_list<const void*> ptrs, std::initializer_list<RowLayout> rows) {
  constexpr int kVec = kVec16<T>;
  for (const void* ptr : ptrs)
    if (!aligned16(ptr)) return false;
  for (const RowLayout& r : rows)
    if (!r.strides_multiple_of(kVec)) return false;
  return true;
}

inline const char* run_act_and_mul(const ActAndMulParams& p, gpuStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return nullptr;
  return with_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    const bool wide = act_and_mul_wide<T>({p.out, p.gate, p.up}, {p.out_rows, p.gate_rows, p.up_rows});
    return with_activation(p.act, [&](auto act_c) {
      return with_bool(wide, [&](auto wide_c) {
        constexpr int kV = decltype(wide_c)::value ? kVec16<T> : 1;
        const ActPlan plan = plan_act_and_mul(p.rows, p.cols, kV);
        constexpr auto kernel = act_and_mul_kernel<T, decltype(act_c)::value, kV>;
        FK_LAUNCH_PDL(kernel, plan.grid, dim3(kActThreads), 0, stream, p.pdl)(p, plan);
        return last_launch_error();
      });
    });
  });
}

inline const char* run_act_and_mul_backward(const ActAndMulBackwardParams& p, gpuStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return nullptr;
  return with_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    const bool wide = act_and_mul_wide<T>({p.grad_gate, p.grad_up, p.grad_out, p.gate, p.up},
                                          {p.grad_gate_rows, p.grad_up_rows, p.grad_out_rows, p.gate_rows, p.up_rows});
    return with_activation(p.act, [&](auto act_c) {
      return with_bool(wide, [&](auto wide_c) {
        constexpr int kV = decltype(wide_c)::value ? kVec16<T> : 1;
        const ActPlan plan = plan_act_and_mul(p.rows, p.cols, kV);
        const auto kernel = act_and_mul_backward_kernel<T, decltype(act_c)::value, kV>;
        FK_LAUNCH(kernel, plan.grid, dim3(kActThreads), stream)(p, plan);
        return last_launch_error();
      });
    });
  });
}

}  // namespace fk
