// KV-cache compression (ops.h: KvScoresParams, KvSelectParams, KvCompactParams; flashkern.kv_compress).
//
// Scores. A block scores kScoreKeys keys of one request and KV head: it stages their K rows in shared
// memory (16-byte loads through the page table; rows padded by 16 bytes, so the 16-byte reads of
// consecutive keys fall in distinct banks), then the group's q rows kScoreRows at a time (fp32), and
// each thread, two per key, walks half of the rows: logit, mask, exp(logit - lse), a running sum. The
// two halves add in a fixed order and one thread per key writes: no atomics, the same bits every run.
// The grid is capped (kScoreBlocks) and a block loops over its request's tiles, so it need not follow
// the longest request (a CUDA graph replays one launch over new page tables).
// Rows that see none of the block's keys (causal, window) are skipped whole. The final lse comes from
// the attention run, so a probability is exact whichever way that run split the KV; the price is a
// second read of K (and the q rows, once per key tile), no V. Where few queries score (decode), the
// attention kernels write their logits instead (BatchAttentionParams::logits: 4 bytes a query head and
// key, against K's 2 * head_dim) and kv_scores_from_logits_kernel reads those, not q and K.
//
// Selection. A block per request and KV head: a radix select (8 bits a pass, a 256-bin histogram in
// shared memory) finds the budget-th largest 32-bit key, then one ordered pass writes the positions
// above it and the first (lowest) of those equal to it. Keys: forced positions (sinks, the recent
// window) 0xffffffff, a NaN 0, a float its order-preserving bits; SnapKV's pooling is recomputed from
// the raw scores at every read (pool reads, from L1/L2) rather than written anywhere.
//
// Compaction. A block per request and KV head moves its kept keys, values and scores in chunks: every
// thread reads its share of the chunk's sources into registers, a barrier, then writes them to the
// destination. In place the destination of position i is the request's own position i, and kept
// positions ascend, so a kept position is at or after its destination: the chunk's sources can be a
// destination of the same chunk (hence the barrier) but never of an earlier one.
#pragma once

#include "flashkern/attention_state.h"
#include "flashkern/dispatch.h"
#include "flashkern/kernels/block_reduce.cuh"
#include "flashkern/ops.h"
#include "flashkern/vec.h"

namespace fk {

inline constexpr int kScoreKeys = 64;
inline constexpr int kScoreThreads = 128;  // two threads a key
inline constexpr int kScoreRows = 8;       // q rows staged at a time
inline constexpr int kScoreBlocks = 2048;  // the score grid's cap: a few waves on the largest GPUs
inline constexpr int kLogitThreads = 256;  // from the attention's logits: a thread a key
inline constexpr int kSelectThreads = 256;  // one thread a histogram bin
inline constexpr int kCompactThreads = 256;
inline constexpr int kCompactVecs = 4;     // 16-byte vectors a thread holds between the read and the write

// Request b's keys: kv_len and where position j lies (its page, or -1 past num_pages).
struct PagedRequest {
  const int32_t* pages;
  int64_t kv_len;
  int page_size;

  FK_DEVICE PagedRequest(const int32_t* kv_indptr, const int32_t* kv_indices, const int32_t* last_page_len, int b,
                         int page_size_)
      : pages(kv_indices + kv_indptr[b]), page_size(page_size_) {
    const int64_t n = kv_indptr[b + 1] - kv_indptr[b];
    kv_len = n > 0 ? (n - 1) * page_size + last_page_len[b] : 0;
  }
  // positions are below 2^30 (attention_plan.h: kMaxKvLength): 32-bit division, not the 64-bit
  // subroutine whose calls cost the selection kernel a stack frame and spills
  FK_DEVICE int64_t page(int64_t j) const { return pages[int32_t(j) / page_size]; }
  FK_DEVICE int slot(int64_t j) const { return int32_t(j) % page_size; }
};

// The float's order as an unsigned key: larger float, larger key; NaN the smallest of all.
FK_HOST_DEVICE uint32_t score_key(float s) {
  if (s != s) return 0u;
  const uint32_t bits = bit_cast<uint32_t>(s);
  return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}
inline constexpr uint32_t kForcedKey = 0xffffffffu;  // above +inf's key, 0xff800000

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kScoreThreads) kv_scores_kernel(KvScoresParams p) {
  constexpr int kVec = kVec16<T>, kRowVecs = kHeadDim / kVec, kPitch = kRowVecs + 1;  // pitch in 16-byte vectors
  // 16-byte vectors of shared memory (16-byte aligned, plain shared loads and stores)
  FK_STATIC_SHARED(uint4, k_tile, [kScoreKeys * kPitch]);
  FK_STATIC_SHARED(float4, q_rows, [kScoreRows * kHeadDim / 4]);
  FK_STATIC_SHARED(float, row_lse, [kScoreRows]);
  FK_STATIC_SHARED(float, upper_half, [kScoreKeys]);
  pdl_wait();  // before any global memory access (platform.h: PDL)
  const int b = blockIdx.y, kv_head = blockIdx.z, group = p.qo_heads / p.kv_heads;
  const PagedRequest req(p.kv_indptr, p.kv_indices, p.kv_last_page_len, b, p.page_size);
  const int32_t q_begin = p.qo_indptr[b];
  const int64_t n = p.qo_indptr[b + 1] - q_begin, first_pos = req.kv_len - n;  // query i sits at first_pos + i
  const int key = threadIdx.x % kScoreKeys, half = threadIdx.x / kScoreKeys;
  // key tiles blockIdx.x, + gridDim.x, ...: the grid need not follow the longest request (CUDA graphs)
  for (int64_t j0 = int64_t(blockIdx.x) * kScoreKeys; j0 < req.kv_len; j0 += int64_t(gridDim.x) * kScoreKeys) {
    const int64_t keys = req.kv_len - j0 < kScoreKeys ? req.kv_len - j0 : kScoreKeys;
    __syncthreads();  // the previous tile's readers of k_tile and upper_half are done
    for (int v = threadIdx.x; v < kScoreKeys * kRowVecs; v += kScoreThreads) {
      const int tile_key = v / kRowVecs, c = v % kRowVecs;
      Vec<T, kVec> x;
      const int64_t j = j0 + tile_key, page = tile_key < keys ? req.page(j) : -1;
      if (page >= 0 && page < p.num_pages)
        x.load(static_cast<const T*>(p.k_cache) + page * p.k_strides[0] + req.slot(j) * p.k_strides[1] +
               kv_head * p.k_strides[2] + c * kVec);
      else
        x.load(static_cast<const T*>(nullptr), 0);  // zeros: a key past the request or on a bad page
      k_tile[tile_key * kPitch + c] = make_uint4(x.w[0], x.w[1], x.w[2], x.w[3]);
    }

    // The queries that see a key of [j0, j0 + keys): i >= j0 - first_pos (causal), i <= last key +
    // window_left - first_pos (window).
    int64_t i_lo = 0, i_hi = n;
    if (p.causal) i_lo = j0 - first_pos > 0 ? j0 - first_pos : 0;
    if (p.window_left >= 0) {
      const int64_t hi = j0 + keys - 1 + p.window_left - first_pos + 1;
      i_hi = hi < n ? hi : n;
    }
    const int64_t j = j0 + key;
    float sum = 0.f;
    for (int64_t r0 = i_lo * group; r0 < i_hi * group; r0 += kScoreRows) {
      __syncthreads();  // the K tile is stored; the previous rows' readers are done
      for (int v = threadIdx.x; v < kScoreRows * kRowVecs; v += kScoreThreads) {
        const int rr = v / kRowVecs, c = v % kRowVecs;
        const int64_t r = r0 + rr;
        if (r >= i_hi * group) break;
        const int64_t token = q_begin + r / group, head = int64_t(kv_head) * group + r % group;
        Vec<T, kVec> x;
        x.load(static_cast<const T*>(p.q) + token * p.q_strides[0] + head * p.q_strides[1] + c * kVec);
        float4* row = q_rows + rr * (kHeadDim / 4) + c * (kVec / 4);
#pragma unroll
        for (int e = 0; e < kVec / 4; ++e)
          row[e] = make_float4(x.f(4 * e), x.f(4 * e + 1), x.f(4 * e + 2), x.f(4 * e + 3));
        if (c == 0) row_lse[rr] = p.lse[token * p.qo_heads + head];
      }
      __syncthreads();
      for (int rr = half; rr < kScoreRows && r0 + rr < i_hi * group; rr += 2) {
        const int64_t pos = first_pos + (r0 + rr) / group;
        const bool seen = key < keys && (!p.causal || j <= pos) && (p.window_left < 0 || j >= pos - p.window_left);
        const float lse = row_lse[rr];
        if (!seen || lse == -INFINITY) continue;
        const float4* row = q_rows + rr * (kHeadDim / 4);
        float dot = 0.f;
#pragma unroll 4
        for (int c = 0; c < kRowVecs; ++c) {
          const uint4 u = k_tile[key * kPitch + c];
          Vec<T, kVec> k;
          k.w[0] = u.x, k.w[1] = u.y, k.w[2] = u.z, k.w[3] = u.w;
#pragma unroll
          for (int e = 0; e < kVec / 4; ++e) {
            const float4 qv = row[c * (kVec / 4) + e];
            dot += qv.x * k.f(4 * e) + qv.y * k.f(4 * e + 1) + qv.z * k.f(4 * e + 2) + qv.w * k.f(4 * e + 3);
          }
        }
        float logit = dot * p.sm_scale;
        if (p.logits_soft_cap > 0.f) logit = p.logits_soft_cap * tanhf(logit / p.logits_soft_cap);
        sum += expf(logit - lse);
      }
    }
    if (half == 1) upper_half[key] = sum;
    __syncthreads();
    const int64_t page = key < keys ? req.page(j) : -1;
    if (half == 0 && page >= 0 && page < p.num_pages) {
      float& out = p.scores[(page * p.kv_heads + kv_head) * p.page_size + req.slot(j)];
      const float total = p.scale * (sum + upper_half[key]);
      out = p.accumulate && j < first_pos ? out + total : total;
    }
  }
}

// The same from the logits the attention kernels wrote (KvScoresParams::logits): a thread per key, the
// rows that see it in turn; consecutive threads read consecutive logits of a row.
__global__ void __launch_bounds__(kLogitThreads) kv_scores_from_logits_kernel(KvScoresParams p) {
  pdl_wait();  // before any global memory access (platform.h: PDL)
  const int b = blockIdx.y, kv_head = blockIdx.z, group = p.qo_heads / p.kv_heads;
  const PagedRequest req(p.kv_indptr, p.kv_indices, p.kv_last_page_len, b, p.page_size);
  const int64_t j = int64_t(blockIdx.x) * kLogitThreads + threadIdx.x;
  if (j >= req.kv_len || j >= p.max_kv_len) return;  // max_kv_len <= logits_stride: never past a row
  const int32_t q_begin = p.qo_indptr[b];
  const int64_t n = p.qo_indptr[b + 1] - q_begin, first_pos = req.kv_len - n;  // query i sits at first_pos + i
  // the queries that see key j: i >= j - first_pos (causal), i <= j + window_left - first_pos (window)
  int64_t i_lo = 0, i_hi = n;
  if (p.causal && j - first_pos > 0) i_lo = j - first_pos;
  if (p.window_left >= 0 && j + p.window_left - first_pos + 1 < i_hi) i_hi = j + p.window_left - first_pos + 1;
  // row (query q_begin + i, head kv_head * group + h): its lse at lse[h], its logit of key j at logit[h * stride]
  const int64_t row0 = (q_begin + i_lo) * p.qo_heads + int64_t(kv_head) * group;
  const float* lse = p.lse + row0;
  const float* logit = p.logits + row0 * p.logits_stride + j;
  float sum = 0.f;
  for (int64_t i = i_lo; i < i_hi; ++i, lse += p.qo_heads, logit += p.qo_heads * p.logits_stride) {
    for (int h = 0; h < group; ++h)
      if (lse[h] != -INFINITY) sum += exp2f(logit[h * p.logits_stride] - lse[h] * kLog2e);
  }
  const int64_t page = req.page(j);
  if (page < 0 || page >= p.num_pages) return;
  float& out = p.scores[(page * p.kv_heads + kv_head) * p.page_size + req.slot(j)];
  const float total = p.scale * sum;
  out = p.accumulate && j < first_pos ? out + total : total;
}

inline const char* run_kv_scores(const KvScoresParams& p, gpuStream_t stream) {
  if (p.batch == 0 || p.max_kv_len == 0) return nullptr;
  if (p.logits != nullptr) {
    const dim3 grid(unsigned(ceil_div(p.max_kv_len, int64_t(kLogitThreads))), unsigned(p.batch), unsigned(p.kv_heads));
    FK_LAUNCH(kv_scores_from_logits_kernel, grid, dim3(kLogitThreads), stream)(p);
    return last_launch_error();
  }
  return with_dtype16(p.dtype, [&](auto t) {
    using T = decltype(t);
    return with_head_dim(p.head_dim, [&](auto d) {
      // a key tile a block, at most max(kScoreBlocks, batch * kv_heads) blocks in all (a longer request loops)
      const int64_t requests = int64_t(p.batch) * p.kv_heads;
      const int64_t per_request = requests < kScoreBlocks ? kScoreBlocks / requests : 1;
      const int64_t tiles = ceil_div(p.max_kv_len, int64_t(kScoreKeys));
      const dim3 grid(unsigned(tiles < per_request ? tiles : per_request), unsigned(p.batch), unsigned(p.kv_heads));
      constexpr auto kernel = kv_scores_kernel<T, decltype(d)::value>;
      FK_LAUNCH(kernel, grid, dim3(kScoreThreads), stream)(p);
      return last_launch_error();
    });
  });
}

// ---------------------------------------------------------------------------------------- selection

// A key's 32-bit selection key (see the top of this file): forced, or its (pooled) score's order.
struct SelectKeys {
  const KvSelectParams& p;
  const PagedRequest& req;
  int head;
  int64_t pooled;  // the keys before the window: the only ones scored (and pooled)

  FK_DEVICE float raw(int64_t j) const {
    return p.scores[(req.page(j) * p.kv_heads + head) * p.page_size + req.slot(j)];
  }
  FK_DEVICE uint32_t operator()(int64_t j) const {
    if (j < p.keep_first || j >= pooled) return kForcedKey;
    if (p.pool <= 1) return score_key(raw(j));
    const int64_t lo = j - p.pool / 2 > 0 ? j - p.pool / 2 : 0;
    const int64_t hi = j + p.pool / 2 < pooled ? j + p.pool / 2 : pooled - 1;
    float s = 0.f;
#pragma unroll 1
    for (int64_t t = lo; t <= hi; ++t) s += raw(t);
    return score_key(s / float(p.pool));  // avg_pool1d counts the zero padding
  }
};

template <int kWarp>
__global__ void __launch_bounds__(kSelectThreads) kv_select_kernel(KvSelectParams p) {
  if (FK_WARP_SIZE_MISMATCH(kWarp)) {
    trap();
    return;
  }
  FK_STATIC_SHARED(uint32_t, histogram, [kSelectThreads]);
  FK_STATIC_SHARED(uint32_t, scratch, [kSelectThreads / kWarp]);
  FK_STATIC_SHARED(uint32_t, found, [2]);
  pdl_wait();
  const int b = blockIdx.x, head = blockIdx.y;
  const PagedRequest req(p.kv_indptr, p.kv_indices, p.kv_last_page_len, b, p.page_size);
  const int64_t len = req.kv_len, budget = p.kept_indptr[b + 1] - p.kept_indptr[b];
  int32_t* kept = p.kept + int64_t(p.kept_indptr[b]) * p.kv_heads + head;
  if (budget >= len) {  // every key, then -1
    for (int64_t i = threadIdx.x; i < budget; i += kSelectThreads) kept[i * p.kv_heads] = i < len ? int32_t(i) : -1;
    return;
  }
  if (budget <= 0) return;
  const SelectKeys keys{p, req, head, len - p.window > 0 ? len - p.window : 0};

  // Radix select: the threshold key and how many keys equal to it are kept.
  uint32_t prefix = 0u, mask = 0u;
  uint32_t remaining = uint32_t(budget);
  for (int shift = 24; shift >= 0; shift -= 8) {
    histogram[threadIdx.x] = 0u;
    __syncthreads();
    for (int64_t j = threadIdx.x; j < len; j += kSelectThreads) {
      const uint32_t k = keys(j);
      if ((k & mask) == prefix) atomicAdd(&histogram[(k >> shift) & 255u], 1u);
    }
    __syncthreads();
    // thread t holds bin 255 - t: the inclusive sum counts the keys in this bin or a higher one
    const uint32_t bin = 255u - threadIdx.x, count = histogram[bin];
    const PrefixSum<uint32_t> s = block_prefix_sum<kSelectThreads, kWarp>(count, scratch);
    if (s.exclusive < remaining && remaining <= s.inclusive) found[0] = bin, found[1] = remaining - s.exclusive;
    __syncthreads();
    prefix |= found[0] << shift;
    mask |= 255u << shift;
    remaining = found[1];
    __syncthreads();  // found is read by all before the next pass writes it
  }

  // In position order: the keys above the threshold and the first `remaining` equal to it.
  uint32_t written = 0u, equal_seen = 0u;
  for (int64_t base = 0; base < len && written < uint32_t(budget); base += kSelectThreads) {
    const int64_t j = base + threadIdx.x;
    const uint32_t k = j < len ? keys(j) : 0u;
    const bool equal = j < len && k == prefix;
    const PrefixSum<uint32_t> e = block_prefix_sum<kSelectThreads, kWarp>(equal ? 1u : 0u, scratch);
    const bool keep = (j < len && k > prefix) || (equal && equal_seen + e.exclusive < remaining);
    const PrefixSum<uint32_t> w = block_prefix_sum<kSelectThreads, kWarp>(keep ? 1u : 0u, scratch);
    // the passes saw these keys: never more than budget; the bound keeps a miscount inside the request's rows
    if (keep && written + w.exclusive < uint32_t(budget)) kept[int64_t(written + w.exclusive) * p.kv_heads] = int32_t(j);
    written += w.total;
    equal_seen += e.total;
  }
}

template <int kWarp>
const char* run_kv_select(const KvSelectParams& p, gpuStream_t stream) {
  if (p.batch == 0 || p.kv_heads == 0) return nullptr;
  constexpr auto kernel = kv_select_kernel<kWarp>;
  FK_LAUNCH(kernel, dim3(unsigned(p.batch), unsigned(p.kv_heads)), dim3(kSelectThreads), stream)(p);
  return last_launch_error();
}

// --------------------------------------------------------------------------------------- compaction

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kCompactThreads) kv_compact_kernel(KvCompactParams p) {
  constexpr int kVec = kVec16<T>, kRowVecs = kHeadDim / kVec;
  constexpr int kChunk = kCompactVecs * kCompactThreads / (2 * kRowVecs);  // positions a pass: K and V rows
  static_assert(kChunk <= kCompactThreads, "a thread holds at most one score of a chunk");
  pdl_wait();
  const int b = blockIdx.x, head = blockIdx.y;
  const int64_t kept_len = p.kept_indptr[b + 1] - p.kept_indptr[b];
  const int32_t* kept = p.kept + int64_t(p.kept_indptr[b]) * p.kv_heads + head;
  const int32_t* src_pages = p.kv_indices + p.kv_indptr[b];
  const int32_t* dst_pages = p.out_indices + p.out_indptr[b];
  const int64_t src_slots = int64_t(p.kv_indptr[b + 1] - p.kv_indptr[b]) * p.page_size;  // a kept position past
  // them (the Python layer checks kept; a direct caller might not) is skipped, not read from another request
  // positions are below 2^30 (attention_plan.h: kMaxKvLength): 32-bit division
  auto offset = [&](const int32_t* pages, int32_t j, const int64_t* strides) {
    return int64_t(pages[j / p.page_size]) * strides[0] + (j % p.page_size) * strides[1] + head * strides[2];
  };
  auto score_at = [&](const int32_t* pages, int32_t j) -> float& {
    return p.scores[(int64_t(pages[j / p.page_size]) * p.kv_heads + head) * p.page_size + j % p.page_size];
  };
  for (int64_t base = 0; base < kept_len; base += kChunk) {
    Vec<T, kVec> x[kCompactVecs];
    float s = 0.f;
#pragma unroll
    for (int u = 0; u < kCompactVecs; ++u) {
      const int item = threadIdx.x + u * kCompactThreads, is_v = item / (kChunk * kRowVecs);
      const int64_t i = base + (item % (kChunk * kRowVecs)) / kRowVecs;
      const int c = item % kRowVecs;
      if (i < kept_len && kept[i * p.kv_heads] >= 0 && kept[i * p.kv_heads] < src_slots) {
        const int32_t j = kept[i * p.kv_heads];
        x[u].load(is_v ? static_cast<const T*>(p.v_cache) + offset(src_pages, j, p.v_strides) + c * kVec
                       : static_cast<const T*>(p.k_cache) + offset(src_pages, j, p.k_strides) + c * kVec);
      }
    }
    const int64_t own = base + threadIdx.x;
    const bool own_kept = threadIdx.x < kChunk && own < kept_len && kept[own * p.kv_heads] >= 0 &&
                          kept[own * p.kv_heads] < src_slots;
    if (p.scores != nullptr && own_kept) s = score_at(src_pages, kept[own * p.kv_heads]);
    __syncthreads();  // every source of the chunk is read before any destination of it is written
#pragma unroll
    for (int u = 0; u < kCompactVecs; ++u) {
      const int item = threadIdx.x + u * kCompactThreads, is_v = item / (kChunk * kRowVecs);
      const int64_t i = base + (item % (kChunk * kRowVecs)) / kRowVecs;
      const int c = item % kRowVecs;
      if (i < kept_len && kept[i * p.kv_heads] >= 0 && kept[i * p.kv_heads] < src_slots)
        x[u].store(is_v ? static_cast<T*>(p.v_cache) + offset(dst_pages, int32_t(i), p.v_strides) + c * kVec
                        : static_cast<T*>(p.k_cache) + offset(dst_pages, int32_t(i), p.k_strides) + c * kVec);
    }
    if (p.scores != nullptr && own_kept) score_at(dst_pages, int32_t(own)) = s;
    // no barrier before the next chunk: its sources are at or after its own first position, past
    // every destination written so far
  }
}

inline const char* run_kv_compact(const KvCompactParams& p, gpuStream_t stream) {
  if (p.batch == 0 || p.kv_heads == 0) return nullptr;
  return with_dtype16(p.dtype, [&](auto t) {
    using T = decltype(t);
    return with_head_dim(p.head_dim, [&](auto d) {
      constexpr auto kernel = kv_compact_kernel<T, decltype(d)::value>;
      FK_LAUNCH(kernel, dim3(unsigned(p.batch), unsigned(p.kv_heads)), dim3(kCompactThreads), stream)(p);
      return last_launch_error();
    });
  });
}

}  // namespace fk
