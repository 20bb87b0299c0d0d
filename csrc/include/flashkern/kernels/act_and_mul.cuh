// Gated activations (SwiGLU, GeGLU) and their backward.
//   forward:  out = act(gate) * up,             gate = x[:, :d], up = x[:, d:]
//   backward: dgate = dy * up * act'(gate),     dup = dy * act(gate)
// Threads: blockIdx.x is the row, (blockIdx.y, threadIdx.x) walk its 16-byte vectors; fp32 math.
// No reduction, so no warp width. Bytes per output element: forward 3 * sizeof(T), backward
// 5 * sizeof(T).
#pragma once

#include "flashkern/activations.h"
#include "flashkern/dispatch.h"
#include "flashkern/ops.h"
#include "flashkern/vec.h"

namespace fk {

inline constexpr int kActThreads = 256;
inline constexpr int kMaxGridY = 65535;

template <int kVec>
FK_DEVICE int act_vec_elems(int64_t v, int64_t cols) {
  const int64_t rest = cols - v * kVec;
  return rest < kVec ? int(rest) : kVec;
}

template <typename T, Activation A, int kVec>
__global__ void __launch_bounds__(kActThreads) act_and_mul_kernel(ActAndMulParams p) {
  const int64_t row = blockIdx.x;
  const T* gate = static_cast<const T*>(p.input) + p.input_rows.offset(row);
  const T* up = gate + p.cols;
  T* out = static_cast<T*>(p.out) + p.out_rows.offset(row);
  const int64_t row_vecs = ceil_div(p.cols, kVec);
  for (int64_t v = int64_t(blockIdx.y) * kActThreads + threadIdx.x; v < row_vecs;
       v += int64_t(gridDim.y) * kActThreads) {
    const int n = act_vec_elems<kVec>(v, p.cols);
    Vec<T, kVec> g, u, o;
    g.load(gate + v * kVec, n);
    u.load(up + v * kVec, n);
#pragma unroll
    for (int i = 0; i < kVec; ++i) o.set(i, Act<A>::f(g.f(i)) * u.f(i));
    o.store(out + v * kVec, n);
  }
}

template <typename T, Activation A, int kVec>
__global__ void __launch_bounds__(kActThreads) act_and_mul_backward_kernel(ActAndMulBackwardParams p) {
  const int64_t row = blockIdx.x;
  const T* gate = static_cast<const T*>(p.input) + p.input_rows.offset(row);
  const T* up = gate + p.cols;
  const T* dy = static_cast<const T*>(p.grad_out) + p.grad_out_rows.offset(row);
  T* dgate = static_cast<T*>(p.grad_input) + p.grad_input_rows.offset(row);
  T* dup = dgate + p.cols;
  const int64_t row_vecs = ceil_div(p.cols, kVec);
  for (int64_t v = int64_t(blockIdx.y) * kActThreads + threadIdx.x; v < row_vecs;
       v += int64_t(gridDim.y) * kActThreads) {
    const int n = act_vec_elems<kVec>(v, p.cols);
    Vec<T, kVec> g, u, d, dg, du;
    g.load(gate + v * kVec, n);
    u.load(up + v * kVec, n);
    d.load(dy + v * kVec, n);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      dg.set(i, d.f(i) * u.f(i) * Act<A>::df(g.f(i)));
      du.set(i, d.f(i) * Act<A>::f(g.f(i)));
    }
    dg.store(dgate + v * kVec, n);
    du.store(dup + v * kVec, n);
  }
}

// ---- launchers, shared by the CUDA and HIP translation units ----

inline dim3 act_and_mul_grid(int64_t rows, int64_t cols, int vec) {
  const int64_t chunks = ceil_div(ceil_div(cols, vec), kActThreads);
  return dim3(unsigned(rows), unsigned(chunks < kMaxGridY ? chunks : kMaxGridY));
}

// 16-byte vectors need every row start, and the start of its `up` half, on a 16-byte boundary.
template <typename T>
bool act_and_mul_wide(std::initializer_list<const void*> ptrs, std::initializer_list<RowLayout> rows, int64_t cols) {
  constexpr int kVec = kVec16<T>;
  if (cols % kVec != 0) return false;
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
    const bool wide = act_and_mul_wide<T>({p.out, p.input}, {p.out_rows, p.input_rows}, p.cols);
    return with_activation(p.act, [&](auto act_c) {
      return with_bool(wide, [&](auto wide_c) {
        constexpr int kV = decltype(wide_c)::value ? kVec16<T> : 1;
        act_and_mul_kernel<T, decltype(act_c)::value, kV>
            <<<act_and_mul_grid(p.rows, p.cols, kV), dim3(kActThreads), 0, stream>>>(p);
        return last_launch_error();
      });
    });
  });
}

inline const char* run_act_and_mul_backward(const ActAndMulBackwardParams& p, gpuStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return nullptr;
  return with_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    const bool wide = act_and_mul_wide<T>({p.grad_input, p.grad_out, p.input},
                                          {p.grad_input_rows, p.grad_out_rows, p.input_rows}, p.cols);
    return with_activation(p.act, [&](auto act_c) {
      return with_bool(wide, [&](auto wide_c) {
        constexpr int kV = decltype(wide_c)::value ? kVec16<T> : 1;
        act_and_mul_backward_kernel<T, decltype(act_c)::value, kV>
            <<<act_and_mul_grid(p.rows, p.cols, kV), dim3(kActThreads), 0, stream>>>(p);
        return last_launch_error();
      });
    });
  });
}

}  // namespace fk
