// RMSNorm, fused residual-add + RMSNorm, and the RMSNorm backward.
//   forward:  y = x * r * (w + offset),  r = rsqrt(mean(x^2) + eps)         (offset 1: Gemma)
//   fused:    s = x + residual (fp32); residual = round(s); x = rmsnorm(s)  (in place; FlashInfer's)
//   backward: dx = r * (dy * w' - x * r^2 * mean(dy * w' * x)),  dw = sum over rows of dy * x * r
// Threads: a power-of-two group of threads per row (rows.h), each holding up to kMaxVecs 16-byte
// vectors of the row in registers, so x is read once; rows too long for that are streamed twice.
// fp32 math throughout. Bytes per element: forward 2 * sizeof(T) (fused: 4 * sizeof(T); streamed
// rows read x and residual twice), backward 3 * sizeof(T); the weight is read once per row from L1/L2.
#pragma once

#include <algorithm>

#include "flashkern/dispatch.h"
#include "flashkern/ops.h"
#include "flashkern/reduce.h"
#include "flashkern/vec.h"

namespace fk {

// How many of the kVec elements of vector v of a row exist (0 past the end).
template <int kVec>
FK_DEVICE int vec_elems(int64_t v, int64_t cols) {
  const int64_t rest = cols - v * kVec;
  return rest <= 0 ? 0 : (rest < kVec ? int(rest) : kVec);
}

// The 32-bit registers that a thread's loads of x, the residual (fused) and the weight take together; where
// that is over 64 the weight is loaded after the reduction instead, half at a time (rmsnorm_rows_in_registers).
template <typename T, typename W, int kVec, int kVecs, bool kResidual>
inline constexpr int kRmsnormLoadRegisters = kVecs * kVec * ((kResidual ? 2 : 1) * int(sizeof(T)) + int(sizeof(W))) / 4;
template <typename T, typename W, int kVec, int kVecs, bool kResidual>
inline constexpr bool kRmsnormWeightWithX = kRmsnormLoadRegisters<T, W, kVec, kVecs, kResidual> <= 64;

// A row held in registers: kVecs 16-byte vectors a thread (a compile-time count, so that every load of
// x, the residual and the weight is issued before the first is used), vector k of the row group's lane
// being lane + k * tpr. Full vectors take predicated 16-byte loads and stores; the row's partial last
// vector (cols % kVec elements) has its own element-wise path after them. One barrier a row at most.
template <int kWarp, typename T, typename W, int kVec, int kVecs, bool kResidual>
FK_DEVICE void rmsnorm_rows_in_registers(const RmsnormParams& p, const RowPlan& plan) {
  using S = std::conditional_t<kResidual, float, T>;  // what is normalized: fused, the unrounded fp32 sum
  FK_STATIC_SHARED(float, scratch, [2 * RowGroup<kWarp>::kMaxWarps]);
  const int tpr = plan.threads_per_row;
  const RowGroup<kWarp> group{tpr, int(threadIdx.x) & (tpr - 1)};
  const W* w = static_cast<const W*>(p.weight);
  // The weight is loaded with x where the loads fit in 64 registers; otherwise after the reduction, half
  // its vectors at a time.
  constexpr bool kWeightWithX = kRmsnormWeightWithX<T, W, kVec, kVecs, kResidual>;
  constexpr int kWeightBatch = kWeightWithX ? kVecs : kVecs / 2;
  static_assert(kWeightBatch > 0 && kVecs % kWeightBatch == 0);
  const int64_t full = p.cols / kVec;     // full vectors of a row
  const int tail = int(p.cols % kVec);  // elements of its partial last vector (vector `full`), if any

  int64_t call = 0;
  for (int64_t base = int64_t(blockIdx.x) * plan.rows_per_block; base < p.rows;
       base += int64_t(gridDim.x) * plan.rows_per_block, ++call) {
    const int64_t row = base + threadIdx.x / tpr;
    const bool active = row < p.rows;  // inactive groups still join the reduction
    const int64_t row_full = active ? full : 0;
    const bool row_tail = active && tail != 0;
    const T* x = static_cast<const T*>(p.input) + (active ? p.input_rows.offset(row) : 0);
    T* res = kResidual ? static_cast<T*>(p.residual) + (active ? p.residual_rows.offset(row) : 0) : nullptr;
    T* y = static_cast<T*>(p.out) + (active ? p.out_rows.offset(row) : 0);

    Vec<T, kVec> xt[kVecs], rt[kVecs];
    Vec<W, kVec> wv[kVecs];
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {  // every full vector's loads, none used yet
      const int64_t v = group.lane + int64_t(k) * tpr;
      xt[k].zero(), wv[k].zero();
      if (kResidual) rt[k].zero();
      if (v < row_full) {
        xt[k].load(x + v * kVec);
        if (kResidual) rt[k].load(res + v * kVec);
        if (kWeightWithX) wv[k].load(w + v * kVec);
      }
    }
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {  // the partial vector, element by element
      const int64_t v = group.lane + int64_t(k) * tpr;
      if (row_tail && v == full) {
        xt[k].load(x + v * kVec, tail);
        if (kResidual) rt[k].load(res + v * kVec, tail);
        if (kWeightWithX) wv[k].load(w + v * kVec, tail);
      }
    }

    Vec<S, kVec> xv[kVecs];
    float ss[1] = {0.f};
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      if constexpr (kResidual) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float sum = xt[k].f(i) + rt[k].f(i);
          xv[k].set(i, sum);
          rt[k].set(i, sum);
        }
        const int64_t v = group.lane + int64_t(k) * tpr;
        if (v < row_full) rt[k].store(res + v * kVec);
        if (row_tail && v == full) rt[k].store(res + v * kVec, tail);
      } else {
        xv[k] = xt[k];
      }
#pragma unroll
      for (int i = 0; i < kVec; ++i) ss[0] += xv[k].f(i) * xv[k].f(i);
    }
    group.sum_alternating(ss, scratch, call);
    const float r = rsqrtf(ss[0] / float(p.cols) + p.eps);
#pragma unroll
    for (int k0 = 0; k0 < kVecs; k0 += kWeightBatch) {
      if constexpr (!kWeightWithX) {
#pragma unroll
        for (int k = k0; k < k0 + kWeightBatch; ++k) {
          const int64_t v = group.lane + int64_t(k) * tpr;
          if (v < row_full) wv[k].load(w + v * kVec);
          if (row_tail && v == full) wv[k].load(w + v * kVec, tail);
        }
      }
#pragma unroll
      for (int k = k0; k < k0 + kWeightBatch; ++k) {
        const int64_t v = group.lane + int64_t(k) * tpr;
        Vec<T, kVec> yv;
#pragma unroll
        for (int i = 0; i < kVec; ++i) yv.set(i, xv[k].f(i) * r * (wv[k].f(i) + p.weight_offset));
        if (v < row_full) yv.store(y + v * kVec);
        if (row_tail && v == full) yv.store(y + v * kVec, tail);
      }
    }
  }
}

// A row too long for registers (or not 16-byte aligned): streamed, read twice (the second pass from L2
// mostly); the residual is stored on the second pass, which adds x and residual again.
template <int kWarp, typename T, typename W, int kVec, bool kResidual>
FK_DEVICE void rmsnorm_rows_streamed(const RmsnormParams& p, const RowPlan& plan) {
  using S = std::conditional_t<kResidual, float, T>;
  FK_STATIC_SHARED(float, scratch, [2 * RowGroup<kWarp>::kMaxWarps]);
  const int tpr = plan.threads_per_row;
  const RowGroup<kWarp> group{tpr, int(threadIdx.x) & (tpr - 1)};
  const W* w = static_cast<const W*>(p.weight);

  int64_t call = 0;
  for (int64_t base = int64_t(blockIdx.x) * plan.rows_per_block; base < p.rows;
       base += int64_t(gridDim.x) * plan.rows_per_block, ++call) {
    const int64_t row = base + threadIdx.x / tpr;
    const bool active = row < p.rows;  // inactive groups still join the reduction
    const int64_t cols = active ? p.cols : 0;
    const T* x = static_cast<const T*>(p.input) + (active ? p.input_rows.offset(row) : 0);
    T* res = kResidual ? static_cast<T*>(p.residual) + (active ? p.residual_rows.offset(row) : 0) : nullptr;
    T* y = static_cast<T*>(p.out) + (active ? p.out_rows.offset(row) : 0);

    // x, or the fp32 sum x + residual (stored rounded to T when `store`), for vector v; returns its
    // sum of squares.
    auto load_input = [&](Vec<S, kVec>& xv, int64_t v, bool store) {
      const int n = vec_elems<kVec>(v, cols);
      if constexpr (kResidual) {
        Vec<T, kVec> xt, rv;
        xt.load(x + v * kVec, n);
        rv.load(res + v * kVec, n);
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float s = xt.f(i) + rv.f(i);
          xv.set(i, s);
          rv.set(i, s);
        }
        if (store) rv.store(res + v * kVec, n);
      } else {
        xv.load(x + v * kVec, n);
      }
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < kVec; ++i) ss += xv.f(i) * xv.f(i);
      return ss;
    };

    float ss[1] = {0.f};
    const int64_t row_vecs = ceil_div(cols, kVec);
    for (int64_t v = group.lane; v < row_vecs; v += tpr) {
      Vec<S, kVec> xv;
      ss[0] += load_input(xv, v, false);
    }
    group.sum_alternating(ss, scratch, call);
    const float r = rsqrtf(ss[0] / float(p.cols) + p.eps);
    for (int64_t v = group.lane; v < row_vecs; v += tpr) {
      const int n = vec_elems<kVec>(v, cols);
      Vec<S, kVec> xv;
      load_input(xv, v, true);
      Vec<W, kVec> wv;
      wv.load(w + v * kVec, n);
      Vec<T, kVec> yv;
#pragma unroll
      for (int i = 0; i < kVec; ++i) yv.set(i, xv.f(i) * r * (wv.f(i) + p.weight_offset));
      yv.store(y + v * kVec, n);
    }
  }
}

// kVecs: the vectors a thread holds (rmsnorm_rows_in_registers), or 0: streamed. Where its loads take 32
// registers or fewer (the streamed kernel holds one vector at a time: 0 counted), two blocks of the widest
// an SM: 64 registers, 4 of the usual 256-thread blocks.
static_assert(kFusedRmsnormLimits.max_block_threads <= kRmsnormLimits.max_block_threads);
template <int kWarp, typename T, typename W, int kVec, int kVecs, bool kResidual>
__global__ void FK_LAUNCH_BOUNDS(kRmsnormLimits.max_block_threads,
                                 (kRmsnormLoadRegisters<T, W, kVec, kVecs, kResidual> <= 32 ? 2 : 1))
    rmsnorm_kernel(RmsnormParams p, RowPlan plan) {
  pdl_wait();  // before any global memory access (platform.h: PDL)
  if (FK_WARP_SIZE_MISMATCH(kWarp)) {
    trap();
  } else if constexpr (kVecs > 0) {
    rmsnorm_rows_in_registers<kWarp, T, W, kVec, kVecs, kResidual>(p, plan);
  } else {
    rmsnorm_rows_streamed<kWarp, T, W, kVec, kResidual>(p, plan);
  }
  pdl_launch_dependents();  // this block has read and written what it will
}

// Each block walks rows blockIdx * rpb + g, stepping over the grid; each thread keeps dw for its
// own columns in registers, and at the end the block's row groups add theirs in shared memory and
// write one partial row of the fp32 workspace; rmsnorm_dw_reduce_kernel sums the partial rows.
// Streamed rows (one group per block) keep their partial row in the workspace instead.
template <int kWarp, typename T, typename W, int kVec>
FK_DEVICE void rmsnorm_backward_rows(const RmsnormBackwardParams& p, const RowPlan& plan) {
  constexpr int kMaxVecs = kRmsnormBackwardLimits.max_vecs_per_thread;
  FK_STATIC_SHARED(float, scratch, [2 * RowGroup<kWarp>::kMaxWarps]);
  const int tpr = plan.threads_per_row;
  const RowGroup<kWarp> group{tpr, int(threadIdx.x) & (tpr - 1)};
  const int64_t row_vecs = ceil_div(p.cols, kVec);
  float* partial = p.workspace + int64_t(blockIdx.x) * row_vecs * kVec;  // padded rows: 16-byte aligned
  const W* w = static_cast<const W*>(p.weight);
  const float inv_cols = 1.f / float(p.cols);

  float dw[kMaxVecs][kVec];
#pragma unroll
  for (int k = 0; k < kMaxVecs; ++k)
#pragma unroll
    for (int i = 0; i < kVec; ++i) dw[k][i] = 0.f;
  if (!plan.in_registers)
    for (int64_t v = group.lane; v < row_vecs; v += tpr)
#pragma unroll
      for (int i = 0; i < kVec; ++i) partial[v * kVec + i] = 0.f;

  for (int64_t base = int64_t(blockIdx.x) * plan.rows_per_block; base < p.rows;
       base += int64_t(gridDim.x) * plan.rows_per_block) {
    const int64_t row = base + threadIdx.x / tpr;
    const bool active = row < p.rows;
    const int64_t cols = active ? p.cols : 0;
    const T* x = static_cast<const T*>(p.input) + (active ? p.input_rows.offset(row) : 0);
    const T* dy = static_cast<const T*>(p.grad_out) + (active ? p.grad_out_rows.offset(row) : 0);
    T* dx = static_cast<T*>(p.grad_input) + (active ? p.grad_input_rows.offset(row) : 0);

    // sums[0] = sum x^2, sums[1] = sum dy * w' * x
    auto accumulate = [&](const Vec<T, kVec>& xv, const Vec<T, kVec>& gv, const Vec<W, kVec>& wv, float (&sums)[2]) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        sums[0] += xv.f(i) * xv.f(i);
        sums[1] += gv.f(i) * (wv.f(i) + p.weight_offset) * xv.f(i);
      }
    };
    // dx for vector v, and dy * x * r of each of its columns added to dwv.
    auto grads = [&](const Vec<T, kVec>& xv, const Vec<T, kVec>& gv, const Vec<W, kVec>& wv, int64_t v, float r,
                     float c, float (&dwv)[kVec]) {
      Vec<T, kVec> dxv;
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        dxv.set(i, r * (gv.f(i) * (wv.f(i) + p.weight_offset) - xv.f(i) * c));
        dwv[i] += gv.f(i) * xv.f(i) * r;
      }
      dxv.store(dx + v * kVec, vec_elems<kVec>(v, cols));
    };
    // r is 0 for an inactive group: its x and dy are 0, and 0 * inf would poison dw (eps = 0).
    auto rstd = [&](float sum_sq) { return active ? rsqrtf(sum_sq * inv_cols + p.eps) : 0.f; };
    auto load = [&](int64_t v, Vec<T, kVec>& xv, Vec<T, kVec>& gv, Vec<W, kVec>& wv) {
      const int n = vec_elems<kVec>(v, cols);
      xv.load(x + v * kVec, n);
      gv.load(dy + v * kVec, n);
      wv.load(w + v * kVec, n);
    };

    float sums[2] = {0.f, 0.f};
    if (plan.in_registers) {
      Vec<T, kVec> xv[kMaxVecs], gv[kMaxVecs];
#pragma unroll
      for (int k = 0; k < kMaxVecs; ++k) {
        if (k < plan.vecs_per_thread) {
          Vec<W, kVec> wv;
          load(group.lane + int64_t(k) * tpr, xv[k], gv[k], wv);
          accumulate(xv[k], gv[k], wv, sums);
        }
      }
      group.sum(sums, scratch);
      const float r = rstd(sums[0]);
      const float c = r * r * sums[1] * inv_cols;
#pragma unroll
      for (int k = 0; k < kMaxVecs; ++k) {
        if (k < plan.vecs_per_thread) {
          const int64_t v = group.lane + int64_t(k) * tpr;
          Vec<W, kVec> wv;
          wv.load(w + v * kVec, vec_elems<kVec>(v, cols));
          grads(xv[k], gv[k], wv, v, r, c, dw[k]);
        }
      }
    } else {
      for (int64_t v = group.lane; v * kVec < cols; v += tpr) {
        Vec<T, kVec> xv, gv;
        Vec<W, kVec> wv;
        load(v, xv, gv, wv);
        accumulate(xv, gv, wv, sums);
      }
      group.sum(sums, scratch);
      const float r = rstd(sums[0]);
      const float c = r * r * sums[1] * inv_cols;
      for (int64_t v = group.lane; v * kVec < cols; v += tpr) {  // x, dy again: from L2 mostly
        Vec<T, kVec> xv, gv;
        Vec<W, kVec> wv;
        load(v, xv, gv, wv);
        float dwv[kVec];
#pragma unroll
        for (int i = 0; i < kVec; ++i) dwv[i] = partial[v * kVec + i];
        grads(xv, gv, wv, v, r, c, dwv);
#pragma unroll
        for (int i = 0; i < kVec; ++i) partial[v * kVec + i] = dwv[i];
      }
    }
  }

  if (plan.in_registers) {
    // Add the row groups' dw vector by vector: group g's lane l stages its kVec sums, then the
    // lanes of group 0 add them up over the groups and write the block's partial row.
    FK_STATIC_SHARED(float, stage, [kRmsnormBackwardLimits.max_block_threads * kVec]);
#pragma unroll
    for (int k = 0; k < kMaxVecs; ++k) {
      if (k < plan.vecs_per_thread) {  // uniform over the block
#pragma unroll
        for (int i = 0; i < kVec; ++i) stage[threadIdx.x * kVec + i] = dw[k][i];
        __syncthreads();
        const int64_t v = group.lane + int64_t(k) * tpr;
        if (threadIdx.x < unsigned(tpr) && v < row_vecs) {
          Vec<float, kVec> sum;
#pragma unroll
          for (int i = 0; i < kVec; ++i) sum.set(i, 0.f);
          for (int g = 0; g < plan.rows_per_block; ++g)
#pragma unroll
            for (int i = 0; i < kVec; ++i) sum.set(i, sum.f(i) + stage[(g * tpr + group.lane) * kVec + i]);
          sum.store(partial + v * kVec);
        }
        __syncthreads();
      }
    }
  }
}

template <int kWarp, typename T, typename W, int kVec>
__global__ void __launch_bounds__(kRmsnormBackwardLimits.max_block_threads)
    rmsnorm_backward_kernel(RmsnormBackwardParams p, RowPlan plan) {
  pdl_wait();  // before any global memory access (platform.h: PDL)
  if (FK_WARP_SIZE_MISMATCH(kWarp)) {
    trap();
  } else {
    rmsnorm_backward_rows<kWarp, T, W, kVec>(p, plan);
  }
}

// grad_weight[c] = sum over the partial rows of column c. A block takes 32 columns (coalesced
// 128-byte reads); its 32 thread rows each sum every 32nd partial row, then one row adds those.
inline constexpr int kReduceTile = 32;
template <typename W>
__global__ void __launch_bounds__(kReduceTile* kReduceTile)
    rmsnorm_dw_reduce_kernel(W* grad_weight, const float* partial, int64_t partial_rows, int64_t stride, int64_t cols) {
  pdl_wait();  // before any global memory access (platform.h: PDL)
  FK_STATIC_SHARED(float, sums, [kReduceTile][kReduceTile + 1]);
  const int64_t c = int64_t(blockIdx.x) * kReduceTile + threadIdx.x;
  float s = 0.f;
  if (c < cols)
    for (int64_t j = threadIdx.y; j < partial_rows; j += kReduceTile) s += partial[j * stride + c];
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = 0.f;
    for (int j = 0; j < kReduceTile; ++j) total += sums[j][threadIdx.x];
    grad_weight[c] = from_float<W>(total);
  }
}

// ---- launchers, shared by the CUDA and HIP translation units ----

// The vectors a thread holds, as a compile-time count: the plan's aim (rows of up to that many vectors a
// thread; fewer are predicated off), the most held in registers, or 0 (streamed).
template <bool kResidual, typename F>
decltype(auto) with_rmsnorm_vecs(const RowPlan& plan, F&& f) {
  constexpr RowPlanLimits kLimits = kResidual ? kFusedRmsnormLimits : kRmsnormLimits;
  constexpr int kShort = kLimits.target_vecs_per_thread, kMax = kLimits.max_vecs_per_thread;
  if (plan.in_registers && plan.vecs_per_thread <= kShort) return f(std::integral_constant<int, kShort>{});
  if (plan.in_registers) return f(std::integral_constant<int, kMax>{});
  return f(std::integral_constant<int, 0>{});
}

template <int kWarp>
const char* run_rmsnorm(const RmsnormParams& p, gpuStream_t stream) {
  if (p.rows == 0) return nullptr;
  return with_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    return with_weight_dtype<T>(p.weight_dtype, [&](auto wt) {
      using W = decltype(wt);
      constexpr int kVec = kVec16<T>;
      const bool residual = p.residual != nullptr;
      const bool wide = aligned16(p.out) && aligned16(p.input) && aligned16(p.weight) &&
                        p.out_rows.strides_multiple_of(kVec) && p.input_rows.strides_multiple_of(kVec) &&
                        (!residual || (aligned16(p.residual) && p.residual_rows.strides_multiple_of(kVec)));
      return with_bool(wide, [&](auto wide_c) {
        constexpr int kV = decltype(wide_c)::value ? kVec : 1;
        return with_bool(residual, [&](auto res_c) {
          constexpr bool kResidual = decltype(res_c)::value;
          const RowPlan plan = plan_rows(p.rows, p.cols, kV, kResidual ? kFusedRmsnormLimits : kRmsnormLimits);
          auto launch = [&](auto vecs_c) {
            constexpr auto kernel = rmsnorm_kernel<kWarp, T, W, kV, decltype(vecs_c)::value, kResidual>;
            // no more blocks than are resident at once: each walks rows over the grid (no block launches
            // and exits between rows)
            int64_t blocks = plan.blocks;
            const int64_t sms = gpuMultiprocessorCount(gpuCurrentDevice());
            if (blocks > sms) blocks = std::min<int64_t>(blocks, sms * gpuMaxActiveBlocksPerSM(kernel, plan.block_threads));
            FK_LAUNCH_PDL(kernel, dim3(unsigned(blocks)), dim3(plan.block_threads), 0, stream, p.pdl)(p, plan);
            return last_launch_error();
          };
          // rows that are not 16-byte aligned are streamed (rare: a 16-bit row starting off a 16-byte boundary)
          if constexpr (kV == 1) return launch(std::integral_constant<int, 0>{});
          else return with_rmsnorm_vecs<kResidual>(plan, launch);
        });
      });
    });
  });
}

template <typename T>
bool rmsnorm_backward_wide(const RmsnormBackwardParams& p) {
  constexpr int kVec = kVec16<T>;
  return aligned16(p.grad_input) && aligned16(p.grad_out) && aligned16(p.input) && aligned16(p.weight) &&
         p.grad_input_rows.strides_multiple_of(kVec) && p.grad_out_rows.strides_multiple_of(kVec) &&
         p.input_rows.strides_multiple_of(kVec);
}

// Calls f(kernel, plan, vec, W{}) with the backward kernel for p and its launch plan: as many
// blocks as are resident on the device at once (each walks many rows), since every block adds
// one partial row to the workspace. The workspace size and the launch both come from here.
template <int kWarp, typename F>
decltype(auto) with_rmsnorm_backward_kernel(const RmsnormBackwardParams& p, F&& f) {
  return with_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    return with_weight_dtype<T>(p.weight_dtype, [&](auto wt) {
      using W = decltype(wt);
      return with_bool(rmsnorm_backward_wide<T>(p), [&](auto wide_c) {
        constexpr int kV = decltype(wide_c)::value ? kVec16<T> : 1;
        const auto kernel = rmsnorm_backward_kernel<kWarp, T, W, kV>;
        RowPlan plan = plan_rows(p.rows, p.cols, kV, kRmsnormBackwardLimits);
        const int64_t resident = int64_t(gpuMultiprocessorCount(gpuCurrentDevice())) *
                                 gpuMaxActiveBlocksPerSM(kernel, plan.block_threads);
        if (plan.blocks > resident) plan.blocks = resident;
        return f(kernel, plan, kV, W{});
      });
    });
  });
}

template <int kWarp>
size_t rmsnorm_backward_workspace(const RmsnormBackwardParams& p) {
  if (p.rows == 0) return 0;
  return with_rmsnorm_backward_kernel<kWarp>(p, [&](auto, const RowPlan& plan, int vec, auto) {
    return size_t(plan.blocks) * size_t(ceil_div(p.cols, vec) * vec) * sizeof(float);
  });
}

template <int kWarp>
const char* run_rmsnorm_backward(const RmsnormBackwardParams& p, gpuStream_t stream) {
  if (p.rows == 0) return nullptr;
  return with_rmsnorm_backward_kernel<kWarp>(p, [&](auto kernel, const RowPlan& plan, int vec, auto wt) {
    using W = decltype(wt);
    FK_LAUNCH(kernel, dim3(unsigned(plan.blocks)), dim3(plan.block_threads), stream)(p, plan);
    if (const char* error = last_launch_error()) return error;
    const auto reduce = rmsnorm_dw_reduce_kernel<W>;
    FK_LAUNCH(reduce, dim3(unsigned(ceil_div(p.cols, kReduceTile))), dim3(kReduceTile, kReduceTile), stream)(
        static_cast<W*>(p.grad_weight), p.workspace, plan.blocks, ceil_div(p.cols, vec) * vec, p.cols);
    return last_launch_error();
  });
}

}  // namespace fk
