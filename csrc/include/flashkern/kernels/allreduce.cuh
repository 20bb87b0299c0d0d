// The all-reduce that ends a tensor-parallel layer, fused with the residual add and the RMSNorm
// after it (ops.h: AllReduceParams, CommLayout). Every rank of the group runs this kernel at the
// same time on its own GPU, over symmetric memory: each rank's workspace is mapped into every peer.
//
// Protocol. Block b of each rank meets block b of every other rank at barriers (comm_barrier): a
// release store of the block's barrier count into flags[b][rank] of each peer, then an acquire
// poll of its own flags[b][peer] until each peer has reached that count. Counts only grow, the grid
// is the same fixed size in every call on every rank, so block b's count is the same everywhere;
// a peer is at most one barrier ahead (it waits for this block), so the poll is for >=. Nothing is
// ever cleared, and no host work is needed between calls: a CUDA graph can replay them.
//   one-shot  stage this rank's rows of block b in its workspace, barrier, then every rank reads
//             those rows from every peer, sums them in rank order (the same bits on every rank),
//             adds the residual and normalizes. Bytes a rank reads: world x message.
//   two-shot  the rows are split into `world` shares; block b stages its rows of every share,
//             barrier, each rank reduces its own share (add + norm included) into its results
//             region, barrier, then copies the other shares' results from their owners.
// Reuse. Calls alternate between two regions (the call count's parity). A rank writes region q in
// call k + 2 only after every block of its call k + 1 passed a barrier, i.e. after every peer
// started call k + 1, which a peer does only once its call k (the last reader of region q) ended:
// each kernel waits for the previous one in its stream (pdl_wait) before touching the workspace.
// PDL: pdl_launch_dependents only after the last store (emulate.h refuses a signal after it).
#pragma once

#include <cstdio>

#include "flashkern/dispatch.h"
#include "flashkern/ops.h"
#include "flashkern/reduce.h"
#include "flashkern/vec.h"

namespace fk {

// Rank r's workspace + offset. A select over the ranks rather than p.peers[r]: an index that is not a
// constant would make hipcc copy the kernel's parameters to scratch memory.
FK_DEVICE uint8_t* comm_at(const AllReduceParams& p, int r, int64_t offset) {
  void* base = p.peers[0];
#pragma unroll
  for (int i = 1; i < kCommMaxRanks; ++i) base = r == i ? p.peers[i] : base;
  return static_cast<uint8_t*>(base) + offset;
}

// A peer that never arrives would hold this block, and the GPU, forever: say who waited for whom and
// trap, as NCCL's watchdog ends a collective that hangs. (HIP: a trap alone; its printf needs scratch.)
FK_DEVICE void comm_give_up(const AllReduceParams& p, int peer, uint32_t count) {
#if defined(FK_EMU)
  std::fprintf(stderr, "flashkern allreduce_fusion: rank %d block %d gave up waiting for rank %d (barrier %u)\n",
               p.rank, int(blockIdx.x), peer, count);
#elif defined(FK_CUDA)
  printf("flashkern allreduce_fusion: rank %d block %d gave up waiting for rank %d (barrier %u)\n", p.rank,
         int(blockIdx.x), peer, count);
#endif
  trap();
}

// Block b of every rank meets here; `count` is this block's new barrier count. Every signal goes out
// before any thread waits (the middle barrier): a GPU runs the threads at once, but the emulator runs
// one at a time, and a thread spinning on one peer must not hold back this block's signal to another.
FK_DEVICE void comm_barrier(const AllReduceParams& p, uint32_t count) {
  fence_system();
  __syncthreads();  // the block's stores before the signal: the release carries them to the peers
  const int peer = int(threadIdx.x);
  const bool waits = peer < p.world && peer != p.rank;
  if (waits) {
    auto* theirs = reinterpret_cast<uint32_t*>(comm_at(p, peer, CommLayout::flag(int(blockIdx.x), p.rank)));
    signal_release_system(theirs, count);
  }
  __syncthreads();
  if (waits) {
    const auto* mine = reinterpret_cast<const uint32_t*>(comm_at(p, p.rank, CommLayout::flag(int(blockIdx.x), peer)));
    const uint64_t start = clock_ns();
    for (uint32_t n = 0; int32_t(poll_acquire_system(mine) - count) < 0; ++n) {
      spin_pause(n);
      if (p.timeout_ns > 0 && n % 1024 == 1023 && clock_ns() - start > uint64_t(p.timeout_ns))
        comm_give_up(p, peer, count);
    }
  }
  __syncthreads();  // the acquires before any thread of the block reads a peer's buffer
}

// One row of `vecs` 16-byte vectors, by the whole block.
template <typename T>
FK_DEVICE void comm_copy_row(T* dst, const T* src, int64_t vecs) {
  for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
    Vec<T, 8> x;
    x.load(src + v * 8);
    x.store(dst + v * 8);
  }
}

template <int kWarp, typename T, typename W, bool kNorm>
__global__ void __launch_bounds__(kCommThreads, 1) allreduce_kernel(AllReduceParams p) {
  constexpr int kMaxVecs = kCommMaxVecsPerThread;
  FK_STATIC_SHARED(uint32_t, counts, [2]);
  FK_STATIC_SHARED(float, scratch, [RowGroup<kWarp>::kMaxWarps]);
  pdl_wait();  // the previous call on this stream has ended: its workspace reads included
  if (FK_WARP_SIZE_MISMATCH(kWarp)) {
    trap();
    return;
  }
  uint32_t* state = reinterpret_cast<uint32_t*>(comm_at(p, p.rank, CommLayout::state(int(blockIdx.x))));
  if (threadIdx.x == 0) counts[0] = state[0], counts[1] = state[1];
  __syncthreads();
  const uint32_t barriers = counts[0], calls = counts[1];
  const CommLayout layout{p.message_bytes};
  const int parity = int(calls & 1u);
  const int64_t vecs = p.cols / 8, row_elems = p.cols, blocks = gridDim.x;
  // two-shot: rank s owns rows [s * share, (s + 1) * share); one-shot: one share, every rank's
  const int shares = p.two_shot ? p.world : 1;
  const int64_t share = (p.rows + shares - 1) / shares;
  // the results region's rows: [residual_out | norm_out], or the sum
  const int64_t result_elems = kNorm ? 2 * row_elems : row_elems;
  auto stage = [&](int rank) { return reinterpret_cast<T*>(comm_at(p, rank, layout.stage(parity))); };
  auto results = [&](int rank) { return reinterpret_cast<T*>(comm_at(p, rank, layout.results(parity))); };

  // 1. this rank's addend, rows j = b, b + blocks, .. of every share, into its stage
  const T* input = static_cast<const T*>(p.input);
  for (int s = 0; s < shares; ++s)
    for (int64_t j = blockIdx.x; j < share && s * share + j < p.rows; j += blocks) {
      const int64_t row = s * share + j;
      comm_copy_row(stage(p.rank) + row * row_elems, input + row * row_elems, vecs);
    }
  comm_barrier(p, barriers + 1);

  // 2. the rows of this rank's share: the sum over the ranks, then the add and the norm
  const int owned = p.two_shot ? p.rank : 0;
  const RowGroup<kWarp> group{int(blockDim.x), int(threadIdx.x)};
  const W* weight = static_cast<const W*>(p.weight);
  for (int64_t j = blockIdx.x; j < share; j += blocks) {  // uniform across the block (a barrier inside)
    const int64_t row = owned * share + j;
    if (row >= p.rows) break;
    float acc[kMaxVecs][8];
    float ss[1] = {0.f};
#pragma unroll
    for (int k = 0; k < kMaxVecs; ++k) {
      const int64_t v = threadIdx.x + int64_t(k) * blockDim.x;
      if (v >= vecs) continue;
      Vec<T, 8> x;
      x.load(stage(0) + row * row_elems + v * 8);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[k][i] = x.f(i);  // not 0 + x: a sum of -0.0 stays -0.0
#pragma unroll
      for (int r = 1; r < kCommMaxRanks; ++r) {  // rank order: every rank adds the same way
        if (r >= p.world) break;
        x.load(stage(r) + row * row_elems + v * 8);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[k][i] += x.f(i);
      }
      if constexpr (kNorm) {
        Vec<T, 8> res;
        res.load(static_cast<const T*>(p.residual_in) + row * row_elems + v * 8);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          acc[k][i] += res.f(i);
          ss[0] += acc[k][i] * acc[k][i];
        }
      }
    }
    float r = 0.f;
    if constexpr (kNorm) {
      group.sum(ss, scratch);
      r = rsqrtf(ss[0] / float(p.cols) + p.eps);
    }
    T* mine = p.two_shot ? results(p.rank) + row * result_elems : nullptr;
#pragma unroll
    for (int k = 0; k < kMaxVecs; ++k) {
      const int64_t v = threadIdx.x + int64_t(k) * blockDim.x;
      if (v >= vecs) continue;
      Vec<T, 8> first;  // the sum, or the residual
#pragma unroll
      for (int i = 0; i < 8; ++i) first.set(i, acc[k][i]);
      if constexpr (kNorm) {
        Vec<W, 8> w;
        w.load(weight + v * 8);
        Vec<T, 8> normed;
#pragma unroll
        for (int i = 0; i < 8; ++i) normed.set(i, acc[k][i] * r * (w.f(i) + p.weight_offset));
        first.store(static_cast<T*>(p.residual_out) + row * row_elems + v * 8);
        normed.store(static_cast<T*>(p.norm_out) + row * row_elems + v * 8);
        if (mine) first.store(mine + v * 8), normed.store(mine + row_elems + v * 8);
      } else {
        first.store(static_cast<T*>(p.out) + row * row_elems + v * 8);
        if (mine) first.store(mine + v * 8);
      }
    }
  }

  // 3. two-shot: the other shares' results, from their owners
  if (p.two_shot) {
    comm_barrier(p, barriers + 2);
    for (int s = 0; s < shares; ++s) {
      if (s == p.rank) continue;
      for (int64_t j = blockIdx.x; j < share && s * share + j < p.rows; j += blocks) {
        const int64_t row = s * share + j;
        const T* theirs = results(s) + row * result_elems;
        if constexpr (kNorm) {
          comm_copy_row(static_cast<T*>(p.residual_out) + row * row_elems, theirs, vecs);
          comm_copy_row(static_cast<T*>(p.norm_out) + row * row_elems, theirs + row_elems, vecs);
        } else {
          comm_copy_row(static_cast<T*>(p.out) + row * row_elems, theirs, vecs);
        }
      }
    }
  }
  if (threadIdx.x == 0) state[0] = barriers + (p.two_shot ? 2u : 1u), state[1] = calls + 1u;
  pdl_launch_dependents();  // after this thread's last store
}

// What the launcher refuses (the Python layer checks the same first, with the parameter's name).
inline const char* allreduce_params_error(const AllReduceParams& p, int warp) {
  if (p.world < 1 || p.world > kCommMaxRanks || p.rank < 0 || p.rank >= p.world) return "bad world size or rank";
  if (p.blocks < 1 || p.blocks > kCommMaxBlocks || p.threads < warp || p.threads > kCommThreads ||
      p.threads % warp != 0)
    return "bad launch: blocks must be in [1, 64], threads a multiple of the warp up to 512";
  if (p.dtype == DType::f32) return "the all-reduce kernels take float16 or bfloat16";
  if (!comm_fits(p.cols, p.threads)) return "the hidden size must be a multiple of 8 that fits the block's registers";
  if (p.rows < 0 || p.rows * p.cols * 2 > p.message_bytes || p.message_bytes % 16 != 0)
    return "the message does not fit the workspace";
  const bool norm = p.residual_in != nullptr;
  if (norm ? (!p.residual_out || !p.norm_out || !p.weight) : !p.out) return "a missing output or weight";
  for (int r = 0; r < p.world; ++r)
    if (!p.peers[r] || !aligned16(p.peers[r])) return "a peer workspace that is null or not 16-byte aligned";
  const void* rows[] = {p.input, p.residual_in, p.weight, p.out, p.residual_out, p.norm_out};
  for (const void* q : rows)
    if (q && !aligned16(q)) return "a buffer that is not 16-byte aligned";
  return nullptr;
}

template <int kWarp>
const char* run_allreduce(const AllReduceParams& p, gpuStream_t stream) {
  if (const char* error = allreduce_params_error(p, kWarp)) return error;
  const dim3 grid(unsigned(p.blocks)), block(unsigned(p.threads));  // the same on every rank
  return with_dtype16(p.dtype, [&](auto t) {
    using T = decltype(t);
    if (p.residual_in == nullptr) {
      constexpr auto kernel = allreduce_kernel<kWarp, T, T, false>;
      FK_LAUNCH_PDL(kernel, grid, block, 0, stream, p.pdl)(p);
      return last_launch_error();
    }
    return with_weight_dtype<T>(p.weight_dtype, [&](auto wt) {
      constexpr auto kernel = allreduce_kernel<kWarp, T, decltype(wt), true>;
      FK_LAUNCH_PDL(kernel, grid, block, 0, stream, p.pdl)(p);
      return last_launch_error();
    });
  });
}

}  // namespace fk
