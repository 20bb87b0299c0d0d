// Decode attention on CUDA cores: one query, a GQA group of kGroup <= kDecodeMaxGroup heads.
//   out[h] = softmax(q[h] . K^T * sm_scale) V for the group's heads h, over one chunk of the KV.
// Threads: 128 a block, blockIdx.y the KV head. A sub-warp of kLanes = head_dim / 8 lanes owns one
// token at a time; each lane owns 8 of its dimensions (one 16-byte vector of K and one of V) and
// keeps q and the output accumulators of every head of the group for those 8 dimensions in
// registers, so each K/V vector is read once for the whole group. Dot products: per-lane partial
// sums, then a butterfly over the sub-warp. Online softmax in base 2 with pre-scaled q, fp32.
// K/V tiles stream through a cp.async pipeline of kStages; each thread reads back only the
// vectors it copied, so the pipeline needs no barrier. The sub-warps' states are merged in shared
// memory at the end. Bytes: the chunk's K and V (2 * tokens * head_dim * 2, or * 1 from an fp8 cache),
// q and the output.
#pragma once

#include "flashkern/kernels/attention_tiles.cuh"

namespace fk {

template <int kHeadDim>
struct DecodeShape {
  static constexpr int kThreads = 128;
  static constexpr int kLanes = kHeadDim / kVec16Bit;          // 8, 16, 32 lanes a token
  static constexpr int kSubwarps = kThreads / kLanes;           // 16, 8, 4 tokens at a time
  static constexpr int kTokensPerSubwarp = 4;                  // per tile: independent loads in flight
  static constexpr int kTile = kSubwarps * kTokensPerSubwarp;  // 64, 32, 16 tokens
  static constexpr int kStages = kAsyncCopy ? 3 : 1;
  static constexpr int kTileBytes = kStages * 2 * kTile * kHeadDim * 2;  // K and V, 16-bit
  static FK_HOST_DEVICE constexpr int shared_bytes(int group, bool fp8) {
    const int tiles = fp8 ? kTileBytes / 2 : kTileBytes;  // an fp8 cache's tiles are its codes
    const int merge = kSubwarps * group * (kHeadDim + 2) * 4;  // o, m, l of every sub-warp
    return tiles > merge ? tiles : merge;
  }
};

template <typename T, int kHeadDim, int kGroup, bool kFp8>
FK_DEVICE void decode_items(const BatchAttentionParams& p) {
  using S = DecodeShape<kHeadDim>;
  using Pipeline = KVPipeline<T, kHeadDim, S::kTile, S::kThreads, S::kStages, false, kFp8>;
  FK_DYNAMIC_SHARED(smem);
  const int lane = threadIdx.x % S::kLanes, sub = threadIdx.x / S::kLanes, kv_head = blockIdx.y;
  const LogitMap logit(p, kv_head);
  const int count = plan_header(p).count[int(AttentionKind::decode)];
  for (int w = blockIdx.x; w < count; w += gridDim.x) {
    AttentionWorkItem item = load_item(p, AttentionKind::decode, w);
    // one query: the chunk it sees (causally its group's last token sees it whole; a window may start later)
    const int32_t begin = visible_begin(item, 0), end = visible_end(item, 0);
    item.kv_begin = begin;
    item.kv_end = end > begin ? end : begin;
    const int t = item.q_begin;
    float q[kGroup][kVec16Bit], o[kGroup][kVec16Bit], m[kGroup], l[kGroup];
#pragma unroll
    for (int h = 0; h < kGroup; ++h) {
      Vec<T, kVec16Bit> x;
      x.load(static_cast<const T*>(p.q) + t * p.q_strides[0] + (kv_head * kGroup + h) * p.q_strides[1] +
             lane * kVec16Bit);
#pragma unroll
      for (int e = 0; e < kVec16Bit; ++e) q[h][e] = x.f(e) * logit.scale, o[h][e] = 0.f;
      m[h] = -INFINITY, l[h] = 0.f;
    }

    Pipeline kv(p, item, kv_head, threadIdx.x, reinterpret_cast<T*>(smem), smem);  // an fp8 cache's codes: the tiles
    kv.start();
    const int tiles_n = kv.tiles();
    for (int it = 0; it < tiles_n; ++it) {
      if (it + S::kStages - 1 < tiles_n) kv.copy(it + S::kStages - 1);
      cp_async_commit();
      cp_async_wait<S::kStages - 1>();  // this thread's copies of tile `it` have landed
      // a lane's chunk of row r of K or V: this thread copied it (an fp8 cache's codes decode in registers)
      auto k_chunk = [&](int r) {
        if constexpr (kFp8) {
          return kv.chunk_of(kv.k_codes(it), r, lane);
        } else {
          Vec<T, kVec16Bit> x;
          x.load(kv.k_tile(it) + r * kHeadDim + lane * kVec16Bit);
          return x;
        }
      };
      auto v_chunk = [&](int r) {
        if constexpr (kFp8) {
          return kv.chunk_of(kv.v_codes(it), r, lane);
        } else {
          Vec<T, kVec16Bit> x;
          x.load(kv.v_tile(it) + r * kHeadDim + lane * kVec16Bit);
          return x;
        }
      };
      float x[S::kTokensPerSubwarp][kGroup];
#pragma unroll
      for (int j = 0; j < S::kTokensPerSubwarp; ++j) {
        const auto k = k_chunk(sub + j * S::kSubwarps);
#pragma unroll
        for (int h = 0; h < kGroup; ++h) {
          float dot = 0.f;
#pragma unroll
          for (int e = 0; e < kVec16Bit; ++e) dot += q[h][e] * k.f(e);
          x[j][h] = dot;
        }
      }
#pragma unroll
      for (int offset = S::kLanes / 2; offset >= 1; offset >>= 1) {
#pragma unroll
        for (int j = 0; j < S::kTokensPerSubwarp; ++j)
#pragma unroll
          for (int h = 0; h < kGroup; ++h) x[j][h] += shfl_xor(x[j][h], offset);
      }  // every lane of the sub-warp now holds the whole logit of each of its tokens, for every head
      if (logit.cap > 0.f) {  // a soft cap: uniform, so one loop or the other
#pragma unroll
        for (int j = 0; j < S::kTokensPerSubwarp; ++j)
#pragma unroll
          for (int h = 0; h < kGroup; ++h) x[j][h] = logit(x[j][h]);
      }
      const int pos0 = item.kv_begin + it * S::kTile + sub;
      if (p.logits != nullptr && lane < kGroup) {  // kv_scores' epilogue: lane h writes head h's logits
        float* row = p.logits + (int64_t(t) * p.qo_heads + kv_head * kGroup + lane) * p.logits_stride;
#pragma unroll
        for (int j = 0; j < S::kTokensPerSubwarp; ++j)
#pragma unroll
          for (int h = 0; h < kGroup; ++h)
            if (h == lane && pos0 + j * S::kSubwarps < item.kv_end) row[pos0 + j * S::kSubwarps] = x[j][h];
      }
#pragma unroll
      for (int h = 0; h < kGroup; ++h) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < S::kTokensPerSubwarp; ++j) {
          if (pos0 + j * S::kSubwarps >= item.kv_end) x[j][h] = -INFINITY;  // past the chunk
          tile_max = fmaxf(tile_max, x[j][h]);
        }
        const float alpha = softmax_rescale(m[h], tile_max);
        l[h] *= alpha;
#pragma unroll
        for (int e = 0; e < kVec16Bit; ++e) o[h][e] *= alpha;
#pragma unroll
        for (int j = 0; j < S::kTokensPerSubwarp; ++j) {
          x[j][h] = softmax_weight(x[j][h], m[h]);
          l[h] += x[j][h];
        }
      }
#pragma unroll
      for (int j = 0; j < S::kTokensPerSubwarp; ++j) {
        const auto vv = v_chunk(sub + j * S::kSubwarps);
#pragma unroll
        for (int h = 0; h < kGroup; ++h)
#pragma unroll
          for (int e = 0; e < kVec16Bit; ++e) o[h][e] += x[j][h] * vv.f(e);
      }
    }

    // Merge the sub-warps: part = sub-warp, row = head of the group.
    cp_async_wait<0>();
    const bool any_poisoned = __syncthreads_or(kv.poisoned);  // also: every thread is done with the tiles
    float* o_parts = reinterpret_cast<float*>(smem);
    float* m_parts = o_parts + S::kSubwarps * kGroup * kHeadDim;
    float* l_parts = m_parts + S::kSubwarps * kGroup;
#pragma unroll
    for (int h = 0; h < kGroup; ++h) {
#pragma unroll
      for (int e = 0; e < kVec16Bit; ++e) o_parts[(sub * kGroup + h) * kHeadDim + lane * kVec16Bit + e] = o[h][e];
      if (lane == 0) m_parts[sub * kGroup + h] = m[h], l_parts[sub * kGroup + h] = l[h];
    }
    __syncthreads();
    merge_parts_and_store<kHeadDim>(o_parts, m_parts, l_parts, S::kSubwarps, kGroup, kGroup, any_poisoned,
                                       [&](int h) { return StateSink(p, t, kv_head * kGroup + h, item.slot_base + t); },
                                       [](int) { return true; });  // the planner gives the query only chunks it sees
    __syncthreads();  // the next item's copies overwrite the parts
  }
}

// kFp8: an fp8 cache (its own instantiation: the 16-bit kernel keeps its registers)
template <typename T, int kHeadDim, int kGroup, bool kFp8>
__global__ void FK_LAUNCH_BOUNDS(128, kFp8 && kGroup == 4 ? 3 : 4) decode_attention_kernel(BatchAttentionParams p) {
  // 4 blocks/SM; 3 for an fp8 cache's group of 4, which spills at 128 registers (its codes' decode)
  pdl_wait();  // before any global memory access (platform.h: PDL)
  decode_items<T, kHeadDim, kGroup, kFp8>(p);
  pdl_launch_dependents();  // this block has read and written what it will
}

}  // namespace fk
