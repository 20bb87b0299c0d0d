// A training step's bookkeeping over every parameter at once: the gradients' global (or per-tensor)
// norm with the clip coefficients, and AdamW. Multi-tensor launches: the tensors' addresses sit in a
// device table (ops.h: OptimTensor), each tensor is cut into chunks of kOptimChunk elements and one
// grid covers the chunks of all tensors; a block finds its tensor by a binary search of the table
// (every thread reads the same entries: broadcasts). 16-byte vectors where every pointer of the
// tensor is aligned; fp32 math.
//
// Norm: grad_norm_chunks_kernel writes one fp32 partial per chunk (sum of |g|^p, or max |g|, NaN
// kept), grad_norm_finish_kernel (one block) adds each tensor's partials in fp64 in chunk order,
// then the tensors' sums across the block in a fixed order: the same result every run. It writes
// the norms, the clip coefficients and found_inf (the total is not finite).
// AdamW: adamw_kernel reads grad, param (or its fp32 master copy), exp_avg and exp_avg_sq once and
// writes them once; adamw_steps_kernel then advances each tensor's step. Both return at once when
// found_inf is set, so a non-finite gradient norm leaves everything as it was.
#pragma once

#include <cmath>

#include "flashkern/dispatch.h"
#include "flashkern/kernels/block_reduce.cuh"
#include "flashkern/ops.h"
#include "flashkern/vec.h"

namespace fk {

inline constexpr int kOptimThreads = 512;

// The tensor holding chunk c: the last entry whose chunk_begin <= c (tensors without elements own no chunk).
FK_HOST_DEVICE int64_t optim_tensor_of(const OptimTensor* table, int64_t tensors, int64_t chunk) {
  int64_t lo = 0, hi = tensors - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (table[mid].chunk_begin <= chunk)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

FK_HOST_DEVICE bool is_finite(double x) { return x - x == 0.0; }

// max that keeps a NaN: the inf-norm of a NaN gradient is NaN, as in torch
struct NanMaxOp {
  template <typename T>
  FK_DEVICE T operator()(T a, T b) const { return (b > a || b != b) ? b : a; }
};

template <NormKind K>
struct Norm {
  using Op = std::conditional_t<K == NormKind::linf, NanMaxOp, SumOp>;
  FK_DEVICE static float add(float acc, float x, float p) {
    if constexpr (K == NormKind::l2) {
      return fmaf(x, x, acc);
    } else if constexpr (K == NormKind::l1) {
      return acc + fabsf(x);
    } else if constexpr (K == NormKind::lp) {
      return acc + powf(fabsf(x), p);
    } else {
      return NanMaxOp{}(acc, fabsf(x));
    }
  }
  // the norm of an accumulated value
  FK_DEVICE static double finish(double acc, double p) {
    if constexpr (K == NormKind::l2) {
      return sqrt(acc);
    } else if constexpr (K == NormKind::lp) {
      return pow(acc, 1.0 / p);
    } else {
      return acc;
    }
  }
};

// min(1, max_norm / (norm + 1e-6)) in fp32, as torch computes it; a NaN norm gives NaN
FK_DEVICE float clip_coefficient(float max_norm, float norm) {
  const float c = max_norm / (norm + 1e-6f);
  return c > 1.0f ? 1.0f : c;
}

template <typename T, NormKind K, bool kWide>
FK_DEVICE float chunk_norm(const T* g, int64_t n, float p) {
  constexpr int kV = kWide ? kVec16<T> : 1;
  FK_ASSUME_GLOBAL(g);  // read from the table, not a kernel parameter: ld.global, not a generic ld
  float acc = 0.0f;
  for (int64_t i = int64_t(threadIdx.x) * kV; i < n; i += int64_t(kOptimThreads) * kV) {
    const int m = n - i < kV ? int(n - i) : kV;
    Vec<T, kV> v;
    v.load(g + i, m);
#pragma unroll
    for (int j = 0; j < kV; ++j)
      if (j < m) acc = Norm<K>::add(acc, v.f(j), p);
  }
  return acc;
}

template <NormKind K>
FK_DEVICE float tensor_chunk_norm(const OptimTensor& e, int64_t start, int64_t n, float p) {
  switch (DType(e.dtype)) {
    case DType::f16:
      return e.wide ? chunk_norm<half_t, K, true>(static_cast<const half_t*>(e.grad) + start, n, p)
                    : chunk_norm<half_t, K, false>(static_cast<const half_t*>(e.grad) + start, n, p);
    case DType::bf16:
      return e.wide ? chunk_norm<bf16_t, K, true>(static_cast<const bf16_t*>(e.grad) + start, n, p)
                    : chunk_norm<bf16_t, K, false>(static_cast<const bf16_t*>(e.grad) + start, n, p);
    default:
      return e.wide ? chunk_norm<float, K, true>(static_cast<const float*>(e.grad) + start, n, p)
                    : chunk_norm<float, K, false>(static_cast<const float*>(e.grad) + start, n, p);
  }
}

template <int kWarp, NormKind K>
__global__ void __launch_bounds__(kOptimThreads) grad_norm_chunks_kernel(const GradNormParams p) {
  pdl_wait();  // before any global memory access (platform.h: PDL)
  FK_STATIC_SHARED(float, scratch, [kOptimThreads / kWarp]);
  for (int64_t c = blockIdx.x; c < p.chunks; c += gridDim.x) {  // uniform across the block
    const OptimTensor e = p.table[optim_tensor_of(p.table, p.tensors, c)];
    const int64_t start = (c - e.chunk_begin) * kOptimChunk;
    const int64_t n = e.numel - start < kOptimChunk ? e.numel - start : kOptimChunk;
    const float acc =
        block_reduce<kOptimThreads, kWarp>(tensor_chunk_norm<K>(e, start, n, p.norm_type), scratch, typename Norm<K>::Op{});
    if (threadIdx.x == 0) p.partials[c] = acc;
  }
}

template <int kWarp, NormKind K>
__global__ void __launch_bounds__(kOptimThreads) grad_norm_finish_kernel(const GradNormParams p) {
  pdl_wait();  // before any global memory access (platform.h: PDL)
  FK_STATIC_SHARED(double, scratch, [kOptimThreads / kWarp]);
  const typename Norm<K>::Op op;
  double total = 0.0;
  for (int64_t t = threadIdx.x; t < p.tensors; t += kOptimThreads) {
    const int64_t begin = p.table[t].chunk_begin, end = begin + optim_chunks(p.table[t].numel);
    double acc = 0.0;
    for (int64_t c = begin; c < end; ++c) acc = op(acc, double(p.partials[c]));
    const float norm = float(Norm<K>::finish(acc, p.norm_type));
    p.tensor_norms[t] = norm;
    if (p.clip_coef != nullptr && p.per_tensor) p.clip_coef[t] = clip_coefficient(p.max_norm, norm);
    total = op(total, acc);
  }
  total = block_reduce<kOptimThreads, kWarp>(total, scratch, op);
  if (threadIdx.x == 0) {
    const float norm = float(Norm<K>::finish(total, p.norm_type));  // the float: an l1 sum may overflow only here
    *p.total_norm = norm;
    *p.found_inf = is_finite(norm) ? 0.0f : 1.0f;
    if (p.clip_coef != nullptr && !p.per_tensor) p.clip_coef[0] = clip_coefficient(p.max_norm, norm);
  }
}

// The per-step scalars of one tensor: torch computes them in double on the host
struct AdamWStep {
  float decay;      // 1 - lr * weight_decay
  float step_size;  // lr / (1 - beta1^step)
  float bc2_sqrt;   // sqrt(1 - beta2^step)
};

FK_DEVICE AdamWStep adamw_step(const AdamWParams& p, double lr, float step) {
  const double bc1 = 1.0 - pow(p.beta1, double(step)), bc2 = 1.0 - pow(p.beta2, double(step));
  return {float(1.0 - lr * p.weight_decay), float(lr / bc1), float(sqrt(bc2))};
}

// torch's lerp: m + w (g - m) for w < 0.5, else g - (g - m)(1 - w)
FK_DEVICE float torch_lerp(float m, float g, float w) { return w < 0.5f ? m + w * (g - m) : g - (g - m) * (1.0f - w); }

template <typename T, bool kWide, bool kMaster>
FK_DEVICE void adamw_chunk(const AdamWParams& p, const OptimTensor& e, int64_t start, int64_t n, float coef,
                           const AdamWStep& s) {
  constexpr int kV = kWide ? kVec16<T> : 1;
  T* param = static_cast<T*>(e.param) + start;
  const T* grad = static_cast<const T*>(e.grad) + start;
  float* exp_avg = e.exp_avg + start;
  float* exp_avg_sq = e.exp_avg_sq + start;
  float* master = kMaster ? e.master + start : nullptr;
  FK_ASSUME_GLOBAL(param);  // pointers from the table: ld.global / st.global, not generic accesses
  FK_ASSUME_GLOBAL(grad);
  FK_ASSUME_GLOBAL(exp_avg);
  FK_ASSUME_GLOBAL(exp_avg_sq);
  if constexpr (kMaster) FK_ASSUME_GLOBAL(master);
  for (int64_t i = int64_t(threadIdx.x) * kV; i < n; i += int64_t(kOptimThreads) * kV) {
    const int m = n - i < kV ? int(n - i) : kV;
    Vec<T, kV> g, w{};
    Vec<float, kV> ma, va, wa{};
    g.load(grad + i, m);
    ma.load(exp_avg + i, m);
    va.load(exp_avg_sq + i, m);
    if constexpr (kMaster)
      wa.load(master + i, m);
    else
      w.load(param + i, m);
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      float gj = g.f(j) * coef;
      if (p.maximize) gj = -gj;
      // torch's single-tensor AdamW, step by step (its foreach and fused versions round differently, and
      // a GPU build may contract a product and a sum into one FMA): lerp_, mul_ + addcmul_, mul_, addcdiv_
      const float mj = torch_lerp(ma.f(j), gj, p.one_minus_beta1);
      const float vj = va.f(j) * p.beta2_f + p.one_minus_beta2 * gj * gj;
      const float denom = sqrtf(vj) / s.bc2_sqrt + p.eps;
      const float wj = (kMaster ? wa.f(j) : w.f(j)) * s.decay + -s.step_size * mj / denom;
      ma.set(j, mj);
      va.set(j, vj);
      wa.set(j, wj);
      w.set(j, wj);  // rounded to nearest even
    }
    ma.store(exp_avg + i, m);
    va.store(exp_avg_sq + i, m);
    if constexpr (kMaster) wa.store(master + i, m);
    w.store(param + i, m);
  }
}

template <typename T>
FK_DEVICE void adamw_16bit(const AdamWParams& p, const OptimTensor& e, int64_t start, int64_t n, float coef,
                           const AdamWStep& s) {
  if (e.master != nullptr)
    e.wide ? adamw_chunk<T, true, true>(p, e, start, n, coef, s) : adamw_chunk<T, false, true>(p, e, start, n, coef, s);
  else
    e.wide ? adamw_chunk<T, true, false>(p, e, start, n, coef, s) : adamw_chunk<T, false, false>(p, e, start, n, coef, s);
}

__global__ void __launch_bounds__(kOptimThreads) adamw_kernel(const AdamWParams p) {
  pdl_wait();  // before any global memory access (platform.h: PDL)
  if (p.found_inf != nullptr && *p.found_inf != 0.0f) return;  // the whole step is skipped
  const double lr = p.lr_ptr != nullptr ? double(*p.lr_ptr) : p.lr;
  for (int64_t c = blockIdx.x; c < p.chunks; c += gridDim.x) {
    const int64_t t = optim_tensor_of(p.table, p.tensors, c);
    const OptimTensor e = p.table[t];
    const int64_t start = (c - e.chunk_begin) * kOptimChunk;
    const int64_t n = e.numel - start < kOptimChunk ? e.numel - start : kOptimChunk;
    const float coef = p.clip_coef == nullptr ? 1.0f : p.clip_coef[p.per_tensor_clip ? t : 0];
    const AdamWStep s = adamw_step(p, lr, *e.step + 1.0f);  // adamw_steps_kernel stores the step after
    switch (DType(e.dtype)) {
      case DType::f16:
        adamw_16bit<half_t>(p, e, start, n, coef, s);
        break;
      case DType::bf16:
        adamw_16bit<bf16_t>(p, e, start, n, coef, s);
        break;
      default:  // an fp32 parameter has no master copy
        e.wide ? adamw_chunk<float, true, false>(p, e, start, n, coef, s)
               : adamw_chunk<float, false, false>(p, e, start, n, coef, s);
    }
  }
}

__global__ void __launch_bounds__(kOptimThreads) adamw_steps_kernel(const AdamWParams p) {
  pdl_wait();  // before any global memory access (platform.h: PDL)
  if (p.found_inf != nullptr && *p.found_inf != 0.0f) return;
  const int64_t t = int64_t(blockIdx.x) * kOptimThreads + threadIdx.x;
  if (t < p.tensors) *p.table[t].step += 1.0f;
}

// ---- launchers, shared by the CUDA and HIP translation units ----

inline dim3 optim_grid(int64_t chunks) { return dim3(unsigned(chunks < kMaxBlocks ? chunks : kMaxBlocks)); }

template <int kWarp>
const char* run_grad_norm(const GradNormParams& p, gpuStream_t stream) {
  return with_norm_kind(p.kind, [&](auto kind_c) -> const char* {
    constexpr NormKind K = decltype(kind_c)::value;
    if (p.chunks > 0) {
      const auto chunks_kernel = grad_norm_chunks_kernel<kWarp, K>;
      FK_LAUNCH(chunks_kernel, optim_grid(p.chunks), dim3(kOptimThreads), stream)(p);
      if (const char* error = last_launch_error()) return error;
    }
    const auto finish_kernel = grad_norm_finish_kernel<kWarp, K>;
    FK_LAUNCH(finish_kernel, dim3(1), dim3(kOptimThreads), stream)(p);
    return last_launch_error();
  });
}

inline const char* run_adamw(const AdamWParams& p, gpuStream_t stream) {
  if (p.tensors == 0) return nullptr;
  if (p.chunks > 0) {
    FK_LAUNCH(adamw_kernel, optim_grid(p.chunks), dim3(kOptimThreads), stream)(p);
    if (const char* error = last_launch_error()) return error;
  }
  FK_LAUNCH(adamw_steps_kernel, dim3(unsigned(ceil_div(p.tensors, kOptimThreads))), dim3(kOptimThreads), stream)(p);
  return last_launch_error();
}

}  // namespace fk
