// One warp's share of the multi-query attention kernel, on the matrix unit of the compilation
// pass (platform.h: matrix_unit): kRows query rows against kTokens tokens of K/V tiles held in
// shared memory as swizzled [rows, kHeadDim] 16-bit tiles (attention_tiles.cuh: tile_offset).
//   scores(q, k)    s = Q K^T                (fp32 accumulators, over all of kHeadDim)
//   accumulate(v)   o += P V, where P is s after the softmax weights were written into it, for
//                   the kOutDims output dimensions from dim0 (all of them, unless the kernel
//                   splits a wide head over warps: their o would not fit one warp's registers)
// A lane holds elements s[f][e] and o[f][e]; s_slot / s_token and o_slot / o_dim say which row
// slot and token / dimension each one is, slot_row(r) which of the 16 rows row slot r is, and
// row_max / row_sum reduce over the lanes that hold the same rows. Consecutive elements e, e + 1
// (e even) of o are consecutive dimensions, so results are stored two at a time.
//   mma_sync  (CUDA sm_80+)  m16n8k16: a lane holds rows g and g + 8 (g = lane / 4); Q and K
//                            fragments come from ldmatrix, V's from ldmatrix.trans
//   mfma      (gfx90a/94x)   16x16x16 on wave64, transposed (S^T = K Q^T, O^T = V^T P^T) so that
//                            the score accumulators are directly P^T's operand: a lane holds row
//                            lane % 16, tokens and dimensions 4 (lane / 16) .. + 3 of each 16
//   simt     (elsewhere)     the same row-per-lane layout with plain fp32 arithmetic; 8 rows a warp
//                            on wave32 (kWarpRows)
#pragma once

#include "flashkern/kernels/attention_tiles.cuh"

namespace fk {

template <typename T, int kHeadDim, int kTokens, int kWarp, MatrixUnit kUnit, int kOutDims = kHeadDim>
struct WarpTile;

template <typename T>
FK_DEVICE uint32_t pack2(float a, float b) {  // element 0 in the low half, as the matrix units read it
  Vec<T, 2> x;
  x.set(0, a);
  x.set(1, b);
  return x.w[0];
}

template <int F, int E>
FK_DEVICE void zero(float (&a)[F][E]) {
#pragma unroll
  for (int f = 0; f < F; ++f)
#pragma unroll
    for (int e = 0; e < E; ++e) a[f][e] = 0.f;
}

template <int kHeadDim>
FK_DEVICE int swizzled(int row, int d) {
  return tile_offset<kHeadDim, true>(row, d);
}

// ---------------------------------------------------------------- CUDA: mma.sync + ldmatrix

template <typename T, int kHeadDim, int kTokens, int kWarp, int kOutDims>
struct WarpTile<T, kHeadDim, kTokens, kWarp, MatrixUnit::mma_sync, kOutDims> {
  static_assert(kWarp == 32 && kTokens % 16 == 0 && kHeadDim % 16 == 0 && kOutDims % 16 == 0, "m16n8k16 tiles");
  static constexpr int kRows = 16;
  static constexpr int kRowSlots = 2;
  static constexpr int kSF = kTokens / 8, kSE = 4;    // an n-tile of 8 tokens
  static constexpr int kOF = kOutDims / 8, kOE = 4;   // an n-tile of 8 dimensions
  float s[kSF][kSE];
  float o[kOF][kOE];
  int lane;
  int dim0;  // the first of this warp's kOutDims output dimensions

  FK_DEVICE explicit WarpTile(int lane_, int dim0_ = 0) : lane(lane_), dim0(dim0_) { zero(o); }
  FK_DEVICE int slot_row(int slot) const { return lane / 4 + 8 * slot; }
  static FK_HOST_DEVICE constexpr int s_slot(int, int e) { return e / 2; }
  FK_DEVICE int s_token(int f, int e) const { return 8 * f + 2 * (lane % 4) + e % 2; }
  static FK_HOST_DEVICE constexpr int o_slot(int, int e) { return e / 2; }
  FK_DEVICE int o_dim(int f, int e) const { return dim0 + 8 * f + 2 * (lane % 4) + e % 2; }
  static FK_DEVICE float row_max(float v) {
    v = fmaxf(v, shfl_xor(v, 1));
    return fmaxf(v, shfl_xor(v, 2));  // the 4 lanes of a row group
  }
  static FK_DEVICE float row_sum(float v) {
    v += shfl_xor(v, 1);
    return v + shfl_xor(v, 2);
  }

  FK_DEVICE void scores(const T* q, const T* k) {
    zero(s);
    const int r8 = lane % 8, m = lane / 8;  // lane gives row r8 of 8x8 matrix m
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      uint32_t a[4];  // matrices: rows 0-7 / 8-15 (m % 2) x dims 0-7 / 8-15 (m / 2)
      ldmatrix_x4(a, q + swizzled<kHeadDim>(r8 + 8 * (m % 2), 16 * kk + 8 * (m / 2)));
#pragma unroll
      for (int np = 0; np < kTokens / 16; ++np) {
        uint32_t b[4];  // matrices: tokens 0-7 / 8-15 (m / 2) x dims 0-7 / 8-15 (m % 2)
        ldmatrix_x4(b, k + swizzled<kHeadDim>(16 * np + 8 * (m / 2) + r8, 16 * kk + 8 * (m % 2)));
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_m16n8k16<T>(s[2 * np], a, b0);
        mma_m16n8k16<T>(s[2 * np + 1], a, b1);
      }
    }
  }

  FK_DEVICE void accumulate(const T* v) {
    const int r8 = lane % 8, m = lane / 8;
#pragma unroll
    for (int kb = 0; kb < kTokens / 16; ++kb) {
      // the score accumulators of n-tiles 2kb and 2kb + 1 are the A fragment of tokens 16kb..16kb+15
      const uint32_t a[4] = {pack2<T>(s[2 * kb][0], s[2 * kb][1]), pack2<T>(s[2 * kb][2], s[2 * kb][3]),
                             pack2<T>(s[2 * kb + 1][0], s[2 * kb + 1][1]),
                             pack2<T>(s[2 * kb + 1][2], s[2 * kb + 1][3])};
#pragma unroll
      for (int dp = 0; dp < kOutDims / 16; ++dp) {
        uint32_t b[4];  // transposed matrices: tokens 0-7 / 8-15 (m % 2) x dims 0-7 / 8-15 (m / 2)
        ldmatrix_x4_trans(b, v + swizzled<kHeadDim>(16 * kb + 8 * (m % 2) + r8, dim0 + 16 * dp + 8 * (m / 2)));
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_m16n8k16<T>(o[2 * dp], a, b0);
        mma_m16n8k16<T>(o[2 * dp + 1], a, b1);
      }
    }
  }
};

// ---------------------------------------------------------------- rows per lane: MFMA and SIMT

// Warp rows of the multi-query kernel: 16, except 8 on a HIP wave32 warp (RDNA, plain arithmetic),
// where 16 rows over 32 lanes would leave every lane a quarter of a 256-wide output row. It
// depends on the build and the warp width only, so host and device passes agree.
template <int kWarp>
inline constexpr int kWarpRows = kHipBuild && kWarp == 32 ? 8 : 16;

// Lane l holds row l % kRows and, of every 16 tokens or dimensions, its lane group's share.
template <int kWarp, int kRows>
struct RowPerLane {
  static constexpr int kRowSlots = 1;
  static FK_DEVICE float row_max(float v) {
#pragma unroll
    for (int x = kRows; x < kWarp; x <<= 1) v = fmaxf(v, shfl_xor(v, x));
    return v;
  }
  static FK_DEVICE float row_sum(float v) {
#pragma unroll
    for (int x = kRows; x < kWarp; x <<= 1) v += shfl_xor(v, x);
    return v;
  }
};

template <typename T, int kHeadDim, int kTokens, int kWarp, int kOutDims>
struct WarpTile<T, kHeadDim, kTokens, kWarp, MatrixUnit::mfma, kOutDims> : RowPerLane<kWarp, 16> {
  static_assert(kWarp == 64 && kTokens % 16 == 0 && kHeadDim % 16 == 0 && kOutDims % 16 == 0, "16x16x16 tiles on wave64");
  static constexpr int kRows = 16;
  static constexpr int kSF = kTokens / 16, kSE = 4;
  static constexpr int kOF = kOutDims / 16, kOE = 4;
  float s[kSF][kSE];
  float o[kOF][kOE];
  int lane;
  int dim0;  // the first of this warp's kOutDims output dimensions

  FK_DEVICE explicit WarpTile(int lane_, int dim0_ = 0) : lane(lane_), dim0(dim0_) { zero(o); }
  FK_DEVICE int slot_row(int) const { return lane % 16; }
  static FK_HOST_DEVICE constexpr int s_slot(int, int) { return 0; }
  FK_DEVICE int s_token(int f, int e) const { return 16 * f + 4 * (lane / 16) + e; }
  static FK_HOST_DEVICE constexpr int o_slot(int, int) { return 0; }
  FK_DEVICE int o_dim(int f, int e) const { return dim0 + 16 * f + 4 * (lane / 16) + e; }

  FK_DEVICE void scores(const T* q, const T* k) {
    zero(s);
    const int c = lane % 16, d4 = 4 * (lane / 16);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint2 qt = *reinterpret_cast<const uint2*>(q + swizzled<kHeadDim>(c, 16 * kk + d4));  // B = Q^T
      const uint32_t b[2] = {qt.x, qt.y};
#pragma unroll
      for (int f = 0; f < kSF; ++f) {
        const uint2 kt = *reinterpret_cast<const uint2*>(k + swizzled<kHeadDim>(16 * f + c, 16 * kk + d4));  // A = K
        const uint32_t a[2] = {kt.x, kt.y};
        mfma_16x16x16<T>(s[f], a, b);  // S^T(token 4q + e, row c)
      }
    }
  }

  FK_DEVICE void accumulate(const T* v) {
    const int c = lane % 16, t4 = 4 * (lane / 16);
#pragma unroll
    for (int f = 0; f < kSF; ++f) {
      const uint32_t b[2] = {pack2<T>(s[f][0], s[f][1]), pack2<T>(s[f][2], s[f][3])};  // P^T(token t4 + e, row c)
#pragma unroll
      for (int nd = 0; nd < kOF; ++nd) {  // A = V^T(dim 16nd + c, token 16f + t4 + e)
        uint32_t a[2];
#pragma unroll
        for (int w = 0; w < 2; ++w) {
          const uint32_t lo = element_bits(v[swizzled<kHeadDim>(16 * f + t4 + 2 * w, dim0 + 16 * nd + c)]);
          const uint32_t hi = element_bits(v[swizzled<kHeadDim>(16 * f + t4 + 2 * w + 1, dim0 + 16 * nd + c)]);
          a[w] = lo | hi << 16;
        }
        mfma_16x16x16<T>(o[nd], a, b);  // O^T(dim 16nd + t4 + e, row c)
      }
    }
  }
};

template <typename T, int kHeadDim, int kTokens, int kWarp, int kOutDims>
struct WarpTile<T, kHeadDim, kTokens, kWarp, MatrixUnit::simt, kOutDims> : RowPerLane<kWarp, kWarpRows<kWarp>> {
  static constexpr int kRows = kWarpRows<kWarp>;
  static constexpr int kG = kWarp / kRows;  // lanes a row
  static_assert(kTokens % 16 == 0 && 16 % kG == 0 && kOutDims % (8 * kG) == 0, "whole 16-byte vectors per lane");
  static constexpr int kSF = kTokens / 16, kSE = 16 / kG;   // tokens 16f + kG e + (lane / kRows)
  static constexpr int kOF = kOutDims / (8 * kG), kOE = 8;  // dims dim0 + (lane / kRows) * kOutDims / kG + 8f + e
  float s[kSF][kSE];
  float o[kOF][kOE];
  int lane;
  int dim0;  // the first of this warp's kOutDims output dimensions

  FK_DEVICE explicit WarpTile(int lane_, int dim0_ = 0) : lane(lane_), dim0(dim0_) { zero(o); }
  FK_DEVICE int slot_row(int) const { return lane % kRows; }
  static FK_HOST_DEVICE constexpr int s_slot(int, int) { return 0; }
  FK_DEVICE int s_token(int f, int e) const { return 16 * f + kG * e + lane / kRows; }
  static FK_HOST_DEVICE constexpr int o_slot(int, int) { return 0; }
  FK_DEVICE int o_dim(int f, int e) const { return dim0 + (lane / kRows) * (kOutDims / kG) + 8 * f + e; }

  // One 16-byte column of q and of every token's k at a time: few loads in flight, no spills.
  FK_DEVICE void scores(const T* q, const T* k) {
    zero(s);
#pragma unroll 1
    for (int d = 0; d < kHeadDim; d += kVec16Bit) {
      Vec<T, kVec16Bit> x;
      x.load(q + swizzled<kHeadDim>(lane % kRows, d));
#pragma unroll
      for (int f = 0; f < kSF; ++f)
#pragma unroll
        for (int e = 0; e < kSE; ++e) {
          Vec<T, kVec16Bit> y;
          y.load(k + swizzled<kHeadDim>(s_token(f, e), d));
#pragma unroll
          for (int j = 0; j < kVec16Bit; ++j) s[f][e] += x.f(j) * y.f(j);
        }
    }
  }

  // Token by token: its weight comes from the lane group that holds it (lane row + kRows * (j % kG)).
  FK_DEVICE void accumulate(const T* v) {
#pragma unroll
    for (int f = 0; f < kSF; ++f) {
#pragma unroll 1
      for (int j = 0; j < 16; ++j) {
        float mine = s[f][0];  // s[f][j / kG], with constant indices
#pragma unroll
        for (int e = 1; e < kSE; ++e) mine = j / kG == e ? s[f][e] : mine;
        const float w = shfl(mine, lane % kRows + kRows * (j % kG));
#pragma unroll
        for (int g = 0; g < kOF; ++g) {
          Vec<T, kVec16Bit> y;
          y.load(v + swizzled<kHeadDim>(16 * f + j, o_dim(g, 0)));
#pragma unroll
          for (int e = 0; e < kOE; ++e) o[g][e] += w * y.f(e);
        }
      }
    }
  }
};

}  // namespace fk
