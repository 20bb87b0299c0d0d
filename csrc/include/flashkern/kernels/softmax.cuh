// FlashInfer's sampling.softmax: probs = softmax(logits / t) of each row, in fp32, a temperature t per
// row or one for all. The online softmax of the attention kernels (attention_state.h), in natural
// units: y = x / t is scaled before the maximum m is subtracted, never a logit times log2(e) / t
// (which overflows for |x / t| past FLT_MAX / log2(e) where torch's answer is finite).
//
// A row is cut into chunks of kSoftmaxChunk elements (ops.h), a block of kSoftmaxThreads a chunk. One
// pass over a chunk keeps, per thread, the running maximum m and l = sum exp(y - m) (16-byte loads,
// fp32), then the block merges them. A row of one chunk writes exp(y - m) / l at once (its second
// read mostly from L2); longer rows leave each chunk's (m, l) in a workspace and a second launch
// merges the row's pairs and writes, taking the chunks in reverse so that its first reads are of the
// chunks the first launch read last (still in L2). Chunks are fixed by the vocabulary, never by the
// batch, and every merge runs in a fixed order: a row's bits do not depend on the other rows. (They
// may depend on the row's address: where the 16-byte body starts follows it.)
// Bytes: the logits read twice (the second time partly from L2), fp32 probabilities written once.
//
// NaN anywhere in a row makes the row NaN, as do +inf and a row of -inf only (torch.softmax's answers).
#pragma once

#include "flashkern/attention_state.h"
#include "flashkern/dispatch.h"
#include "flashkern/kernels/block_reduce.cuh"
#include "flashkern/ops.h"
#include "flashkern/rows.h"
#include "flashkern/vec.h"

namespace fk {

inline constexpr int kSoftmaxThreads = 256;
inline constexpr int kSoftmaxLoads = 4;  // 16-byte loads a thread issues before it uses the first

// Elements before the first 16-byte boundary at or after p (all n when p is not even T-aligned).
template <typename T>
FK_DEVICE int64_t head_to_16(const T* p, int64_t n) {
  const uintptr_t off = reinterpret_cast<uintptr_t>(p) % 16;
  const int64_t head = off % sizeof(T) ? n : off == 0 ? 0 : int64_t((16 - off) / sizeof(T));
  return head < n ? head : n;
}

// exp(y - m), with m the running maximum: 0 while everything seen is -inf (not exp(-inf + inf)), NaN for a
// NaN y (so it reaches l though fmaxf skipped it in m).
FK_DEVICE float softmax_term(float y, float m) { return exp2f((y - (m == -INFINITY ? 0.f : m)) * kLog2e); }

struct SoftmaxState {
  float m = -INFINITY;  // the running maximum of the y seen (NaN skipped: it reaches l)
  float l = 0.f;        // sum of exp(y - m)

  template <int kN>
  FK_DEVICE void add(const float (&y)[kN], int n) {
    float top = -INFINITY;
#pragma unroll
    for (int e = 0; e < kN; ++e) top = e < n ? fmaxf(top, y[e]) : top;
    const float m_new = fmaxf(m, top);
    l *= m_new == -INFINITY ? 1.f : softmax_term(m, m_new);
    m = m_new;
#pragma unroll
    for (int e = 0; e < kN; ++e) l += e < n ? softmax_term(y[e], m) : 0.f;
  }
};

// The state of row elements [a, b) over the block: every thread gets it (the maximum, then the sum
// rescaled to it, each a block reduction in a fixed order). The split between the scalar head, the
// 16-byte body and the scalar tail follows the input's address only.
template <int kThreads, int kWarp, typename T>
FK_DEVICE SoftmaxState chunk_state(const T* __restrict__ row, int64_t a, int64_t b, float inv_t, float* scratch) {
  constexpr int kVec = 16 / int(sizeof(T));
  const int64_t head = head_to_16(row + a, b - a), groups = (b - a - head) / kVec;
  const int64_t body = a + head, tail = body + groups * kVec;
  SoftmaxState st;
  for (int64_t i = a + threadIdx.x; i < body; i += kThreads) {
    const float y[1] = {to_float(row[i]) * inv_t};
    st.add(y, 1);
  }
  for (int64_t g0 = threadIdx.x; g0 < groups; g0 += int64_t(kThreads) * kSoftmaxLoads) {
    Vec<T, kVec> v[kSoftmaxLoads] = {};  // zeros past the chunk's end: loaded nothing, added nothing
#pragma unroll
    for (int u = 0; u < kSoftmaxLoads; ++u) {
      const int64_t g = g0 + int64_t(u) * kThreads;
      if (g < groups) v[u].load(row + body + g * kVec);
    }
#pragma unroll
    for (int u = 0; u < kSoftmaxLoads; ++u) {
      float y[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) y[e] = v[u].f(e) * inv_t;
      st.add(y, g0 + int64_t(u) * kThreads < groups ? kVec : 0);
    }
  }
  for (int64_t i = tail + threadIdx.x; i < b; i += kThreads) {
    const float y[1] = {to_float(row[i]) * inv_t};
    st.add(y, 1);
  }
  const float m = block_reduce<kThreads, kWarp>(st.m, scratch, MaxOp{});
  const float l = block_reduce<kThreads, kWarp>(st.l * softmax_term(st.m, m), scratch, SumOp{});
  return {m, l};
}

// probs of row elements [a, b): exp(y - m) * inv_l, each element alone (the same bits on every path).
template <int kThreads, typename T>
FK_DEVICE void chunk_write(const T* __restrict__ row, float* __restrict__ out, int64_t a, int64_t b, float inv_t,
                           float m, float inv_l) {
  constexpr int kVec = 16 / int(sizeof(T));
  int64_t head = head_to_16(row + a, b - a);
  if (reinterpret_cast<uintptr_t>(out + a + head) % 16) head = b - a;  // input and output disagree: scalar
  const int64_t groups = (b - a - head) / kVec, body = a + head, tail = body + groups * kVec;
  for (int64_t i = a + threadIdx.x; i < body; i += kThreads) out[i] = softmax_term(to_float(row[i]) * inv_t, m) * inv_l;
  for (int64_t g0 = threadIdx.x; g0 < groups; g0 += int64_t(kThreads) * kSoftmaxLoads) {
    Vec<T, kVec> v[kSoftmaxLoads] = {};
#pragma unroll
    for (int u = 0; u < kSoftmaxLoads; ++u) {
      const int64_t g = g0 + int64_t(u) * kThreads;
      if (g < groups) v[u].load(row + body + g * kVec);
    }
#pragma unroll
    for (int u = 0; u < kSoftmaxLoads; ++u) {
      const int64_t g = g0 + int64_t(u) * kThreads;
      if (g >= groups) break;
      float p[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) p[e] = softmax_term(v[u].f(e) * inv_t, m) * inv_l;
#pragma unroll
      for (int q = 0; q < kVec / 4; ++q)
        store16(out + body + g * kVec + 4 * q, make_uint4(bit_cast<uint32_t>(p[4 * q]), bit_cast<uint32_t>(p[4 * q + 1]),
                                                           bit_cast<uint32_t>(p[4 * q + 2]), bit_cast<uint32_t>(p[4 * q + 3])));
    }
  }
  for (int64_t i = tail + threadIdx.x; i < b; i += kThreads) out[i] = softmax_term(to_float(row[i]) * inv_t, m) * inv_l;
}

FK_DEVICE float inverse_temperature(const SoftmaxParams& p, int64_t r) {
  return 1.f / (p.temperature_arr != nullptr ? p.temperature_arr[r] : p.temperature);
}

// kWrite: a row of one chunk, written at once; else the chunk's (m, l) into p.partial.
template <int kThreads, int kWarp, typename T, bool kWrite>
__global__ void __launch_bounds__(kThreads) softmax_chunk_kernel(SoftmaxParams p) {
  pdl_wait();  // before any global memory access (platform.h: PDL)
  if (FK_WARP_SIZE_MISMATCH(kWarp)) {
    trap();
    return;
  }
  FK_STATIC_SHARED(float, scratch, [kThreads / kWarp]);
  const int64_t chunks = softmax_chunks(p.vocab);
  const T* in = static_cast<const T*>(p.in);
  for (int64_t w = blockIdx.x; w < p.rows * chunks; w += gridDim.x) {
    const int64_t r = w / chunks, a = (w % chunks) * kSoftmaxChunk, b = a + kSoftmaxChunk < p.vocab ? a + kSoftmaxChunk : p.vocab;
    const float inv_t = inverse_temperature(p, r);
    const SoftmaxState st = chunk_state<kThreads, kWarp>(in + r * p.in_stride, a, b, inv_t, scratch);
    if constexpr (kWrite) {
      chunk_write<kThreads>(in + r * p.in_stride, p.out + r * p.vocab, a, b, inv_t, st.m, 1.f / st.l);
    } else if (threadIdx.x == 0) {
      p.partial[2 * w] = st.m;
      p.partial[2 * w + 1] = st.l;
    }
  }
  pdl_launch_dependents();
}

// Rows of several chunks: each block merges its row's (m, l) pairs in chunk order, then writes its chunk.
template <int kThreads, int kWarp, typename T>
__global__ void __launch_bounds__(kThreads) softmax_merge_write_kernel(SoftmaxParams p) {
  pdl_wait();  // the chunks' pairs are written (platform.h: PDL)
  if (FK_WARP_SIZE_MISMATCH(kWarp)) {
    trap();
    return;
  }
  FK_STATIC_SHARED(float, scratch, [kThreads / kWarp]);
  const int64_t chunks = softmax_chunks(p.vocab);
  const T* in = static_cast<const T*>(p.in);
  for (int64_t i = blockIdx.x; i < p.rows * chunks; i += gridDim.x) {
    const int64_t w = p.rows * chunks - 1 - i;  // the chunks the first launch read last first: still in L2
    const int64_t r = w / chunks, a = (w % chunks) * kSoftmaxChunk, b = a + kSoftmaxChunk < p.vocab ? a + kSoftmaxChunk : p.vocab;
    const float* pairs = p.partial + 2 * r * chunks;
    float m = -INFINITY;
    for (int64_t c = threadIdx.x; c < chunks; c += kThreads) m = fmaxf(m, pairs[2 * c]);
    m = block_reduce<kThreads, kWarp>(m, scratch, MaxOp{});
    float l = 0.f;
    for (int64_t c = threadIdx.x; c < chunks; c += kThreads) l += pairs[2 * c + 1] * softmax_term(pairs[2 * c], m);
    l = block_reduce<kThreads, kWarp>(l, scratch, SumOp{});
    chunk_write<kThreads>(in + r * p.in_stride, p.out + r * p.vocab, a, b, inverse_temperature(p, r), m, 1.f / l);
  }
  pdl_launch_dependents();
}

template <int kWarp>
const char* run_softmax(const SoftmaxParams& p, gpuStream_t stream) {
  if (p.rows == 0 || p.vocab == 0) return nullptr;
  const int64_t work = p.rows * softmax_chunks(p.vocab);
  const dim3 grid(unsigned(work < kMaxBlocks ? work : kMaxBlocks)), block(kSoftmaxThreads);
  return with_dtype(p.dtype, [&](auto t) -> const char* {
    using T = decltype(t);
    constexpr auto whole = softmax_chunk_kernel<kSoftmaxThreads, kWarp, T, true>;
    constexpr auto chunk = softmax_chunk_kernel<kSoftmaxThreads, kWarp, T, false>;
    constexpr auto merge = softmax_merge_write_kernel<kSoftmaxThreads, kWarp, T>;
    if (softmax_chunks(p.vocab) == 1) {
      FK_LAUNCH_PDL(whole, grid, block, 0, stream, p.pdl)(p);
      return last_launch_error();
    }
    FK_LAUNCH_PDL(chunk, grid, block, 0, stream, p.pdl)(p);
    if (const char* error = last_launch_error()) return error;
    FK_LAUNCH_PDL(merge, grid, block, 0, stream, p.pdl)(p);
    return last_launch_error();
  });
}

}  // namespace fk
