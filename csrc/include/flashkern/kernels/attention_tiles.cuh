// What the attention kernels share: reading work items, streaming K/V tiles of a paged cache
// into shared memory, and writing a query's state to its output or to its slot.
#pragma once

#include <type_traits>

#include "flashkern/attention_state.h"
#include "flashkern/attention_work.h"
#include "flashkern/divmod.h"
#include "flashkern/ops.h"
#include "flashkern/vec.h"

namespace fk {

inline constexpr int kVec16Bit = 8;  // 16-bit elements per 16-byte vector

FK_DEVICE const PlanHeader& plan_header(const BatchAttentionParams& p) {
  return *reinterpret_cast<const PlanHeader*>(p.plan);
}

// kv_indices[level] with constant indices only: a run-time index into a kernel parameter makes
// AMD compilers copy the whole parameter block to scratch memory.
FK_DEVICE const int32_t* level_indices(const BatchAttentionParams& p, int level) {
  const int32_t* indices = p.kv_indices[0];
#pragma unroll
  for (int i = 1; i < kMaxLevels; ++i) indices = level == i ? p.kv_indices[i] : indices;
  return indices;
}
FK_DEVICE int32_t level_entries(const BatchAttentionParams& p, int level) {  // 0 for a level not passed
  int32_t entries = 0;
#pragma unroll
  for (int i = 0; i < kMaxLevels; ++i) entries = level == i ? p.kv_indices_len[i] : entries;
  return entries;
}

FK_DEVICE AttentionWorkItem load_item(const BatchAttentionParams& p, AttentionKind kind, int i) {
  const int4* w = reinterpret_cast<const int4*>(p.plan + plan_header(p).items[int(kind)] + kItemWords * i);
  const int4 a = w[0], b = w[1], c = w[2];
  return {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w, c.x, c.y, c.z, c.w};
}

// A score q.k as the base-2 logit the online softmax takes: times sm_scale, soft-capped where asked
// (cap * tanh(logit / cap)), times log2 e; an fp8 cache's per-head k_scale scales the logit. The cap is uniform: one branch the whole grid takes alike.
// tanh(y) = 1 - 2 / (e^2y + 1): one exp2 and a fast division (tanhf, or an IEEE division, costs the
// decode kernel a spill); the error is absolute, a few 1e-7 * cap in the logit.
struct LogitMap {
  float scale;  // applied to q.k first: sm_scale * log2 e, or 2 y log2 e under a soft cap (y = sm_scale q.k / cap)
  float cap;    // cap * log2 e, or 0: no soft cap
  FK_DEVICE LogitMap(const BatchAttentionParams& p, int kv_head)  // the head's k_scale joins sm_scale
      : scale((p.logits_soft_cap > 0.f ? 2.f * kLog2e * p.sm_scale / p.logits_soft_cap : p.sm_scale * kLog2e) *
              (p.k_scale != nullptr ? p.k_scale[kv_head] : 1.f)),
        cap(p.logits_soft_cap > 0.f ? p.logits_soft_cap * kLog2e : 0.f) {}
  FK_DEVICE float operator()(float scaled) const {
    return cap > 0.f ? cap - fast_div(2.f * cap, exp2f(scaled) + 1.f) : scaled;
  }
};

// Bit `bit` of the custom masks (numpy.packbits(..., bitorder="little")): whether the query may see
// the token. A bit past the mask's bytes (a plan made for another mask) is never read: hidden.
FK_DEVICE bool mask_bit(const BatchAttentionParams& p, int32_t bit) {
  return (bit >> 3) < p.custom_mask_bytes && (p.custom_mask[bit >> 3] >> (bit & 7)) & 1;
}

// Offset of element d of row `row` in a [rows, kHeadDim] tile of 16-bit values in shared memory.
// Swizzled tiles XOR the 16-byte column with the row's low 3 bits, so that the 8 rows an
// ldmatrix phase reads sit in 8 different bank groups.
template <int kHeadDim, bool kSwizzle>
FK_DEVICE int tile_offset(int row, int d) {
  const int chunk = d / kVec16Bit;
  return row * kHeadDim + kVec16Bit * (kSwizzle ? chunk ^ (row & 7) : chunk) + d % kVec16Bit;
}

// Decodes an fp8 KV cache's codes into halves, exactly: every value of the four formats is a half.
// sm_89+ converts two OCP codes an instruction (cvt.rn.f16x2.e4m3x2 / e5m2x2). Elsewhere an e5m2 code
// is a half's top byte, an e4m3 code's bits go into a half that is then scaled by 2^(15 - bias) (NaN
// fixed up), and e5m2fnuz, whose top exponent is past half's, takes numeric's generic decode. The
// format (numeric::Fp8) is a run-time value, uniform over the grid: one kernel serves them all.
struct Fp8Decoder {
  int format;
  // Two codes, bits 0-7 and 8-15 of `two`, as a half2's bits: the first code in the low half.
  FK_DEVICE uint32_t pair(uint32_t two) const {
#if defined(FK_CUDA) && defined(FK_DEVICE_PASS) && __CUDA_ARCH__ >= 890
    uint32_t h;
    if (format == int(numeric::Fp8::e5m2)) {
      asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h) : "h"(uint16_t(two)));
    } else {
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(uint16_t(two)));
    }
    return h;
#else
    return uint32_t(one(two & 0xffu)) | uint32_t(one((two >> 8) & 0xffu)) << 16;
#endif
  }
  FK_HOST_DEVICE uint16_t one(uint32_t b) const {
    using numeric::Fp8;
    if (format == int(Fp8::e5m2)) return uint16_t(b << 8);  // inf and NaN included
    if (format == int(Fp8::e5m2fnuz)) return from_float<half_t>(numeric::fp8_bits_to_float(uint8_t(b), Fp8::e5m2fnuz)).bits;
    const bool fn = format == int(Fp8::e4m3fn);  // else e4m3fnuz: bias 8, NaN is 0x80 (no -0)
    if (fn ? (b & 0x7fu) == 0x7fu : b == 0x80u) return 0x7e00;
    const float x = to_float(half_t{uint16_t(((b & 0x80u) << 8) | ((b & 0x7fu) << 7))}) * (fn ? 256.f : 128.f);
    return from_float<half_t>(x).bits;  // exact
  }
  // Eight codes (the bytes of lo, then hi) as halves.
  FK_DEVICE Vec<half_t, kVec16Bit> eight(uint32_t lo, uint32_t hi) const {
    Vec<half_t, kVec16Bit> x;
    x.w[0] = pair(lo), x.w[1] = pair(lo >> 16), x.w[2] = pair(hi), x.w[3] = pair(hi >> 16);
    return x;
  }
};

// Streams one work item's KV chunk of one KV head through kStages shared-memory stages of
// [kRows, kHeadDim] K and V tiles of T, 16 bytes per copy: thread i copies column chunk i % kChunks of
// rows i / kChunks + j * kRowsPerPass. The pages of the tile to be copied next are looked up one
// tile ahead, so that the index loads are off the copies' critical path. A row past the chunk's end
// copies the chunk's last token again (the kernels give it a zero weight; its values are finite,
// unlike whatever a page holds past its last token), so that every row's page is an entry of the
// page table and one check covers them all: a page index outside the cache (any int32, -1 included)
// zero-fills and sets `poisoned`, and the kernel then writes NaN for the query instead of reading
// out of bounds. The caller commits and waits (cp.async groups).
// An fp8 cache (kFp8) is read kCopyElems codes (bytes) at a time; the format is a run-time value
// (Fp8Decoder), the scales are the kernels' (LogitMap, StateSink). Three ways, all exact and none
// with a barrier of its own:
// - kCopyElems = 8, the 16-bit mapping (the decode kernel): cp.async lands the codes in `codes`
//   (kStages tiles of [row][kHeadDim] bytes, the kernel's only tiles) and a lane reads only the chunks
//   it copied, decoding them in registers (chunk_of).
// - kCopyElems = 16 with cp.async (the multi-query kernel on CUDA): half the copies and passes. The
//   codes land in a staging area of kStages - 1 tiles (the copies in flight), and dequantize(tile)
//   turns the thread's own codes into T in the 16-bit tile before the barrier that orders the tile for
//   its readers and before the thread's next copy into the same staging.
// - kCopyElems = 16 without cp.async (HIP): the codes are loaded into registers and stored as T, no
//   staging at all.
// kFp8 is a template parameter and each kernel has an fp8 instantiation of its own: the 16-bit kernels
// stay as lean as they were (the 64-row tile of head_dim 256 and the decode kernel are at their
// register limits).
template <typename T, int kHeadDim, int kRows, int kThreads, int kStages, bool kSwizzle, bool kFp8 = false,
          int kCopyElems = kVec16Bit>
struct KVPipeline {
  static_assert(kCopyElems == kVec16Bit || (kFp8 && kCopyElems == 2 * kVec16Bit), "16-byte copies, or 8 / 16 of fp8");
  static constexpr int kChunks = kHeadDim / kCopyElems;  // copies a row
  static constexpr int kRowsPerPass = kThreads / kChunks;
  static constexpr int kPasses = kRows / kRowsPerPass;
  static constexpr int kStageElems = 2 * kRows * kHeadDim;  // K, then V
  static constexpr bool kStaged = kFp8 && kCopyElems == 2 * kVec16Bit && kAsyncCopy;  // dequantize() from staging
  static constexpr bool kInRegisters = kFp8 && kCopyElems == 2 * kVec16Bit && !kAsyncCopy;
  static constexpr int kCodeTiles = !kFp8 || kInRegisters ? 0 : kStaged ? (kStages > 1 ? kStages - 1 : 1) : kStages;
  static constexpr int kCodeBytes = kCodeTiles * kStageElems;  // where an fp8 cache's copies land
  static_assert(kThreads % kChunks == 0 && kRows % kRowsPerPass == 0, "whole rows per pass, whole passes per tile");

  using C = std::conditional_t<kFp8, uint8_t, T>;  // the cache's elements
  const C* k;  // this KV head's K and V, chunk column included
  const C* v;
  int64_t k_page, k_slot, v_page, v_slot;  // strides
  const int32_t* pages;                     // the group's entries of kv_indices
  uint32_t entries;                         // how many there are in the page table from `pages` on
  int32_t identity_base;                    // >= 0: the page table is the identity (ragged KV), from this page
  Divmod page_size;
  uint32_t num_pages;
  int kv_begin, kv_end;
  int chunk, row0;
  int next;                 // the first token of the tile that the next copy() copies
  int32_t page[kPasses];    // its pages, row by row
  T* stages;                // kStages x kStageElems in shared memory
  uint8_t* codes;           // an fp8 cache's kCodeBytes (see above)
  Fp8Decoder fp8;
  bool poisoned = false;    // a page outside the cache was named

  FK_DEVICE KVPipeline(const BatchAttentionParams& p, const AttentionWorkItem& item, int kv_head, int tid, T* stages_,
                       uint8_t* codes_ = nullptr)
      : page_size(p.page_div), stages(stages_), codes(codes_), fp8{p.kv_format} {
    chunk = tid % kChunks;
    row0 = tid / kChunks;
    k = static_cast<const C*>(p.k_cache) + kv_head * p.k_strides[2] + chunk * kCopyElems;
    v = static_cast<const C*>(p.v_cache) + kv_head * p.v_strides[2] + chunk * kCopyElems;
    k_page = p.k_strides[0], k_slot = p.k_strides[1], v_page = p.v_strides[0], v_slot = p.v_strides[1];
    pages = level_indices(p, item.level) + item.page_begin;
    const int32_t left = level_entries(p, item.level) - item.page_begin;
    entries = left > 0 ? uint32_t(left) : 0u;
    identity_base = (plan_header(p).identity_levels >> item.level) & 1 ? item.page_begin : -1;
    num_pages = uint32_t(p.num_pages < (int64_t(1) << 31) ? p.num_pages : int64_t(1) << 31);  // indices are int32
    kv_begin = item.kv_begin, kv_end = item.kv_end;
  }

  FK_DEVICE int tiles() const { return int(ceil_div(kv_end - kv_begin, kRows)); }
  FK_DEVICE const T* k_tile(int tile) const { return stages + (tile % kStages) * kStageElems; }
  FK_DEVICE const T* v_tile(int tile) const { return k_tile(tile) + kRows * kHeadDim; }
  // An fp8 cache's codes of `tile`: K's, V's kRows * kHeadDim bytes further
  FK_DEVICE const uint8_t* k_codes(int tile) const { return codes + (tile % kCodeTiles) * kStageElems; }
  FK_DEVICE const uint8_t* v_codes(int tile) const { return k_codes(tile) + kRows * kHeadDim; }

  // Looks up tile 0 and copies the first kStages - 1 tiles, a commit group each.
  FK_DEVICE void start() {
    lookup(kv_begin);
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < tiles()) copy(s);
      cp_async_commit();
    }
  }

  // Copies `tile` (the next one in order) into its stage and looks up the pages of the one after.
  FK_DEVICE void copy(int tile) {
    issue(tile);
    lookup(kv_begin + (tile + 1) * kRows);
  }

  // Looks up the pages of the tile starting at token `start` (the next one to issue): an empty
  // chunk copies nothing, an entry past the page table poisons its query as a bad page does.
  FK_DEVICE void lookup(int start) {
    next = start;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int pos = last_token(start + row0 + i * kRowsPerPass);
      const uint32_t entry = page_size.div(uint32_t(pos));
      page[i] = pos < kv_begin        ? 0
                : identity_base >= 0 ? int32_t(uint32_t(identity_base) + entry)  // checked against the cache
                : entry < entries    ? pages[entry]
                                     : -1;
    }
  }

  // The token a row at `pos` copies: itself, or the chunk's last one past the end.
  FK_DEVICE int last_token(int pos) const { return pos < kv_end ? pos : kv_end - 1; }

  // Copies the looked-up tile into its stage (or an fp8 cache's codes into theirs).
  FK_DEVICE void issue(int tile) {
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int row = row0 + i * kRowsPerPass;
      const bool in_cache = uint32_t(page[i]) < num_pages;
      poisoned |= !in_cache;
      uint32_t q, slot;  // the slot is recomputed rather than kept: fewer registers per row
      page_size.divmod(uint32_t(last_token(next + row)), q, slot);
      const int64_t pg = in_cache ? page[i] : 0;
      const C* k_at = k + pg * k_page + int64_t(slot) * k_slot;
      const C* v_at = v + pg * v_page + int64_t(slot) * v_slot;
      if constexpr (!kFp8) {
        T* to = stages + (tile % kStages) * kStageElems + tile_offset<kHeadDim, kSwizzle>(row, chunk * kCopyElems);
        cp_async16(to, k_at, in_cache);
        cp_async16(to + kRows * kHeadDim, v_at, in_cache);
      } else if constexpr (kInRegisters) {  // no cp.async: load, decode, store (zeros outside the cache)
        uint4 kb = make_uint4(0, 0, 0, 0), vb = make_uint4(0, 0, 0, 0);  // values: a named zero went to scratch
        if (in_cache) kb = *reinterpret_cast<const uint4*>(k_at), vb = *reinterpret_cast<const uint4*>(v_at);
        store_decoded(tile, row, 0, kb);
        store_decoded(tile, row, 1, vb);
      } else {
        uint8_t* to = codes + (tile % kCodeTiles) * kStageElems + row * kHeadDim + chunk * kCopyElems;
        if constexpr (kCopyElems == 2 * kVec16Bit) {
          cp_async16(to, k_at, in_cache);
          cp_async16(to + kRows * kHeadDim, v_at, in_cache);
        } else {
          cp_async8(to, k_at, in_cache);
          cp_async8(to + kRows * kHeadDim, v_at, in_cache);
        }
      }
    }
  }

  // Elements [chunk * 8, chunk * 8 + 8) of row `row` of an fp8 cache's K (at = k_codes(tile)) or V
  // (v_codes), decoded in registers. Only the thread that copied them reads them (kCopyElems = 8).
  FK_DEVICE Vec<half_t, kVec16Bit> chunk_of(const uint8_t* at, int row, int chunk) const {
    static_assert(kFp8 && kCopyElems == kVec16Bit && !kSwizzle, "an fp8 cache's own codes");
    const uint2 b = *reinterpret_cast<const uint2*>(at + row * kHeadDim + chunk * kVec16Bit);
    return fp8.eight(b.x, b.y);
  }

  // With staging: this thread's codes of `tile`, landed (its cp_async_wait), as T in the tile.
  FK_DEVICE void dequantize(int tile) {
    if constexpr (kStaged) {
#pragma unroll 1  // one copy at a time: the kernels have no registers to spare
      for (int i = 0; i < 2 * kPasses; ++i) {  // K's rows, then V's
        const int row = row0 + (i % kPasses) * kRowsPerPass;
        const int kv = i / kPasses;
        store_decoded(tile, row, kv,
                      *reinterpret_cast<const uint4*>(k_codes(tile) + kv * kRows * kHeadDim + row * kHeadDim + chunk * kCopyElems));
      }
    }
  }

  // 16 codes of row `row` of K (kv = 0) or V (1), this thread's chunk, as T in tile's stage (32 bytes).
  FK_DEVICE void store_decoded(int tile, int row, int kv, uint4 b) {
    T* at = stages + (tile % kStages) * kStageElems + kv * kRows * kHeadDim;
#pragma unroll
    for (int c = 0; c < 2; ++c) {  // 16 bytes of T each
      const Vec<half_t, kVec16Bit> h = fp8.eight(c ? b.z : b.x, c ? b.w : b.y);
      uint4 out = make_uint4(h.w[0], h.w[1], h.w[2], h.w[3]);
      if constexpr (!std::is_same_v<T, half_t>) {  // bf16: every fp8 value is one too
        Vec<T, kVec16Bit> x;
#pragma unroll
        for (int e = 0; e < kVec16Bit; ++e) x.set(e, h.f(e));
        out = make_uint4(x.w[0], x.w[1], x.w[2], x.w[3]);
      }
      *reinterpret_cast<uint4*>(at + tile_offset<kHeadDim, kSwizzle>(row, (2 * chunk + c) * kVec16Bit)) = out;
    }
  }
};

// Stores x[0..N) at out + at as O: a pair (4 bytes) or a 16-byte vector.
template <typename O, int N>
FK_DEVICE void store_as(void* out, int64_t at, const float (&x)[N]) {
  static_assert(N == 2 || N == kVec16Bit, "pairs or 16-byte vectors");
  Vec<O, N> y;
#pragma unroll
  for (int j = 0; j < N; ++j) y.set(j, x[j]);
  if constexpr (N == 2) {
    *reinterpret_cast<uint32_t*>(static_cast<O*>(out) + at) = y.w[0];
  } else {
    y.store(static_cast<O*>(out) + at);
  }
}
// The output's dtype (o_data_type, f16 or bf16) is a run-time choice: a uniform branch at each store.
template <int N>
FK_DEVICE void store_output(void* out, DType dtype, int64_t at, const float (&x)[N]) {
  if (dtype == DType::bf16) {
    store_as<bf16_t>(out, at, x);
  } else {
    store_as<half_t>(out, at, x);
  }
}

// Where one (query, q head) state goes: out / lse when it is the query's only state (finished
// there: the head's sink and out_scale applied), else its slot of the partial states, which the
// merge kernel combines and finishes.
struct StateSink {
  void* out;        // out, or nullptr
  int64_t out_at;   // the row's first element in out
  DType out_dtype;
  float* partial;   // the row of partial_v, or nullptr
  float* lse;       // the lse or partial_s entry
  float sink;       // the head's sink logit (-inf: none) and out_scale, for a finished state
  float out_scale;
  float v_scale;    // an fp8 cache's per-head v_scale (1: none), for every state: the merge is linear in V

  FK_DEVICE StateSink(const BatchAttentionParams& p, int t, int head, int slot)
      : out(nullptr), out_at(0), out_dtype(p.out_dtype), partial(nullptr), sink(-INFINITY), out_scale(p.out_scale),
        v_scale(p.v_scale != nullptr ? p.v_scale[blockIdx.y] : 1.f) {  // every attention kernel's y: its KV head
    const int* indptr = p.plan + plan_header(p).merge_indptr;
    const int64_t row = int64_t(t) * p.qo_heads + head;
    if (indptr[t + 1] - indptr[t] == 1) {
      out = p.out;
      out_at = row * p.head_dim;
      lse = p.lse + row;
      if (p.sinks != nullptr) sink = p.sinks[head];
    } else {
      const int64_t srow = int64_t(slot) * p.qo_heads + head;
      partial = p.partial_v + srow * p.head_dim;
      lse = p.partial_s + srow;
    }
  }
  // The factor for the normalized values of a state with natural-log sum-exp s, and the lse to store.
  FK_DEVICE FinalState finish(float s) const {
    FinalState f = out != nullptr ? final_state(s, sink, out_scale) : FinalState{1.f, s};
    f.scale *= v_scale;
    return f;
  }
  FK_DEVICE void store2(int d, float a, float b) const {
    if (out != nullptr) {
      store_output(out, out_dtype, out_at + d, {a, b});
    } else {
      *reinterpret_cast<float2*>(partial + d) = make_float2(a, b);
    }
  }
  FK_DEVICE void store8(int d, const float (&x)[kVec16Bit]) const {
    if (out != nullptr) {
      store_output(out, out_dtype, out_at + d, x);
    } else {
      store16(partial + d, make_uint4(bit_cast<uint32_t>(x[0]), bit_cast<uint32_t>(x[1]), bit_cast<uint32_t>(x[2]),
                                      bit_cast<uint32_t>(x[3])));
      store16(partial + d + 4, make_uint4(bit_cast<uint32_t>(x[4]), bit_cast<uint32_t>(x[5]),
                                          bit_cast<uint32_t>(x[6]), bit_cast<uint32_t>(x[7])));
    }
  }
  FK_DEVICE void store_lse(float s) const { *lse = s; }
};

// The end of a block's work on an item whose rows' states are split over `n` parts (thread
// groups that each saw part of the KV): part i of row r left o[i][r][:] (unnormalized, fp32) and
// m[i][r], l[i][r] (base 2) in shared memory. The block merges them and writes each valid row
// with `sink_of(r)` if `writes(r)`; poisoned, or a NaN in any part: NaN. Threads take (row, 8-dim
// chunk) pairs.
template <int kHeadDim, typename SinkOf, typename Writes>
FK_DEVICE void merge_parts_and_store(const float* o, const float* m, const float* l, int n, int rows_stride, int rows,
                                     bool poisoned, SinkOf sink_of, Writes writes) {
  constexpr int kChunks = kHeadDim / kVec16Bit;
  for (int i = threadIdx.x; i < rows * kChunks; i += blockDim.x) {
    const int r = i / kChunks, d = (i % kChunks) * kVec16Bit;
    if (!writes(r)) continue;
    float m_max = -INFINITY;
    bool nan = poisoned;
    for (int j = 0; j < n; ++j) {
      m_max = fmaxf(m_max, m[j * rows_stride + r]);
      nan |= l[j * rows_stride + r] != l[j * rows_stride + r];  // fmaxf would drop it
    }
    float total = 0.f, acc[kVec16Bit] = {};
    for (int j = 0; j < n; ++j) {
      const float w = softmax_weight(m[j * rows_stride + r], m_max);
      total += w * l[j * rows_stride + r];
      const float* src = o + (int64_t(j) * rows_stride + r) * kHeadDim + d;
#pragma unroll
      for (int e = 0; e < kVec16Bit; ++e) acc[e] += w * src[e];
    }
    const StateSink sink = sink_of(r);
    const FinalState f = sink.finish(nan ? NAN : state_lse(m_max, total));
    // a row that saw no key: 0, or NaN where the head's v_scale is NaN (a bad scale tensor: kv_scale_arg)
    const float inv = total == 0.f ? 0.f * sink.v_scale : f.scale / total;
#pragma unroll
    for (int e = 0; e < kVec16Bit; ++e) acc[e] = nan ? NAN : acc[e] * inv;
    sink.store8(d, acc);
    if (d == 0) sink.store_lse(f.lse);
  }
}

}  // namespace fk
