// Multi-query attention on the matrix units: many query rows against one chunk of KV, each K/V
// tile loaded into shared memory once for all of them. It reads a shared prefix once for every
// request of a cascade level, and serves decode with GQA groups of more than kDecodeMaxGroup heads
// (the group's heads are the rows). Rows of a group: (query, q head of the GQA group), query-major.
//   tile64: 64 rows (4 warps x 16, or 8 x 8 on HIP wave32), every warp over the whole KV tile
//   tile16: 16 rows, kWarpsN groups of warps splitting each KV tile, merging their states at the end;
//           head_dim 512 (16-row tiles only): kWarpsD = 4 warps over the same 16 tokens, each
//           computing the whole S (cheap: decode and prefill at 512 are bound by K/V bytes) and
//           accumulating its 128 of the 512 output dimensions
// A warp's arithmetic is warp_tile.cuh (mma.sync, MFMA or plain fp32); online softmax in base 2,
// fp32. K/V tiles (swizzled) stream through a cp.async pipeline, one barrier per tile; without
// cp.async (HIP) a tile is loaded, then used. Bytes: the chunk's K and V, q and the output rows.
#pragma once

#include "flashkern/kernels/warp_tile.cuh"

namespace fk {

// Tile shapes depend on the head_dim, the warp width and the platform, never on the matrix unit,
// which may differ between the host and device passes of a HIP build (platform.h). An fp8 cache's
// 64-row tile of head_dim 256 takes 16 tokens a tile, so that its staging fits 99 KB (sm_86/89/120).
// Head dims above kMaxWideHeadDim: 16 rows x 16 tokens, output dims split over kWarpsD warps.
template <int kHeadDim, int kItemRows, int kWarp, bool kFp8 = false>
struct TileShape {
  static constexpr bool kWide = kItemRows == 64;
  static_assert(!kWide || kHeadDim <= kMaxWideHeadDim, "wider heads: 16-row tiles only (attention_work.h)");
  static constexpr int kWarpRows = fk::kWarpRows<kWarp>;
  static constexpr int kOutDims = kHeadDim > kMaxWideHeadDim ? 128 : kHeadDim;  // a warp's output dimensions
  static constexpr int kWarpsD = kHeadDim / kOutDims;                    // warps splitting the output dims
  static_assert(kHeadDim % kOutDims == 0, "whole 128-dimension slices");
  static constexpr int kWarpsM = kItemRows / kWarpRows;                  // warps along the rows
  static constexpr int kWarpsN = kWide || kWarpsD > 1 ? 1 : (kHeadDim == 256 ? 2 : 4);  // warps splitting a KV tile
  static constexpr int kWarpTokens = kWide ? (kHeadDim < 256 ? 64 : kAsyncCopy && !kFp8 ? 32 : 16) : 16;
  static constexpr int kTileN = kWarpsN * kWarpTokens;  // KV tokens a tile
  static constexpr int kThreads = kWarp * kWarpsM * kWarpsN * kWarpsD;
  static constexpr int kStages = kAsyncCopy ? 2 : 1;
  static constexpr int kQElems = kItemRows * kHeadDim;
  static constexpr int kStageElems = 2 * kTileN * kHeadDim;  // K and V
  static constexpr int kSharedBytes = 2 * (kQElems + kStages * kStageElems);
  // an fp8 cache's codes in flight (KVPipeline), after the rest: none without cp.async
  static constexpr int kStagingBytes = kFp8 && kAsyncCopy ? (kStages - 1) * kStageElems : 0;
  static constexpr int kBlockBytes = kSharedBytes + kStagingBytes;  // what a block asks for
  // the opt-in maximum of sm_86/89/120; HIP's 64 KB LDS, of which __syncthreads_or takes 256 bytes
  static_assert(kBlockBytes <= (kAsyncCopy ? 99 * 1024 : 64 * 1024 - 256), "a block's shared memory fits");
  // the epilogue of warps splitting a KV tile: every warp's o in the K/V stages, its m and l where q was
  static_assert(kWarpsN == 1 || kWarpsN * kItemRows * kHeadDim * 4 <= kStages * kStageElems * 2, "merge parts fit");
  static_assert(kWarpsN == 1 || kWarpsN * kItemRows * 2 * 4 <= kQElems * 2, "m and l fit the q tile");
};

template <typename T, int kHeadDim, int kItemRows, int kWarp, bool kFp8>
FK_DEVICE void multi_query_items(const BatchAttentionParams& p) {
  using S = TileShape<kHeadDim, kItemRows, kWarp, kFp8>;
  using Warp = WarpTile<T, kHeadDim, S::kWarpTokens, kWarp, matrix_unit<kWarp>(), S::kOutDims>;
  static_assert(Warp::kRows == S::kWarpRows, "the warp tile has the rows the shape planned for");
  using Pipeline = KVPipeline<T, kHeadDim, S::kTileN, S::kThreads, S::kStages, true, kFp8, kFp8 ? 16 : kVec16Bit>;  // fp8: 16-byte copies
  static_assert(Pipeline::kCodeBytes == S::kStagingBytes, "the staging the shape asks for");
  constexpr AttentionKind kKind = S::kWide ? AttentionKind::tile64 : AttentionKind::tile16;
  constexpr int kChunks = kHeadDim / kVec16Bit, kSlots = Warp::kRowSlots;
  FK_DYNAMIC_SHARED(smem);
  T* q_tile = reinterpret_cast<T*>(smem);
  T* kv = q_tile + S::kQElems;  // stage s: K at s * kStageElems, V kTileN rows further
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int wm = warp % S::kWarpsM, wn = warp / S::kWarpsM % S::kWarpsN, kv_head = blockIdx.y;
  const int wd = S::kWarpsD > 1 ? warp / (S::kWarpsM * S::kWarpsN) : 0;  // which kOutDims (0: a constant dim0)
  const int group = p.qo_heads / p.kv_heads;
  const LogitMap logit(p, kv_head);
  const int count = plan_header(p).count[int(kKind)];
  for (int w = blockIdx.x; w < count; w += gridDim.x) {
    AttentionWorkItem item = load_item(p, kKind, w);
    const int rows = kItemRows < item.n_q * group - item.row_begin ? kItemRows : item.n_q * group - item.row_begin;
    auto index_of = [&](int r) { return (item.row_begin + r) / group; };  // the row's query, in the group
    auto query_of = [&](int r) { return item.q_begin + index_of(r); };
    // causal and window masks: the tile's rows see no token before its first row's first visible one,
    // nor after its last row's last one, so the chunk is trimmed to those (it may become empty)
    const int32_t begin = visible_begin(item, index_of(0)), end = visible_end(item, index_of(rows - 1));
    item.kv_begin = begin;
    item.kv_end = end > begin ? end : begin;
    const bool masked = item.mask >= 0;  // a custom mask: uniform over the item
    auto head_of = [&](int r) { return kv_head * group + (item.row_begin + r) % group; };
    for (int i = threadIdx.x; i < kItemRows * kChunks; i += S::kThreads) {  // q rows, zeros past the last
      const int r = i / kChunks, d = (i % kChunks) * kVec16Bit;
      const T* src = static_cast<const T*>(p.q);
      if (r < rows) src += query_of(r) * p.q_strides[0] + head_of(r) * p.q_strides[1] + d;
      cp_async16(q_tile + swizzled<kHeadDim>(r, d), src, r < rows);
    }

    Pipeline pipe(p, item, kv_head, threadIdx.x, kv, smem + S::kSharedBytes);  // an fp8 cache's codes after the rest
    pipe.start();  // the first commit group carries q too
    const int tiles_n = pipe.tiles();

    Warp tile(lane, wd * S::kOutDims);
    float m[kSlots], l[kSlots];  // l: this lane's share until the end
    int32_t query[kSlots];       // each row slot's query in the group: it sees tokens j with first <= j - query <= last
#pragma unroll
    for (int r = 0; r < kSlots; ++r) {
      m[r] = -INFINITY, l[r] = 0.f;
      query[r] = index_of(wm * S::kWarpRows + tile.slot_row(r));
    }
    for (int it = 0; it < tiles_n; ++it) {
      if constexpr (S::kStages > 1) {
        cp_async_wait<S::kStages - 2>();
        pipe.dequantize(it);  // fp8 codes into the stage, last read by tile it - kStages, before the last barrier
        __syncthreads();  // tile `it` has landed for every thread, and every warp is done with tile it - 1
        if (it + S::kStages - 1 < tiles_n) pipe.copy(it + S::kStages - 1);
        cp_async_commit();
      } else {
        __syncthreads();  // every warp is done with the previous tile
        pipe.copy(it);
        cp_async_wait<0>();
        pipe.dequantize(it);
        __syncthreads();
      }
      const T* k_tile = pipe.k_tile(it) + wn * S::kWarpTokens * kHeadDim;  // this warp's tokens
      const T* v_tile = pipe.v_tile(it) + wn * S::kWarpTokens * kHeadDim;
      tile.scores(q_tile + wm * S::kWarpRows * kHeadDim, k_tile);
      const int token0 = item.kv_begin + it * S::kTileN + wn * S::kWarpTokens;
      float tile_max[kSlots];
#pragma unroll
      for (int r = 0; r < kSlots; ++r) tile_max[r] = -INFINITY;
#pragma unroll
      for (int f = 0; f < Warp::kSF; ++f)
#pragma unroll
        for (int e = 0; e < Warp::kSE; ++e) {
          const int token = token0 + tile.s_token(f, e), i = query[Warp::s_slot(f, e)];
          bool seen = token < item.kv_end && token - i >= item.first && token - i <= item.last;
          if (masked)  // padding rows past the group's queries have no mask row; < 2^31 bits (the planner)
            seen = seen && i < item.n_q && mask_bit(p, item.mask + i * item.length + token);
          const float x = seen ? logit(tile.s[f][e] * logit.scale) : -INFINITY;
          tile.s[f][e] = x;
          if constexpr (!S::kWide) {  // kv_scores' epilogue (16-row tiles: decode and short queries)
            const int r = wm * S::kWarpRows + tile.slot_row(Warp::s_slot(f, e));
            if (p.logits != nullptr && seen && r < rows && wd == 0)  // the kWarpsD warps' scores are the same
              p.logits[(int64_t(query_of(r)) * p.qo_heads + head_of(r)) * p.logits_stride + token] = x;
          }
          tile_max[Warp::s_slot(f, e)] = fmaxf(tile_max[Warp::s_slot(f, e)], x);
        }
      float alpha[kSlots];
#pragma unroll
      for (int r = 0; r < kSlots; ++r) {
        alpha[r] = softmax_rescale(m[r], Warp::row_max(tile_max[r]));
        l[r] *= alpha[r];
      }
#pragma unroll
      for (int f = 0; f < Warp::kSF; ++f)
#pragma unroll
        for (int e = 0; e < Warp::kSE; ++e) {
          tile.s[f][e] = softmax_weight(tile.s[f][e], m[Warp::s_slot(f, e)]);
          l[Warp::s_slot(f, e)] += tile.s[f][e];
        }
#pragma unroll
      for (int f = 0; f < Warp::kOF; ++f)
#pragma unroll
        for (int e = 0; e < Warp::kOE; ++e) tile.o[f][e] *= alpha[Warp::o_slot(f, e)];
      tile.accumulate(v_tile);
    }
#pragma unroll
    for (int r = 0; r < kSlots; ++r) l[r] = Warp::row_sum(l[r]);
    cp_async_wait<0>();
    const bool any_poisoned = __syncthreads_or(pipe.poisoned);  // also: every warp is done with q and the tiles
    {  // fields only the stores need, read again: kept through the loop, they cost the 64-row tile
       // of head_dim 256 a spill on sm_100 and sm_120, where the loop alone fills 255 registers
      const AttentionWorkItem stored = load_item(p, kKind, w);
      item.q_begin = stored.q_begin, item.row_begin = stored.row_begin, item.slot_base = stored.slot_base;
    }
    auto sink_of = [&](int r) { return StateSink(p, query_of(r), head_of(r), item.slot_base + query_of(r)); };
    auto writes = [&](int r) { return r < rows && sees_chunk(item, index_of(r)); };  // else: not its chunk

    if constexpr (S::kWarpsN == 1) {  // each warp writes its rows (and dims) from its registers
#pragma unroll
      for (int slot = 0; slot < kSlots; ++slot) {
        const int r = wm * S::kWarpRows + tile.slot_row(slot);
        if (writes(r)) {
          const StateSink sink = sink_of(r);
          const FinalState fin = sink.finish(any_poisoned ? NAN : state_lse(m[slot], l[slot]));
          // a NaN l stays NaN; a row that saw no key: 0, or NaN where the head's v_scale is NaN
          const float inv = any_poisoned ? NAN : l[slot] == 0.f ? 0.f * sink.v_scale : fin.scale / l[slot];
#pragma unroll
          for (int f = 0; f < Warp::kOF; ++f)
#pragma unroll
            for (int e = 0; e < Warp::kOE; e += 2)
              if (Warp::o_slot(f, e) == slot) sink.store2(tile.o_dim(f, e), tile.o[f][e] * inv, tile.o[f][e + 1] * inv);
          if (tile.o_dim(0, kSlots == 2 ? 2 * slot : 0) == 0)
            sink.store_lse(fin.lse);
        }
      }
    } else {  // the warps saw different tokens of the same rows: merge their states
      float* o_parts = reinterpret_cast<float*>(kv);
      float* m_parts = reinterpret_cast<float*>(q_tile);
      float* l_parts = m_parts + S::kWarpsN * kItemRows;
      const int part_row = wn * kItemRows + wm * S::kWarpRows;  // part wn, this warp's first row
#pragma unroll
      for (int f = 0; f < Warp::kOF; ++f)
#pragma unroll
        for (int e = 0; e < Warp::kOE; ++e)
          o_parts[(part_row + tile.slot_row(Warp::o_slot(f, e))) * kHeadDim + tile.o_dim(f, e)] = tile.o[f][e];
#pragma unroll
      for (int slot = 0; slot < kSlots; ++slot) {
        if (tile.o_dim(0, kSlots == 2 ? 2 * slot : 0) == 0) {
          m_parts[part_row + tile.slot_row(slot)] = m[slot];
          l_parts[part_row + tile.slot_row(slot)] = l[slot];
        }
      }
      __syncthreads();
      merge_parts_and_store<kHeadDim>(o_parts, m_parts, l_parts, S::kWarpsN, kItemRows, rows, any_poisoned, sink_of,
                                      writes);
      __syncthreads();  // the next item's copies overwrite the parts
    }
  }
}

// Blocks per SM: 2 for 64-row tiles (their registers and shared memory allow no more), 3 for the
// 16-row tiles of decode with large GQA groups, which have less arithmetic to hide loads behind; 2
// for head_dim 512's 16-row tiles, whose 80-96 KB of shared memory fit no more on sm_80/sm_90.
template <int kHeadDim, int kItemRows>
inline constexpr int kTileBlocksPerSM = kItemRows == 64 || kHeadDim > kMaxWideHeadDim ? 2 : 3;

// kFp8: an fp8 cache (its own instantiation: the 16-bit kernel keeps its registers)
template <typename T, int kHeadDim, int kItemRows, int kWarp, bool kFp8>
__global__ void FK_LAUNCH_BOUNDS((TileShape<kHeadDim, kItemRows, kWarp, kFp8>::kThreads),
                                 (kTileBlocksPerSM<kHeadDim, kItemRows>))
    multi_query_attention_kernel(BatchAttentionParams p) {
  pdl_wait();  // before any global memory access (platform.h: PDL)
  if (FK_WARP_SIZE_MISMATCH(kWarp)) {
    trap();
  } else {
    multi_query_items<T, kHeadDim, kItemRows, kWarp, kFp8>(p);
  }
  pdl_launch_dependents();  // this block has read and written what it will
}

}  // namespace fk
