// How row-wise kernels see their tensors and how they are cut into blocks. Host-device code with
// no warp in it: the same functions plan launches on the host and index rows in kernels, and
// tests/test_host_code.py checks them on the CPU.
#pragma once

#include <cstdint>

#include "flashkern/platform.h"

namespace fk {

// A tensor of rows: row r starts at (r / inner) * stride_outer + (r % inner) * stride_inner
// elements from the base pointer, and its columns are contiguous. Two levels cover a 2-D
// [rows, cols] tensor (inner = 1) and views such as per-head q/k in a fused qkv buffer
// ([tokens, heads, head_dim] with a token stride wider than heads * head_dim).
struct RowLayout {
  int64_t stride_outer = 0;
  int64_t stride_inner = 0;
  int64_t inner = 1;

  FK_HOST_DEVICE int64_t offset(int64_t row) const {
    if (inner == 1) return row * stride_outer;
    return (row / inner) * stride_outer + (row % inner) * stride_inner;
  }
  // Every row starts on a multiple of `vec` elements.
  FK_HOST_DEVICE bool strides_multiple_of(int64_t vec) const {
    return stride_outer % vec == 0 && (inner == 1 || stride_inner % vec == 0);
  }
};

// The rows of a tensor whose last dimension is contiguous: its leading dimensions (sizes and
// strides, outermost first) collapsed into a RowLayout. Dimensions of size 1 are dropped and a
// dimension merges into the one before it when that one steps over it exactly. False when more
// than two levels remain (the caller then works on a contiguous copy).
FK_HOST_DEVICE bool collapse_rows(const int64_t* sizes, const int64_t* strides, int leading_dims, RowLayout* out) {
  int64_t size[2] = {1, 1}, stride[2] = {0, 0};
  int levels = 0;
  for (int d = 0; d < leading_dims; ++d) {
    if (sizes[d] == 1) continue;
    if (levels > 0 && stride[levels - 1] == strides[d] * sizes[d]) {
      size[levels - 1] *= sizes[d];
      stride[levels - 1] = strides[d];
    } else {
      if (levels == 2) return false;
      size[levels] = sizes[d];
      stride[levels] = strides[d];
      ++levels;
    }
  }
  if (levels < 2) {
    *out = RowLayout{stride[0], 0, 1};
  } else {
    *out = RowLayout{stride[0], stride[1], size[1]};
  }
  return true;
}

FK_HOST_DEVICE int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

FK_HOST_DEVICE int64_t next_pow2(int64_t x) {
  int64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

// Blocks are never narrower than the widest wavefront (64), so a full-warp shuffle never names a
// lane that does not exist; grids stop at kMaxBlocks (HIP needs blocks * threads < 2^32) and the
// kernels loop over the rows beyond.
inline constexpr int kMinBlockThreads = 64;
inline constexpr int64_t kMaxBlocks = int64_t(1) << 20;

struct RowPlanLimits {
  int max_block_threads;       // threads per block, at most
  int max_vecs_per_thread;     // vectors a thread keeps in registers, at most
  int target_vecs_per_thread;  // aim: enough independent 16-byte loads in flight per thread
  int target_block_threads;    // aim for short rows: pack rows until a block has this many threads
};

// One row is handled by a group of `threads_per_row` consecutive threads (a power of two: part
// of a warp, a warp, or several warps); a block holds `rows_per_block` such groups.
struct RowPlan {
  int threads_per_row;
  int rows_per_block;
  int vecs_per_thread;  // ceil(row vectors / threads_per_row)
  bool in_registers;    // the row fits in registers: read once; otherwise it is streamed twice
  int block_threads;
  int64_t blocks;
};

FK_HOST_DEVICE RowPlan plan_rows(int64_t rows, int64_t cols, int vec, RowPlanLimits lim) {
  RowPlan p{};
  const int64_t row_vecs = ceil_div(cols, vec);
  int64_t tpr = next_pow2(ceil_div(row_vecs, lim.target_vecs_per_thread));
  if (tpr > lim.max_block_threads) tpr = lim.max_block_threads;
  const int64_t vpt = ceil_div(row_vecs, tpr);
  p.threads_per_row = int(tpr);
  p.vecs_per_thread = vpt < 0x7fffffff ? int(vpt) : 0x7fffffff;
  p.in_registers = vpt <= lim.max_vecs_per_thread;
  int64_t rpb = tpr >= lim.target_block_threads ? 1 : lim.target_block_threads / tpr;
  if (rows < rpb) rpb = next_pow2(rows < 1 ? 1 : rows);  // few rows: no empty row groups...
  if (tpr * rpb < kMinBlockThreads) rpb = kMinBlockThreads / tpr;  // ...but at least a wavefront
  p.rows_per_block = int(rpb);
  p.block_threads = int(tpr * rpb);
  const int64_t blocks = ceil_div(rows, rpb);
  p.blocks = blocks < kMaxBlocks ? blocks : kMaxBlocks;
  return p;
}

}  // namespace fk
