// Sorting-free sampling (top-k, top-p, min-p, joint top-k + top-p) and top-k / top-p renormalization.
//
// Sampling: one block of 1024 threads per output row, fp32 math, the row read in 16-byte vectors.
// Rejection rounds, after FlashInfer's sampling kernels: draw a token x from the tokens still
// possible, R (at first all), by inverse transform; one more pass counts the tokens before x and
// their mass (the order of ops.h: larger probability first, ties to the lower index); x is kept by
// the filter, or every token not before x is out, and R shrinks to the tokens before x. Because the
// kept set is the first few tokens of that order and R always contains it, a token drawn from R and
// kept is distributed as the renormalized kept probabilities. Each round also tests a second pivot,
// halfway between p(x) and an upper bound of the boundary: when the tokens above it already break the
// filter, R shrinks to them instead (a bisection in value, FlashInfer's dual pivot), so flat rows
// need few rounds. A typical row takes one or two rounds of two passes; the later passes mostly hit L2.
// min-p needs no count: x is kept when p(x) >= min_p * max(p), else R becomes exactly those tokens.
//
// Inverse transform without knowing R's mass: the target is u * bound for a bound of the mass
// (1 + 2^-12 for a row that sums to about 1, the counted mass afterwards, likewise inflated). A pass
// returns R's exact mass; when it exceeds the bound, or the target falls past it, the pass is thrown
// away and repeated with a fresh u and the exact mass as the bound. Either way token j is drawn with
// probability mass(j) / mass(R): exact rows pay one pass, rows that do not sum to 1 one more.
//
// Renormalization: an exact threshold by radix select on the order-preserving integer key of each
// value: three passes of 2048-bin (11, 11, 10 bits) shared-memory histograms of counts (top-k) or
// of masses in 2^-40 fixed point (top-p: integer sums, the same on every run), each pass narrowing
// to one bin, then one pass that writes the row; tokens tied at the threshold are taken in index
// order. The kept mass for the renormalization is summed in fp32 along the way.
#pragma once

#include "flashkern/dispatch.h"
#include "flashkern/kernels/block_reduce.cuh"
#include "flashkern/ops.h"
#include "flashkern/philox.h"
#include "flashkern/vec.h"

namespace fk {

// 1024 threads a row on NVIDIA (52-64 registers on sm_80-sm_120, no spills); 512 on AMD, where a
// 1024-thread block leaves a wave 128 VGPRs and the kernels spilled.
inline constexpr int kSamplingThreads = kHipBuild ? 512 : 1024;
// More rounds than a row can need (each one removes at least its token; the bisection halves a
// value interval): a guard against a hang on input no analysis foresaw. The row is then invalid.
inline constexpr int kMaxSamplingRounds = 4096;
// Inflation of a counted mass used as the bound of a pass's inverse transform (see above).
inline constexpr float kMassBound = 1.f + 0x1p-12f;

FK_HOST_DEVICE bool finite(float x) { return x - x == 0.f; }

// The tokens still possible: j with p_j > p, or p_j == p and j < index (the tokens before a pivot token).
struct Pivot {
  float p;
  int64_t index;
};
FK_HOST_DEVICE bool before(float pj, int64_t j, Pivot pivot) { return pj > pivot.p || (pj == pivot.p && j < pivot.index); }

struct SamplingShared {
  float f[2 * kSamplingThreads / 32];  // reduction scratch: 2 values a warp (at least 32 warps' room)
  uint32_t u[2 * kSamplingThreads / 32];
  float local_target;
  int64_t token;
};

// A row's tokens as vectors of kVec for 16-byte loads: when the row does not start on a 16-byte
// boundary, vector 0 holds the `head` tokens before the first one, and the others kVec tokens each from
// there (the last one partial). Vectors keep index order, so every order the kernels derive from them
// (thread order, ranks of tied tokens) is index order, and a row of any length or start takes 16-byte loads.
template <int kVec>
struct RowSpan {
  int64_t vocab;
  int64_t head;  // [0, kVec), at most vocab

  template <typename T>
  FK_DEVICE static RowSpan of(const T* row, int64_t vocab) {
    static_assert(kVec == 1 || kVec * sizeof(T) == 16, "a vector is 16 bytes");
    const uintptr_t off = reinterpret_cast<uintptr_t>(row) % 16;
    const int64_t head = off && kVec > 1 ? int64_t((16 - off) / sizeof(T)) : 0;
    return {vocab, head < vocab ? head : vocab};
  }
  FK_DEVICE int64_t vectors() const { return (head > 0 ? 1 : 0) + ceil_div(vocab - head, int64_t(kVec)); }
  FK_DEVICE int64_t first(int64_t v) const { return head == 0 ? v * kVec : v == 0 ? 0 : head + (v - 1) * kVec; }
  FK_DEVICE int size(int64_t v) const {  // tokens in vector v (0 past the row)
    const int64_t f = first(v), end = head > 0 && v == 0 ? head : f + kVec;
    return f >= vocab ? 0 : int((end < vocab ? end : vocab) - f);
  }
  template <typename T>
  FK_DEVICE int load(const T* row, int64_t v, float (&x)[kVec]) const {  // zeros past the vector's tokens
    Vec<T, kVec> vec;
    const int n = size(v);
    vec.load(row + first(v), n);
#pragma unroll
    for (int e = 0; e < kVec; ++e) x[e] = vec.f(e);
    return n;
  }
};

struct Drawn {
  int64_t token;  // -1: the target was not below the mass
  float mass;     // of the tokens drawn from
  float max;      // their largest mass
};

// A token j with probability mass(j) / sum(mass), by inverse transform at `target`, in thread order
// (thread 0's vectors, then thread 1's, ...: any fixed order of the tokens draws the same
// distribution, and this one needs only one block-wide prefix sum): each thread sums the masses of
// its vectors v = threadIdx.x + i * kThreads, the prefix sum finds the thread whose interval holds the
// target, and warp 0 walks that thread's vectors once more. masses(v, m) fills m[0..kVec) with the
// masses of vector v's tokens (zero past the row's end and outside the set drawn from); masses.span
// says which tokens vector v holds.
template <int kThreads, int kWarp, int kVec, typename Masses>
FK_DEVICE Drawn draw_by_mass(const Masses& masses, float target, SamplingShared& sh) {
  const int64_t vectors = masses.span.vectors();
  float sum = 0.f, largest = 0.f;
#pragma unroll 4
  for (int64_t v = threadIdx.x; v < vectors; v += kThreads) {
    float m[kVec];
    masses(v, m);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      sum += m[e];
      largest = m[e] > largest ? m[e] : largest;
    }
  }
  const PrefixSum<float> prefix = block_prefix_sum<kThreads, kWarp>(sum, sh.f);
  float reduced[1] = {largest};
  block_reduce<kThreads, kWarp>(reduced, sh.f + kThreads / kWarp, MaxOp{});
  uint32_t first[1] = {target < prefix.inclusive ? uint32_t(threadIdx.x) : uint32_t(kThreads)};
  block_reduce<kThreads, kWarp>(first, sh.u, MinOp{});
  Drawn drawn{-1, prefix.total, reduced[0]};
  if (first[0] == uint32_t(kThreads)) return drawn;  // uniform: the target is past the mass
  if (threadIdx.x == first[0]) {
    sh.local_target = target - prefix.exclusive;
    sh.token = -1;
  }
  __syncthreads();
  if (threadIdx.x < kWarp) {  // warp 0 walks thread `first`'s vectors, kWarp at a time
    const int lane = threadIdx.x;
    float rest = sh.local_target;
    int64_t last_positive = -1;  // the last vector with mass, should rounding leave the target past them all
    bool found = false;
    for (int64_t base = first[0]; base < vectors && !found; base += int64_t(kWarp) * kThreads) {
      const int64_t v = base + int64_t(lane) * kThreads;
      float m[kVec] = {};
      if (v < vectors) masses(v, m);
      float vsum = 0.f;
#pragma unroll
      for (int e = 0; e < kVec; ++e) vsum += m[e];
      const float inclusive = warp_inclusive_sum<kWarp>(vsum, lane);
      const float below = shfl_bits(inclusive, lane > 0 ? lane - 1 : 0);
      const float exclusive = lane > 0 ? below : 0.f;
      uint32_t hit[1] = {rest < inclusive && vsum > 0.f ? uint32_t(lane) : uint32_t(kWarp)};
      uint32_t with_mass[1] = {vsum > 0.f ? uint32_t(lane) + 1 : 0u};
#pragma unroll
      for (int offset = kWarp / 2; offset >= 1; offset >>= 1) {
        hit[0] = MinOp{}(hit[0], shfl_xor_bits(hit[0], offset));
        with_mass[0] = MaxOp{}(with_mass[0], shfl_xor_bits(with_mass[0], offset));
      }
      if (with_mass[0] > 0u) last_positive = base + int64_t(with_mass[0] - 1) * kThreads;
      if (hit[0] < uint32_t(kWarp)) {
        found = true;
        if (uint32_t(lane) == hit[0]) {
          float r = rest - exclusive;
          int pick = -1;
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            if (m[e] > 0.f && pick < 0) {
              if (r < m[e]) pick = e;
              r -= m[e];
            }
          }
          if (pick < 0) {  // rounding: the last token with mass in this vector
#pragma unroll
            for (int e = 0; e < kVec; ++e) pick = m[e] > 0.f ? e : pick;
          }
          sh.token = masses.span.first(v) + pick;
        }
      } else {
        rest -= shfl_bits(inclusive, kWarp - 1);
      }
    }
    if (!found && lane == 0 && last_positive >= 0) {
      float m[kVec];
      masses(last_positive, m);
      int pick = -1;
#pragma unroll
      for (int e = 0; e < kVec; ++e) pick = m[e] > 0.f ? e : pick;
      sh.token = masses.span.first(last_positive) + pick;
    }
  }
  __syncthreads();
  drawn.token = sh.token;
  __syncthreads();  // every thread has read sh.token before the next pass may write it
  return drawn;
}

// The row's probabilities as masses: max(p, 0) of the tokens in R (before `pivot`), 0 elsewhere; a NaN
// stays NaN, so a row holding one has a NaN mass and is invalid (as the reference: ref/sampling.py).
template <int kVec>
struct ProbMasses {
  const float* row;
  RowSpan<kVec> span;
  Pivot pivot;

  FK_DEVICE int load(int64_t v, float (&x)[kVec]) const { return span.load(row, v, x); }
  FK_DEVICE void operator()(int64_t v, float (&m)[kVec]) const {
    const int n = load(v, m);
    const int64_t first = span.first(v);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float x = m[e];
      m[e] = e < n && (x != x || (x > 0.f && before(x, first + e, pivot))) ? x : 0.f;
    }
  }
};

FK_DEVICE uint64_t random_word(const int64_t* arr, int64_t len, int64_t value, int64_t b) {
  return uint64_t(arr == nullptr ? value : arr[len == 1 ? 0 : b]);
}

// Row b's stream. With a seed per row (a [batch] tensor: a request's own seed) it is a function of that
// seed and the row's offset alone, not of b, so a request draws the same numbers at any row of any batch;
// with one seed for all rows, b is part of the counter so that rows differ.
// r by value: a reference to the kernel's parameter made HIP copy it to scratch memory.
FK_DEVICE RowRandom row_random(RandomSource r, int64_t b) {
  return RowRandom(random_word(r.seed_arr, r.seed_len, r.seed, b), random_word(r.offset_arr, r.offset_len, r.offset, b),
                   r.seed_arr != nullptr && r.seed_len > 1 ? 0u : uint32_t(b));
}

template <int kThreads, int kWarp, int kVec>
// A bare bound: with FK_LAUNCH_BOUNDS(kThreads, 1) ptxas spilled 32-48 bytes at the same 64-register cap.
__global__ void __launch_bounds__(kThreads) sampling_kernel(SamplingParams p) {
  pdl_wait();  // before any global memory access (platform.h: PDL)
  if (FK_WARP_SIZE_MISMATCH(kWarp)) {
    trap();
    return;
  }
  FK_STATIC_SHARED(SamplingShared, sh, [1]);
  for (int64_t b = blockIdx.x; b < p.batch; b += gridDim.x) {
    int64_t row = b;
    if (p.indices != nullptr)
      row = p.indices_int64 ? static_cast<const int64_t*>(p.indices)[b] : static_cast<const int32_t*>(p.indices)[b];
    const int64_t k = p.top_k_arr != nullptr ? p.top_k_arr[b] : p.top_k;
    const float top_p = p.top_p_arr != nullptr ? p.top_p_arr[b] : p.top_p;
    const float min_p = p.min_p_arr != nullptr ? p.min_p_arr[b] : p.min_p;
    const bool use_k = (p.filter == SampleFilter::top_k || p.filter == SampleFilter::top_k_top_p) && k > 0 &&
                       k < p.vocab;
    // a NaN top_p keeps the first token only, a NaN min_p filters nothing (as ref/sampling.py)
    const bool use_p = (p.filter == SampleFilter::top_p || p.filter == SampleFilter::top_k_top_p) && !(top_p >= 1.f);
    const bool use_min_p = p.filter == SampleFilter::min_p && min_p > 0.f;
    const RowRandom random = row_random(p.rng, b);

    int64_t token = -1;
    if (row >= 0 && row < p.rows) {  // an index outside probs gives an invalid row
      const float* probs = p.probs + row * p.probs_stride;
      ProbMasses<kVec> masses{probs, RowSpan<kVec>::of(probs, p.vocab), {-INFINITY, 0}};
      float bound = kMassBound, total = 0.f, high = 0.f;
      for (int round = 0; round < kMaxSamplingRounds; ++round) {
        const Drawn d = draw_by_mass<kThreads, kWarp, kVec>(masses, random.uniform(uint32_t(round)) * bound, sh[0]);
        if (round == 0) {
          total = d.mass;  // of the whole row
          high = d.max;
        }
        if (!(d.mass > 0.f) || !finite(d.mass)) break;  // no mass, NaN or inf: invalid
        if (d.mass > bound || d.token < 0) {            // the bound was not one: again, with the exact mass
          bound = d.mass;
          continue;
        }
        const int64_t x = d.token;
        const float px = masses.row[x];
        if (use_min_p) {
          const float threshold = (min_p < 1.f ? min_p : 1.f) * high;
          if (px < threshold) {
            masses.pivot = {threshold, INT64_MAX};  // R = {p >= threshold}
            bound = total;
            continue;
          }
        } else if (use_k || use_p) {
          const float pivot = 0.5f * (px + high);
          float mass[2] = {0.f, 0.f};     // before x, above the pivot
          uint32_t count[2] = {0u, 0u};
          const int64_t vectors = masses.span.vectors();
#pragma unroll 4
          for (int64_t v = threadIdx.x; v < vectors; v += kThreads) {
            float pv[kVec];
            const int n = masses.load(v, pv);
            const int64_t first = masses.span.first(v);
#pragma unroll
            for (int e = 0; e < kVec; ++e) {
              if (e < n && before(pv[e], first + e, {px, x})) {
                mass[0] += pv[e];
                count[0] += 1u;
              }
              if (e < n && pv[e] > pivot) {
                mass[1] += pv[e];
                count[1] += 1u;
              }
            }
          }
          block_reduce<kThreads, kWarp>(mass, sh[0].f, SumOp{});
          block_reduce<kThreads, kWarp>(count, sh[0].u, SumOp{});
          const auto kept = [&](int i) {  // the token after the counted ones is kept (the first always is)
            return count[i] == 0u || ((!use_k || int64_t(count[i]) < k) && (!use_p || mass[i] < top_p * total));
          };
          if (!kept(0)) {
            if (!kept(1)) {
              masses.pivot = {pivot, 0};  // R = {p > pivot}: every token at or below it breaks the filter
              bound = mass[1] * kMassBound;
            } else {
              masses.pivot = {px, x};
              bound = mass[0] * kMassBound;
              high = pivot;  // the boundary is at most the pivot
            }
            continue;
          }
        }
        token = x;
        break;
      }
    }
    if (threadIdx.x == 0) {
      const int64_t out = token >= 0 ? token : 0;
      if (p.out_int64)
        static_cast<int64_t*>(p.out)[b] = out;
      else
        static_cast<int32_t*>(p.out)[b] = int32_t(out);
      if (p.valid != nullptr) p.valid[b] = token >= 0;
    }
  }
}

template <int kWarp>
const char* run_sampling(const SamplingParams& p, gpuStream_t stream) {
  if (p.batch == 0) return nullptr;
  const auto kernel = sampling_kernel<kSamplingThreads, kWarp, 4>;  // any row: RowSpan's scalar head and tail
  const int64_t blocks = p.batch < kMaxBlocks ? p.batch : kMaxBlocks;
  FK_LAUNCH(kernel, dim3(unsigned(blocks)), dim3(kSamplingThreads), stream)(p);
  return last_launch_error();
}

// ---- renormalization: radix select ----

// The order-preserving unsigned key of a float: a < b as floats iff key(a) < key(b), and -0 is +0
// (equal floats tie, to the lower index); NaN aside.
FK_HOST_DEVICE uint32_t order_key(float x) {
  const uint32_t b = bit_cast<uint32_t>(x) == 0x80000000u ? 0u : bit_cast<uint32_t>(x);
  return b & 0x80000000u ? ~b : b | 0x80000000u;
}
// The key of a T value read as float: a 16-bit value's low 10 key bits are those its sign gives (a NaN's
// payload may set others on conversion), so two radix passes pin a 16-bit key.
template <typename T>
FK_HOST_DEVICE uint32_t value_key(float x) {
  const uint32_t key = order_key(x);
  if constexpr (sizeof(T) == 2) return key >> 31 ? key & ~0x3ffu : key | 0x3ffu;
  return key;
}
FK_HOST_DEVICE float key_value(uint32_t key) { return bit_cast<float>(key & 0x80000000u ? key & 0x7fffffffu : ~key); }

// max(x, 0) in fixed point with 40 fraction bits (values past 2^23 clamp), exact integer sums.
FK_HOST_DEVICE uint64_t fixed40(float x) {
  const uint32_t b = bit_cast<uint32_t>(x);
  if (b >> 31 || b == 0u) return 0u;
  const int e = int(b >> 23 & 0xffu);
  if (e == 0xff) return uint64_t(1) << 63;  // inf or NaN: the largest mass
  const uint64_t m = (b & 0x7fffffu) | (e ? 0x800000u : 0u);
  const int shift = (e ? e : 1) - 110;  // value = m * 2^((e or 1) - 150), times 2^40
  if (shift >= 0) return m << (shift < 39 ? shift : 39);
  return shift > -64 ? m >> -shift : 0u;
}

inline constexpr int kRadixBins = 2048;
// The digits: bits 31-21, 20-10 and 9-0 of the key.
FK_HOST_DEVICE int radix_shift(int pass) { return pass == 0 ? 21 : pass == 1 ? 10 : 0; }

struct RenormShared {
  uint32_t count[kRadixBins];
  uint64_t mass[kRadixBins];
  uint64_t u64[2 * kSamplingThreads / 32];
  float f[kSamplingThreads / 32];
  uint32_t u32[kSamplingThreads / 32];
  uint64_t above_weight;  // of the bin chosen: the weight of the bins above it
  float above_value_mass;  // the last pass: the fp32 mass of the bins above it
  uint32_t chosen;
};

template <typename T, int kVec>
struct RowValues {
  const T* row;
  RowSpan<kVec> span;
  FK_DEVICE int load(int64_t v, float (&x)[kVec]) const { return span.load(row, v, x); }
};

template <int kThreads, int kWarp, typename T, int kVec>
__global__ void FK_LAUNCH_BOUNDS(kThreads, 1) renorm_kernel(RenormParams p) {
  pdl_wait();  // before any global memory access (platform.h: PDL)
  if (FK_WARP_SIZE_MISMATCH(kWarp)) {
    trap();
    return;
  }
  FK_STATIC_SHARED(RenormShared, shared, [1]);
  RenormShared& sh = shared[0];
  const bool by_mass = p.kind == RenormKind::top_p_probs;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const T* in_row = static_cast<const T*>(p.in) + r * p.in_stride;
    const RowValues<T, kVec> in{in_row, RowSpan<kVec>::of(in_row, p.vocab)};
    const int64_t vectors = in.span.vectors();
    T* out = static_cast<T*>(p.out) + r * p.out_stride;
    const bool out_wide = reinterpret_cast<uintptr_t>(out + in.span.head) % 16 == 0;  // its vectors line up with the input's
    const int64_t k = p.top_k_arr != nullptr ? p.top_k_arr[r] : p.top_k;
    const float top_p = p.top_p_arr != nullptr ? p.top_p_arr[r] : p.top_p;
    const bool keep_all = by_mass ? top_p >= 1.f : (k <= 0 || k >= p.vocab);  // NaN top_p: the first token

    // Radix select of the threshold key: the lowest key K whose tokens above weigh less than the
    // limit (count: k; mass: top_p times the row's mass, at least 1 so the first token stays).
    uint32_t prefix = 0u;       // the threshold's digits found so far
    uint64_t above = 0u;        // weight of the tokens whose keys are above the prefix's range
    uint64_t limit = uint64_t(k > 0 ? k : 1);
    float kept_mass = 0.f;      // fp32 mass of the tokens decided kept (above the prefix)
    uint32_t tied = 0u;         // tokens with the threshold key
    // A 16-bit value's key has its low 10 bits fixed by its sign (value_key): two passes pin it, and the
    // second's bins are single keys, as the third's are for fp32
    constexpr int kLastPass = sizeof(T) == 2 ? 1 : 2;
    for (int pass = 0; pass <= kLastPass && !keep_all; ++pass) {
      const int shift = radix_shift(pass), bins = pass == 2 ? 1024 : 2048;
      const int high_shift = pass == 0 ? 32 : radix_shift(pass - 1);  // bits above this digit are the prefix
      for (int i = threadIdx.x; i < kRadixBins; i += kThreads) {
        sh.count[i] = 0u;
        sh.mass[i] = 0u;
      }
      __syncthreads();
      float decided = 0.f;  // fp32 mass of the tokens whose high bits are above the prefix
#pragma unroll 2
      for (int64_t v = threadIdx.x; v < vectors; v += kThreads) {
        float x[kVec];
        const int n = in.load(v, x);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          if (e >= n) continue;
          const uint32_t key = value_key<T>(x[e]);
          const uint32_t high = high_shift == 32 ? 0u : key >> high_shift;
          if (high == prefix) {
            const uint32_t bin = (key >> shift) & uint32_t(bins - 1);
            atomicAdd(&sh.count[bin], 1u);
            if (by_mass) atomicAdd(reinterpret_cast<unsigned long long*>(&sh.mass[bin]), (unsigned long long)fixed40(x[e]));
          } else if (high > prefix) {
            decided += x[e] > 0.f ? x[e] : 0.f;  // negative probabilities count as 0
          }
        }
      }
      __syncthreads();
      if (pass == 0 && by_mass) {  // the row's mass, from the first histogram
        uint64_t t = 0u;
        for (int i = threadIdx.x; i < kRadixBins; i += kThreads) t += sh.mass[i];
        t = block_reduce<kThreads, kWarp>(t, sh.u64, SumOp{});
        double l = double(top_p) * double(t);
        l = l > 0.0 ? l : 0.0;  // negative or NaN: the first token only
        limit = uint64_t(l) + (double(uint64_t(l)) < l ? 1u : 0u);  // kept iff mass before < top_p * mass
        limit = limit > 0u ? limit : 1u;
      }
      if (pass == kLastPass) kept_mass = block_reduce<kThreads, kWarp>(decided, sh.f, SumOp{});
      // Bins from the top: thread t owns bins (bins - 1 - t * per, ...) downward.
      const int per = bins / kThreads;
      uint64_t own = 0u;
      for (int i = 0; i < per; ++i) {
        const int bin = bins - 1 - (int(threadIdx.x) * per + i);
        own += by_mass ? sh.mass[bin] : uint64_t(sh.count[bin]);
      }
      const PrefixSum<uint64_t> from_top = block_prefix_sum<kThreads, kWarp>(own, sh.u64);
      // The lowest non-empty bin whose bins above weigh less than the limit (with `above`).
      uint32_t choice = 0u;  // 1 + position from the top, 0: none in this thread's bins
      uint64_t running = above + from_top.exclusive;
      for (int i = 0; i < per; ++i) {
        const int bin = bins - 1 - (int(threadIdx.x) * per + i);
        if (sh.count[bin] > 0u && running < limit) choice = uint32_t(threadIdx.x) * per + i + 1;
        running += by_mass ? sh.mass[bin] : uint64_t(sh.count[bin]);
      }
      const uint32_t chosen = block_reduce<kThreads, kWarp>(choice, sh.u32, MaxOp{});
      // chosen > 0: the prefix's tokens include the first one not yet counted, which is always kept
      const int chosen_bin = bins - int(chosen);
      if (threadIdx.x == (chosen - 1) / per) {
        uint64_t w = above + from_top.exclusive;
        for (int i = 0; i < per; ++i) {
          const int bin = bins - 1 - (int(threadIdx.x) * per + i);
          if (bin == chosen_bin) break;
          w += by_mass ? sh.mass[bin] : uint64_t(sh.count[bin]);
        }
        sh.above_weight = w;
      }
      // The last digit's bins hold single keys: the fp32 mass of those above the chosen one.
      const auto full_key = [&](int bin) {  // the key of the last pass's bin
        if (pass == 2) return prefix << 10 | uint32_t(bin);
        return (prefix << 11 | uint32_t(bin)) << 10 | (prefix >> 10 ? 0u : 0x3ffu);  // 16-bit: the sign's low bits
      };
      float above_bins = 0.f;
      if (pass == kLastPass) {
        for (int i = 0; i < per; ++i) {
          const int bin = bins - 1 - (int(threadIdx.x) * per + i);
          const float value = key_value(full_key(bin));
          if (bin > chosen_bin && value > 0.f) above_bins += float(sh.count[bin]) * value;
        }
        above_bins = block_reduce<kThreads, kWarp>(above_bins, sh.f, SumOp{});
      }
      __syncthreads();
      above = sh.above_weight;
      tied = sh.count[chosen_bin];
      prefix = pass == kLastPass ? full_key(chosen_bin) : prefix << 11 | uint32_t(chosen_bin);
      if (pass == kLastPass) kept_mass += above_bins;
      __syncthreads();  // the histograms are read before the next pass clears them
    }

    // The tied tokens kept, lowest indices first.
    const float threshold = key_value(prefix);
    uint32_t take = tied;
    if (!keep_all) {
      if (!by_mass) {
        take = uint32_t(limit - above);
      } else {
        const uint64_t unit = fixed40(threshold);  // each tied token adds this to the mass before the next
        if (unit > 0u) {
          const uint64_t n = (limit - above + unit - 1) / unit;  // tokens r with above + r * unit < limit
          take = n < tied ? uint32_t(n) : tied;
        }
      }
      kept_mass += float(take) * (threshold > 0.f ? threshold : 0.f);
    } else if (p.kind != RenormKind::top_k_logits) {
      float s = 0.f;
      for (int64_t v = threadIdx.x; v < vectors; v += kThreads) {
        float x[kVec];
        in.load(v, x);
#pragma unroll
        for (int e = 0; e < kVec; ++e) s += x[e] > 0.f ? x[e] : 0.f;
      }
      kept_mass = block_reduce<kThreads, kWarp>(s, sh.f, SumOp{});
    }
    const float scale = 1.f / kept_mass;
    const bool ranks = !keep_all && take < tied;  // tied tokens need their rank in index order
    uint32_t tied_before = 0u;                    // tied tokens in earlier chunks
    // Chunk c covers vectors [c * kThreads, (c + 1) * kThreads): thread order is index order.
    for (int64_t base = 0; base < vectors; base += kThreads) {
      const int64_t v = base + threadIdx.x;
      float x[kVec] = {};
      const int n = v < vectors ? in.load(v, x) : 0;
      uint32_t mine = 0u;
#pragma unroll
      for (int e = 0; e < kVec; ++e) mine += e < n && value_key<T>(x[e]) == prefix ? 1u : 0u;
      uint32_t rank = tied_before;
      if (ranks) {  // uniform
        const PrefixSum<uint32_t> s = block_prefix_sum<kThreads, kWarp>(mine, sh.u32);
        rank += s.exclusive;
        tied_before += s.total;
      }
      if (n > 0) {
        Vec<T, kVec> y;
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          bool keep = keep_all || value_key<T>(x[e]) > prefix;
          if (!keep && value_key<T>(x[e]) == prefix) keep = rank++ < take;
          if (p.kind == RenormKind::top_k_logits)
            y.set(e, keep ? x[e] : -INFINITY);
          else
            y.set(e, keep && x[e] > 0.f ? x[e] * scale : 0.f);
        }
        T* o = out + in.span.first(v);
        if (out_wide) {
          y.store(o, n);
        } else {
#pragma unroll
          for (int e = 0; e < kVec; ++e)
            if (e < n) o[e] = y.get(e);
        }
      }
    }
    __syncthreads();  // shared memory is free for the next row
  }
}

template <int kWarp>
const char* run_renorm(const RenormParams& p, gpuStream_t stream) {
  if (p.rows == 0 || p.vocab == 0) return nullptr;
  return with_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    const auto kernel = renorm_kernel<kSamplingThreads, kWarp, T, kVec16<T>>;  // any row: RowSpan
    const int64_t blocks = p.rows < kMaxBlocks ? p.rows : kMaxBlocks;
    FK_LAUNCH(kernel, dim3(unsigned(blocks)), dim3(kSamplingThreads), stream)(p);
    return last_launch_error();
  });
}

}  // namespace fk
