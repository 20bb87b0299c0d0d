// A GPU stand-in made of host threads, for tests on machines without a GPU (tests/test_emulated_kernels.py):
// compiled with -DFK_EMULATE by a plain C++ compiler, the kernels in kernels/*.cuh run their real code,
// index arithmetic, tails, shared memory, barriers and shuffles included: blocks one after another,
// the threads of a block as std::threads. Shuffles are emulated through shared slots and block
// barriers, which is exact for flashkern's kernels because every thread of a block reaches each
// shuffle together (RowGroup::sum). Not emulated: the memory model, timing, 16-bit conversion
// instructions (the software conversions in numeric.h run instead).
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
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
inline dim3 grid_dim, block_dim;
inline std::barrier<>* block_barrier = nullptr;
inline std::vector<float> shuffle_slots;
inline int warp_size = 32;  // what the emulated device reports: 64 exercises the HIP launchers' wave64 kernels

inline unsigned linear_thread() { return thread_idx.x + block_dim.x * (thread_idx.y + block_dim.y * thread_idx.z); }

// Runs kernel(args...) on every thread of every block of `grid`: one host thread per GPU thread of a
// block, walking the blocks in order, with a barrier between blocks (shared memory is reused).
template <typename... Params>
struct Launcher {
  void (*kernel)(Params...);
  dim3 grid, block;
  template <typename... Args>
  void operator()(Args&&... args) const {
    grid_dim = grid;
    block_dim = block;
    const unsigned threads = block.x * block.y * block.z;
    shuffle_slots.assign(threads, 0.f);
    std::barrier<> barrier(threads);
    block_barrier = &barrier;
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        thread_idx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
        for (unsigned bz = 0; bz < grid.z; ++bz)
          for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
              block_idx = dim3(bx, by, bz);
              kernel(args...);
              barrier.arrive_and_wait();  // the whole block is done before the next one starts
            }
      });
    for (auto& th : pool) th.join();
  }
};

template <typename... Params>
Launcher<Params...> launcher(void (*kernel)(Params...), dim3 grid, dim3 block) {
  return {kernel, grid, block};
}
}  // namespace fk::emu

#define threadIdx (::fk::emu::thread_idx)
#define blockIdx (::fk::emu::block_idx)
#define gridDim (::fk::emu::grid_dim)
#define blockDim (::fk::emu::block_dim)

inline void __syncthreads() { fk::emu::block_barrier->arrive_and_wait(); }

// Every thread of the block calls it together (see the top of this file).
inline float __shfl_xor(float v, int lane_mask) {
  const unsigned t = fk::emu::linear_thread();
  fk::emu::shuffle_slots[t] = v;
  __syncthreads();
  const float other = fk::emu::shuffle_slots[t ^ unsigned(lane_mask)];
  __syncthreads();
  return other;
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
