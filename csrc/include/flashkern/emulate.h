// A GPU stand-in made of host threads, for tests on machines without a GPU (tests/test_emulated_kernels.py):
// compiled with -DFK_EMULATE by a plain C++ compiler, the kernels in kernels/*.cuh run their real code,
// index arithmetic, tails, shared memory, barriers and shuffles included: blocks one after another,
// the threads of a block as std::threads. Warp-wide instructions (shuffles, ldmatrix, mma.sync,
// MFMA) are emulated through per-thread slots and a barrier per warp, so every lane of a warp must
// reach each of them together, as their full-warp forms require on a GPU; a shuffle naming a lane
// outside the block aborts. The matrix instructions compute with the fragment layouts of the PTX
// and AMD documentation (platform.h), in fp32. Not emulated: the memory model, timing, 16-bit
// conversion instructions (the software conversions in numeric.h run instead).
#pragma once

#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static  // blocks run one after another: a static is the block's shared memory

struct uint4 {
  uint32_t x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
struct int4 {
  int32_t x, y, z, w;
};
struct uint2 {
  uint32_t x, y;
};
struct float2 {
  float x, y;
};
struct float4 {
  float x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}

namespace fk::emu {
inline thread_local dim3 thread_idx, block_idx;
inline thread_local std::barrier<>* warp_barrier = nullptr;
inline dim3 grid_dim, block_dim;
inline std::barrier<>* block_barrier = nullptr;
inline std::vector<float> shuffle_slots;
inline std::vector<std::array<uint32_t, 8>> word_slots;  // operands of the emulated matrix instructions
inline std::vector<const void*> pointer_slots;           // ldmatrix row addresses
inline std::vector<uint8_t> dynamic_shared;              // FK_DYNAMIC_SHARED
inline int warp_size = 32;  // what the emulated device reports: 64 exercises the HIP launchers' wave64 kernels

// A thread's asynchronous copies (platform.h: cp_async16), committed groups oldest first.
struct AsyncCopy {
  void* dst;
  uint8_t bytes[16];
};
inline thread_local std::vector<std::vector<AsyncCopy>> async_groups;
inline thread_local std::vector<AsyncCopy> async_open;  // not committed yet
inline bool copies_in_flight() {
  for (const auto& group : async_groups)
    if (!group.empty()) return true;
  return !async_open.empty();
}

inline unsigned linear_thread() { return thread_idx.x + block_dim.x * (thread_idx.y + block_dim.y * thread_idx.z); }
inline unsigned block_threads() { return block_dim.x * block_dim.y * block_dim.z; }
inline void warp_sync() { warp_barrier->arrive_and_wait(); }

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "flashkern emulation: %s\n", what);
  std::abort();
}

// Runs kernel(args...) on every thread of every block of `grid`: one host thread per GPU thread of a
// block, walking the blocks in order, with a barrier between blocks (shared memory is reused).
template <typename... Params>
struct Launcher {
  void (*kernel)(Params...);
  dim3 grid, block;
  size_t shared_bytes;
  template <typename... Args>
  void operator()(Args&&... args) const {
    grid_dim = grid;
    block_dim = block;
    const unsigned threads = block.x * block.y * block.z;
    const unsigned warps = (threads + warp_size - 1) / warp_size;
    shuffle_slots.assign(threads, 0.f);
    word_slots.assign(threads, {});
    pointer_slots.assign(threads, nullptr);
    dynamic_shared.assign(shared_bytes, 0xff);  // not zero: a kernel must not rely on it
    std::barrier<> barrier(threads);
    block_barrier = &barrier;
    std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
    for (unsigned w = 0; w < warps; ++w)
      warp_barriers.push_back(std::make_unique<std::barrier<>>(std::min<unsigned>(warp_size, threads - w * warp_size)));
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        thread_idx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
        warp_barrier = warp_barriers[t / warp_size].get();
        for (unsigned bz = 0; bz < grid.z; ++bz)
          for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
              block_idx = dim3(bx, by, bz);
              kernel(args...);
              if (copies_in_flight()) fail("a block ended with cp.async copies not waited for");
              barrier.arrive_and_wait();  // the whole block is done before the next one starts
            }
      });
    for (auto& th : pool) th.join();
  }
};

template <typename... Params>
Launcher<Params...> launcher(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes) {
  return {kernel, grid, block, shared_bytes};
}
}  // namespace fk::emu

#define threadIdx (::fk::emu::thread_idx)
#define blockIdx (::fk::emu::block_idx)
#define gridDim (::fk::emu::grid_dim)
#define blockDim (::fk::emu::block_dim)

inline void __syncthreads() { fk::emu::block_barrier->arrive_and_wait(); }

// A block barrier that also tells whether any thread's predicate was true.
inline bool __syncthreads_or(bool predicate) {
  const unsigned t = fk::emu::linear_thread();
  fk::emu::shuffle_slots[t] = predicate ? 1.f : 0.f;
  __syncthreads();
  bool any = false;
  for (unsigned i = 0; i < fk::emu::block_threads(); ++i) any = any || fk::emu::shuffle_slots[i] != 0.f;
  __syncthreads();
  return any;
}

// Every lane of the warp calls it together (see the top of this file).
inline float __shfl_xor(float v, int lane_mask) {
  const unsigned t = fk::emu::linear_thread(), other = t ^ unsigned(lane_mask);
  if (unsigned(lane_mask) >= unsigned(fk::emu::warp_size) || other >= fk::emu::block_threads())
    fk::emu::fail("__shfl_xor names a lane outside the warp");
  fk::emu::shuffle_slots[t] = v;
  fk::emu::warp_sync();
  const float result = fk::emu::shuffle_slots[other];
  fk::emu::warp_sync();
  return result;
}

inline float __shfl(float v, int src_lane) {
  const unsigned t = fk::emu::linear_thread(), base = t - t % unsigned(fk::emu::warp_size);
  const unsigned other = base + unsigned(src_lane);
  if (unsigned(src_lane) >= unsigned(fk::emu::warp_size) || other >= fk::emu::block_threads())
    fk::emu::fail("__shfl names a lane outside the warp");
  fk::emu::shuffle_slots[t] = v;
  fk::emu::warp_sync();
  const float result = fk::emu::shuffle_slots[other];
  fk::emu::warp_sync();
  return result;
}

namespace fk {
using gpuStream_t = void*;
using gpuError_t = int;
inline constexpr gpuError_t gpuSuccess = 0;
inline gpuError_t gpuGetLastError() { return 0; }
inline const char* gpuGetErrorString(gpuError_t) { return "emulated launch error"; }
inline int gpuCurrentDevice() { return 0; }
inline int gpuMultiprocessorCount(int) { return 4; }
inline int gpuWarpSize(int) { return emu::warp_size; }
template <typename Kernel>
int gpuMaxActiveBlocksPerSM(Kernel, int) {
  return 2;
}
}  // namespace fk

// ---- platform.h's asynchronous copies (done at once) and warp matrix instructions ----
// Emulating a CUDA build, a copy lands only when a cp_async_wait of its thread retires its group;
// until then its destination holds 0xff bytes (NaN as fp16 and bf16), so a read that a missing
// wait or barrier leaves too early shows up. Emulating HIP, it is done at once, as on AMD.
namespace fk {
inline void cp_async16(void* smem, const void* gmem, bool valid) {
  emu::AsyncCopy copy{smem, {}};
  if (valid) std::memcpy(copy.bytes, gmem, 16);
#if defined(FK_EMULATE_HIP)
  std::memcpy(smem, copy.bytes, 16);
#else
  std::memset(smem, 0xff, 16);
  emu::async_open.push_back(copy);
#endif
}
inline void cp_async_commit() {
  emu::async_groups.push_back(std::move(emu::async_open));
  emu::async_open.clear();
}
template <int kPending>
void cp_async_wait() {
  while (emu::async_groups.size() > size_t(kPending)) {
    for (const emu::AsyncCopy& c : emu::async_groups.front()) std::memcpy(c.dst, c.bytes, 16);
    emu::async_groups.erase(emu::async_groups.begin());
  }
}

namespace emu {
inline uint16_t half_word(uint32_t w, int i) { return uint16_t(w >> (16 * i)); }

// Element k of the 16-bit values packed in slot words [first, first + n) of a thread.
inline uint16_t slot_element(unsigned thread, int first_word, int k) {
  return half_word(word_slots[thread][first_word + k / 2], k % 2);
}

inline void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
  if (warp_size != 32) fail("ldmatrix on a device whose warp is not 32 lanes");
  const unsigned t = linear_thread(), lane = t % 32, base = t - lane;
  pointer_slots[t] = row;
  warp_sync();
  for (int i = 0; i < 4; ++i) {
    if (!trans) {  // row lane / 4 of matrix i, columns 2 (lane % 4) and the next one
      const auto* src = static_cast<const uint16_t*>(pointer_slots[base + 8 * i + lane / 4]);
      r[i] = uint32_t(src[2 * (lane % 4)]) | uint32_t(src[2 * (lane % 4) + 1]) << 16;
    } else {  // the same of the transpose: rows 2 (lane % 4) and the next one, column lane / 4
      const auto* lo = static_cast<const uint16_t*>(pointer_slots[base + 8 * i + 2 * (lane % 4)]);
      const auto* hi = static_cast<const uint16_t*>(pointer_slots[base + 8 * i + 2 * (lane % 4) + 1]);
      r[i] = uint32_t(lo[lane / 4]) | uint32_t(hi[lane / 4]) << 16;
    }
  }
  warp_sync();
}
}  // namespace emu

inline void ldmatrix_x4(uint32_t (&r)[4], const void* row) { emu::ldmatrix_x4(r, row, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) { emu::ldmatrix_x4(r, row, true); }

template <typename T>
void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if (emu::warp_size != 32) emu::fail("mma.sync on a device whose warp is not 32 lanes");
  const unsigned t = emu::linear_thread(), lane = t % 32, base = t - lane;
  for (int i = 0; i < 4; ++i) emu::word_slots[t][i] = a[i];
  emu::word_slots[t][4] = b[0], emu::word_slots[t][5] = b[1];
  emu::warp_sync();
  const int g = int(lane / 4), tid = int(lane % 4);
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * tid + e % 2;
    float acc = 0.f;
    for (int k = 0; k < 16; ++k) {
      const unsigned a_lane = base + unsigned((row % 8) * 4 + (k % 8) / 2);
      const int a_word = row / 8 + 2 * (k / 8);
      const unsigned b_lane = base + unsigned(col * 4 + (k % 8) / 2);
      const int b_word = 4 + k / 8;
      acc += to_float(T{emu::half_word(emu::word_slots[a_lane][a_word], k % 2)}) *
             to_float(T{emu::half_word(emu::word_slots[b_lane][b_word], k % 2)});
    }
    d[e] += acc;
  }
  emu::warp_sync();
}

template <typename T>
void mfma_16x16x16(float (&d)[4], const uint32_t (&a)[2], const uint32_t (&b)[2]) {
  if (emu::warp_size != 64) emu::fail("MFMA on a device whose wavefront is not 64 lanes");
  const unsigned t = emu::linear_thread(), lane = t % 64, base = t - lane;
  emu::word_slots[t][0] = a[0], emu::word_slots[t][1] = a[1], emu::word_slots[t][2] = b[0], emu::word_slots[t][3] = b[1];
  emu::warp_sync();
  const int col = int(lane % 16), q = int(lane / 16);
  for (int e = 0; e < 4; ++e) {
    const int row = 4 * q + e;
    float acc = 0.f;
    for (int k = 0; k < 16; ++k) {  // A(row, k) in lane row + 16 (k / 4); B(k, col) in lane col + 16 (k / 4)
      acc += to_float(T{emu::slot_element(base + unsigned(row + 16 * (k / 4)), 0, k % 4)}) *
             to_float(T{emu::slot_element(base + unsigned(col + 16 * (k / 4)), 2, k % 4)});
    }
    d[e] += acc;
  }
  emu::warp_sync();
}
}  // namespace fk
