// The one file that knows whether it is compiled by nvcc, hipcc or a plain host compiler.
// Everything else in csrc/include/flashkern/ is written against the small interface below:
//   FK_HOST_DEVICE, FK_DEVICE, FK_INLINE       function qualifiers
//   fk::gpuStream_t, fk::gpuError_t, ...       runtime aliases (device builds only)
//   fk::shfl_xor(v, lane_mask)                 maskless butterfly shuffle over the whole warp
//   fk::shfl(v, src_lane)                      every lane reads src_lane's v (whole warp)
//   fk::kHipBuild                              a HIP build (or its emulation), in every pass
//   fk::hw::*, FK_HW_HALF, FK_HW_BF16          16-bit float conversion instructions where the pass
//                                              has them (numeric.h falls back to bit-exact software)
//   fk::store16(p, uint4)                      one 16-byte global store
//   FK_ASSUME_GLOBAL(p)                        p points to global memory: nvcc then emits ld.global /
//                                              st.global for a pointer read from memory (not a kernel
//                                              parameter), instead of generic ld / st
//   fk::trap()                                 abort the kernel
//   FK_LAUNCH(kernel, grid, block, stream)(args...)
//   FK_LAUNCH_SMEM(kernel, grid, block, dynamic_shared_bytes, stream)(args...)
//                                              launch on a stream (emulate.h: on host threads)
//   FK_LAUNCH_PDL(kernel, grid, block, dynamic_shared_bytes, stream, pdl)(args...)
//                                              FK_LAUNCH_SMEM, as a programmatic dependent launch when
//                                              pdl and the device has it (CUDA, compute capability 9+)
//   fk::pdl_wait() / fk::pdl_launch_dependents()
//                                              griddepcontrol.wait / .launch_dependents on sm_90+
//                                              device passes, no-ops elsewhere
//   FK_LAUNCH_BOUNDS(threads, min_blocks)      __launch_bounds__ with an occupancy target on CUDA
//                                              (HIP reads the second number differently: threads only)
//   FK_DYNAMIC_SHARED(name)                    the block's dynamic shared memory, as uint8_t* name
//   FK_STATIC_SHARED(type, name, dims)         a __shared__ array: FK_STATIC_SHARED(float, s, [4][33])
//                                              (emulate.h gives each block its own)
//   fk::gpuSetMaxDynamicShared(kernel, bytes)  allow more than 48 KB of it (CUDA needs the opt-in)
//   FK_WARP_SIZE_MISMATCH(kWarp)               true when a kernel instantiated for kWarp is compiled
//                                              for a device whose wavefront is another width
//   fk::cp_async16 / cp_async8 / cp_async_commit / cp_async_wait<n>
//                                              16-byte global -> shared copies: cp.async on CUDA
//                                              (FK_ASYNC_COPY), a plain load and store elsewhere
//   fk::matrix_unit<kWarp>()                   the warp matrix instructions this pass compiles for:
//                                              mma.sync + ldmatrix (CUDA sm_80+), MFMA (CDNA2/3
//                                              wave64), or none (simt: RDNA, older CDNA)
//   fk::ldmatrix_x4[_trans], fk::mma_m16n8k16<T>, fk::mfma_16x16x16<T>
//                                              those instructions, 16-bit inputs, fp32 accumulators
//   fk::signal_release_system(p, v) / fk::poll_acquire_system(p) / fk::spin_pause(n) / fk::fence_system()
//   / fk::clock_ns()                           flags between GPUs (kernels/allreduce.cuh): a 32-bit
//                                              store with release and a load with acquire semantics at
//                                              system scope, a pause in a spin (emulate.h: a watchdog),
//                                              a device-wide clock for a spin's time limit
#pragma once

#include <atomic>
#include <cstdint>
#include <utility>

#if defined(__HIPCC__)
#define FK_HIP 1
#include <hip/hip_runtime.h>
#elif defined(__CUDACC__)
#define FK_CUDA 1
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#elif defined(FK_EMULATE)
#define FK_EMU 1
#include "flashkern/emulate.h"  // host threads stand in for a GPU: tests only
#endif

#if defined(FK_CUDA) || defined(FK_HIP) || defined(FK_EMU)
#define FK_GPU 1
#define FK_HOST_DEVICE __host__ __device__ __forceinline__
#define FK_DEVICE __device__ __forceinline__
#else
#define FK_HOST_DEVICE inline
#endif

#if (defined(FK_CUDA) && defined(__CUDA_ARCH__)) || (defined(FK_HIP) && defined(__HIP_DEVICE_COMPILE__))
#define FK_DEVICE_PASS 1
#endif

#if defined(FK_CUDA) && defined(__CUDA_ARCH__)
#define FK_ASSUME_GLOBAL(p) __builtin_assume(__isGlobal(p))
#else
#define FK_ASSUME_GLOBAL(p) ((void)0)
#endif

namespace fk {

#if defined(FK_CUDA)
using gpuStream_t = cudaStream_t;
using gpuError_t = cudaError_t;
inline constexpr gpuError_t gpuSuccess = cudaSuccess;
inline gpuError_t gpuGetLastError() { return cudaGetLastError(); }
inline const char* gpuGetErrorString(gpuError_t e) { return cudaGetErrorString(e); }
inline int gpuCurrentDevice() {
  int d = 0;
  return cudaGetDevice(&d) == cudaSuccess ? d : 0;
}
inline int gpuMultiprocessorCount(int device) {
  int n = 0;
  return cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) == cudaSuccess ? n : 1;
}
inline int gpuWarpSize(int device) {
  int n = 0;
  return cudaDeviceGetAttribute(&n, cudaDevAttrWarpSize, device) == cudaSuccess ? n : 32;
}
template <typename Kernel>
int gpuMaxActiveBlocksPerSM(Kernel kernel, int block_threads) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, block_threads, 0) != cudaSuccess) {
    (void)cudaGetLastError();  // only sizes a grid: not the next launch's error
    return 1;
  }
  return n > 0 ? n : 1;
}
#elif defined(FK_HIP)
using gpuStream_t = hipStream_t;
using gpuError_t = hipError_t;
inline constexpr gpuError_t gpuSuccess = hipSuccess;
inline gpuError_t gpuGetLastError() { return hipGetLastError(); }
inline const char* gpuGetErrorString(gpuError_t e) { return hipGetErrorString(e); }
inline int gpuCurrentDevice() {
  int d = 0;
  return hipGetDevice(&d) == hipSuccess ? d : 0;
}
inline int gpuMultiprocessorCount(int device) {
  int n = 0;
  return hipDeviceGetAttribute(&n, hipDeviceAttributeMultiprocessorCount, device) == hipSuccess ? n : 1;
}
inline int gpuWarpSize(int device) {
  int n = 0;
  return hipDeviceGetAttribute(&n, hipDeviceAttributeWarpSize, device) == hipSuccess ? n : 64;
}
template <typename Kernel>
int gpuMaxActiveBlocksPerSM(Kernel kernel, int block_threads) {
  int n = 0;
  if (hipOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, block_threads, 0) != hipSuccess) {
    (void)hipGetLastError();  // only sizes a grid: not the next launch's error
    return 1;
  }
  return n > 0 ? n : 1;
}
#endif

#if defined(FK_GPU)
// Butterfly exchange across the whole warp. Every lane of the warp must execute it.
FK_DEVICE float shfl_xor(float v, int lane_mask) {
#if defined(FK_CUDA)
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
#else
  return __shfl_xor(v, lane_mask);  // maskless on AMD: all lanes of the wavefront take part
#endif
}

FK_DEVICE float shfl(float v, int src_lane) {
#if defined(FK_CUDA)
  return __shfl_sync(0xffffffffu, v, src_lane);
#else
  return __shfl(v, src_lane);
#endif
}
#endif

#if defined(FK_HIP) || defined(FK_EMULATE_HIP)
inline constexpr bool kHipBuild = true;
#else
inline constexpr bool kHipBuild = false;
#endif

#if defined(FK_EMU)
#define FK_LAUNCH(kernel, grid, block, stream) ::fk::emu::launcher(kernel, grid, block, 0)
#define FK_LAUNCH_SMEM(kernel, grid, block, smem, stream) ::fk::emu::launcher(kernel, grid, block, smem)
#define FK_DYNAMIC_SHARED(name) uint8_t* name = ::fk::emu::dynamic_shared()
#define FK_STATIC_SHARED(type, name, dims)            \
  static thread_local ::fk::emu::StaticShared fk_shared_##name; \
  type(&name) dims = *reinterpret_cast<type(*) dims>(fk_shared_##name.get(sizeof(type dims)))
#else
#define FK_LAUNCH(kernel, grid, block, stream) kernel<<<grid, block, 0, stream>>>
#define FK_LAUNCH_SMEM(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
#define FK_DYNAMIC_SHARED(name)                              \
  extern __shared__ __align__(16) uint8_t fk_dynamic_shared[]; \
  uint8_t* name = fk_dynamic_shared
#define FK_STATIC_SHARED(type, name, dims) __shared__ type name dims
#endif

// ---- programmatic dependent launch (PDL, CUDA sm_90+) ----
// A kernel launched with it may start while the stream's previous kernel still runs. Every flashkern
// kernel therefore calls pdl_wait() before its first global memory access (the previous kernel has
// then finished and its writes are visible; without PDL it returns at once), and the kernels that
// can be launched so call pdl_launch_dependents() once they have read their inputs, which lets the
// next kernel in the stream begin launching (its own wait still holds it until this grid is done).
// HIP has no PDL, and the emulator runs each launch to its end before the next: both are no-ops there
// (the emulator only notes the call, for signal_release_system).
#if defined(FK_GPU)
// a / b within 2 ulp (0 for |b| > 2^126): one reciprocal on the GPU instead of the IEEE
// division's subroutine, which cost the decode kernel a spill.
FK_DEVICE float fast_div(float a, float b) {
#if defined(FK_DEVICE_PASS)
  return __fdividef(a, b);
#else
  return a / b;
#endif
}

FK_DEVICE void pdl_wait() {
#if defined(FK_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
FK_DEVICE void pdl_launch_dependents() {
#if defined(FK_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");  // orders no memory: the dependent's wait covers all of it
#elif defined(FK_EMU)
  ::fk::emu::Untracked untracked;
  ::fk::emu::me().dependents_launched = true;  // signal_release_system refuses to follow it
#endif
}
#endif

#if defined(FK_CUDA)
// kKernel<<<grid, block, smem, stream>>>(args...), through cudaLaunchKernelEx with programmatic stream
// serialization when pdl and the launch can take it: the device has PDL (compute capability 9.0+)
// and the code it runs has the waits, i.e. was compiled for compute 9.0+ (an sm_80-only build
// JIT-compiled on a Hopper has none). Asked once per kernel and device (devices 0-63; others on
// every launch). Errors are left for gpuGetLastError, as a <<<>>> launch leaves them.
template <auto kKernel>
struct PdlLauncher {
  dim3 grid, block;
  int smem;
  cudaStream_t stream;
  bool pdl;

  static bool waits_on(int device) {
    static std::atomic<int8_t> known[64];  // 0: not asked yet, 1: yes, 2: no
    if (device >= 0 && device < 64 && known[device].load(std::memory_order_relaxed) != 0)
      return known[device].load(std::memory_order_relaxed) == 1;
    int major = 0;
    cudaFuncAttributes attributes{};
    const bool yes = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
                     major >= 9 && cudaFuncGetAttributes(&attributes, kKernel) == cudaSuccess &&
                     attributes.ptxVersion >= 90;
    if (!yes) (void)cudaGetLastError();  // a failed query is no launch error: the launch is a plain one
    if (device >= 0 && device < 64) known[device].store(yes ? 1 : 2, std::memory_order_relaxed);
    return yes;
  }

  template <typename... Args>
  void operator()(Args&&... args) const {
    if (pdl && waits_on(gpuCurrentDevice())) {
      cudaLaunchAttribute attribute[1] = {};
      attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attribute[0].val.programmaticStreamSerializationAllowed = 1;
      cudaLaunchConfig_t config{};
      config.gridDim = grid, config.blockDim = block, config.dynamicSmemBytes = size_t(smem), config.stream = stream;
      config.attrs = attribute, config.numAttrs = 1;
      (void)cudaLaunchKernelEx(&config, kKernel, std::forward<Args>(args)...);  // its error is also the last error
    } else {
      kKernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    }
  }
};
// kernel: a constant expression (a kernel template instantiation, or a constexpr pointer to one)
#define FK_LAUNCH_PDL(kernel, grid, block, smem, stream, pdl) ::fk::PdlLauncher<kernel>{grid, block, smem, stream, pdl}
#else
#define FK_LAUNCH_PDL(kernel, grid, block, smem, stream, pdl) FK_LAUNCH_SMEM(kernel, grid, block, smem, stream)
#endif

// Without a block count ptxas may cap registers below what the threads allow and spill; with one
// the cap is 65536 / (threads * min_blocks).
#if defined(FK_CUDA)
#define FK_LAUNCH_BOUNDS(threads, min_blocks) __launch_bounds__(threads, min_blocks)
#else
#define FK_LAUNCH_BOUNDS(threads, min_blocks) __launch_bounds__(threads)
#endif

#if defined(FK_CUDA)
template <typename Kernel>
gpuError_t gpuSetMaxDynamicShared(Kernel kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}
#elif defined(FK_HIP)
template <typename Kernel>
gpuError_t gpuSetMaxDynamicShared(Kernel kernel, int bytes) {
  return hipFuncSetAttribute(reinterpret_cast<const void*>(kernel), hipFuncAttributeMaxDynamicSharedMemorySize, bytes);
}
#endif

#if defined(FK_GPU)
FK_DEVICE void trap() {
#if defined(FK_CUDA)
  __trap();
#else
  __builtin_trap();
#endif
}

// One 16-byte global store. nvcc otherwise may split a uint4 store assembled from 16-bit halves
// into 32-bit pieces; __stwb is the default (write-back) store, as one st.global.wb.v4.
FK_DEVICE void store16(void* p, uint4 v) {
#if defined(FK_CUDA)
  __stwb(static_cast<uint4*>(p), v);
#elif defined(FK_EMU)
  if (::fk::emu::is_shared(p)) ::fk::emu::fail("store16 (a global store: st.global on CUDA) to shared memory");
  *static_cast<uint4*>(p) = v;
#else
  *static_cast<uint4*>(p) = v;  // global_store_dwordx4
#endif
}
#endif

// A kernel template instantiated for one wavefront width is compiled for every offload target
// of a HIP fat binary; on a target of the other width its body is dead and becomes a trap, so
// each target carries real code only for its own width (host code picks the width at run time).
// Both spellings fold to a constant per target, so a plain `if` leaves no dead code behind: the
// builtin first, the macro (deprecated in clang 20, gone later) for a clang without it.
#if defined(FK_HIP) && defined(__HIP_DEVICE_COMPILE__) && __has_builtin(__builtin_amdgcn_wavefrontsize)
#define FK_WARP_SIZE_MISMATCH(kWarp) ((kWarp) != __builtin_amdgcn_wavefrontsize())
#elif defined(FK_HIP) && defined(__HIP_DEVICE_COMPILE__)
#define FK_WARP_SIZE_MISMATCH(kWarp) ((kWarp) != __AMDGCN_WAVEFRONT_SIZE)
#else
#define FK_WARP_SIZE_MISMATCH(kWarp) false
#endif

// ---- 16-bit float conversion instructions, device passes only ----
#if defined(FK_CUDA) && defined(FK_DEVICE_PASS)
#define FK_HW_HALF 1
namespace hw {
FK_DEVICE float half_bits_to_float(uint16_t b) { return __half2float(__ushort_as_half(b)); }
FK_DEVICE uint16_t float_to_half_bits(float f) { return __half_as_ushort(__float2half_rn(f)); }
}  // namespace hw
#if __CUDA_ARCH__ >= 800
#define FK_HW_BF16 1
namespace hw {
FK_DEVICE uint16_t float_to_bf16_bits(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
}  // namespace hw
#endif
#elif defined(FK_HIP) && defined(FK_DEVICE_PASS)
#define FK_HW_HALF 1  // _Float16 is native on every AMD target; bf16 stays in software (no hip_bf16.h in ROCm 5.2)
namespace hw {
FK_DEVICE float half_bits_to_float(uint16_t b) { return static_cast<float>(__builtin_bit_cast(_Float16, b)); }
FK_DEVICE uint16_t float_to_half_bits(float f) { return __builtin_bit_cast(uint16_t, static_cast<_Float16>(f)); }
}  // namespace hw
#endif

// ---- 16-byte asynchronous copies, global -> shared ----
// cp_async16 copies 16 bytes, or writes 16 zero bytes when !valid (gmem is then not read);
// cp_async8 the same with 8 (an fp8 KV cache's 8-element chunks).
// A thread's copies complete in the groups it commits; cp_async_wait<n>() returns once at most n
// of its groups are still in flight, and then its own copies are visible to itself (other
// threads need a barrier too). Without cp.async (HIP, emulation) the copy is done at once.
// kAsyncCopy is the same in every compilation pass, so tile shapes that depend on it agree
// between the host code that sizes a launch and the device code. The emulation of a CUDA build
// has it too: emulate.h lands each thread's copies only when its cp_async_wait retires them.
#if defined(FK_CUDA) || (defined(FK_EMU) && !defined(FK_EMULATE_HIP))
inline constexpr bool kAsyncCopy = true;
#else
inline constexpr bool kAsyncCopy = false;
#endif

#if defined(FK_GPU) && !defined(FK_EMU)
FK_DEVICE void cp_async16(void* smem, const void* gmem, bool valid) {
#if defined(FK_CUDA) && defined(FK_DEVICE_PASS)
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
#else
  *static_cast<uint4*>(smem) = valid ? *static_cast<const uint4*>(gmem) : make_uint4(0, 0, 0, 0);
#endif
}
FK_DEVICE void cp_async8(void* smem, const void* gmem, bool valid) {
#if defined(FK_CUDA) && defined(FK_DEVICE_PASS)
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 8 : 0)
               : "memory");  // .cg takes only 16 bytes
#else
  *static_cast<uint2*>(smem) = valid ? *static_cast<const uint2*>(gmem) : make_uint2(0, 0);
#endif
}
FK_DEVICE void cp_async_commit() {
#if defined(FK_CUDA) && defined(FK_DEVICE_PASS)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int kPending>
FK_DEVICE void cp_async_wait() {
#if defined(FK_CUDA) && defined(FK_DEVICE_PASS)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");  // shared reads stay after it
#endif
}
#endif

// ---- warp matrix instructions ----
enum class MatrixUnit { simt, mma_sync, mfma };

// Which one a kernel instantiated for kWarp uses in this compilation pass. HIP fat binaries pick
// per target: MFMA with bf16 on gfx90a and gfx94x (wave64 only), plain arithmetic elsewhere. It
// may differ between passes: nothing the host computes (tile shapes, shared memory) depends on it.
#if defined(FK_HIP) && defined(FK_DEVICE_PASS) && \
    (defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__))
#define FK_HAS_MFMA 1
#endif

template <int kWarp>
FK_HOST_DEVICE constexpr MatrixUnit matrix_unit() {
#if defined(FK_CUDA) || (defined(FK_EMU) && !defined(FK_EMULATE_HIP))
  return MatrixUnit::mma_sync;
#elif defined(FK_HAS_MFMA) || defined(FK_EMU)
  return kWarp == 64 ? MatrixUnit::mfma : MatrixUnit::simt;  // FK_EMU here: emulating a HIP build
#else
  return MatrixUnit::simt;
#endif
}

// The instructions themselves (emulate.h has host versions). Each is declared on every GPU
// platform so that templates naming it compile everywhere; where it does not exist it traps,
// and matrix_unit() never selects it there.
#if defined(FK_GPU) && !defined(FK_EMU)
// Four 8x8 matrices of 16-bit elements from shared memory: lanes 8i..8i+7 give the row addresses
// of matrix i; register i of lane l then holds row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1
// of matrix i (_trans: of its transpose).
FK_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if defined(FK_CUDA) && defined(FK_DEVICE_PASS)
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");  // reads shared memory: the compiler keeps this thread's stores before it
#else
  trap();
#endif
}
FK_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
#if defined(FK_CUDA) && defined(FK_DEVICE_PASS)
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");  // reads shared memory: the compiler keeps this thread's stores before it
#else
  trap();
#endif
}

// d += a b for a 16x16 A (row major) and a 16x8 B (column major), fp32 accumulators; the fragment
// layouts are PTX's (mma.m16n8k16, .f16 / .bf16): lane l, g = l / 4, t = l % 4, holds
//   a: (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)    b: (2t..2t+1, g), (2t+8.., g)
//   d: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)
template <typename T>
FK_DEVICE void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(FK_CUDA) && defined(FK_DEVICE_PASS)
  if constexpr (T::kIsBf16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#else
  trap();
#endif
}

// d += a b for 16x16x16 on one wave64 (v_mfma_f32_16x16x16{f16,bf16_1k}): lane l, c = l % 16,
// q = l / 16, holds a: A(c, 4q..4q+3), b: B(4q..4q+3, c), d: D(4q..4q+3, c); 4 elements in two words.
template <typename T>
FK_DEVICE void mfma_16x16x16(float (&d)[4], const uint32_t (&a)[2], const uint32_t (&b)[2]) {
#if defined(FK_HAS_MFMA)
  typedef float f32x4 __attribute__((ext_vector_type(4)));
  f32x4 acc = {d[0], d[1], d[2], d[3]};
  if constexpr (T::kIsBf16) {
    typedef short i16x4 __attribute__((ext_vector_type(4)));
    acc = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(__builtin_bit_cast(i16x4, a), __builtin_bit_cast(i16x4, b), acc,
                                                     0, 0, 0);
  } else {
    typedef _Float16 f16x4 __attribute__((ext_vector_type(4)));
    acc = __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(f16x4, a), __builtin_bit_cast(f16x4, b), acc, 0,
                                                0, 0);
  }
  d[0] = acc[0], d[1] = acc[1], d[2] = acc[2], d[3] = acc[3];
#else
  trap();
#endif
}
#endif

// ---- flags between the GPUs of a group (peer-mapped memory; kernels/allreduce.cuh) ----
// A release store makes what its thread wrote, and what __syncthreads ordered before it, visible to
// every GPU before the value; an acquire load that sees the value orders the loads after it (and,
// through a __syncthreads, the block's) after those writes. System scope: the peers are other GPUs.
// HIP: read-modify-writes, not a plain store and load. torch's symmetric memory on ROCm is coarse-
// grained: a peer's plain store over XGMI need not invalidate this GPU's L2 line of its own memory,
// so a polling load could read a stale count forever; atomics are done at the memory's home, where
// both sides' meet (torch's own symmetric-memory barrier signals and waits with compare-and-swap).
#if defined(FK_GPU) && !defined(FK_EMU)
FK_DEVICE void signal_release_system(uint32_t* p, uint32_t v) {
#if defined(FK_CUDA) && defined(FK_DEVICE_PASS)
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#elif defined(FK_HIP)
  __hip_atomic_exchange(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  *p = v;
#endif
}
FK_DEVICE uint32_t poll_acquire_system(const uint32_t* p) {
#if defined(FK_CUDA) && defined(FK_DEVICE_PASS)
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#elif defined(FK_HIP)
  uint32_t seen = 0;  // a compare-and-swap that writes back what it found (or 0 over 0): a read at the home
  __hip_atomic_compare_exchange_strong(const_cast<uint32_t*>(p), &seen, seen, __ATOMIC_ACQUIRE, __ATOMIC_ACQUIRE,
                                       __HIP_MEMORY_SCOPE_SYSTEM);
  return seen;
#else
  return *p;
#endif
}
// Every thread's stores out to system scope. HIP: the release of one thread covers only its own
// stores there, so each thread fences before the __syncthreads that precedes the signal; CUDA's
// release is cumulative over the barrier and needs none.
FK_DEVICE void fence_system() {
#if defined(FK_HIP)
  __threadfence_system();
#endif
}
// Nanoseconds on a clock every block of the device shares: a spin's time limit, not a timer.
FK_DEVICE uint64_t clock_ns() {
#if defined(FK_CUDA) && defined(FK_DEVICE_PASS)
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#elif defined(FK_HIP) && defined(FK_DEVICE_PASS)
  return wall_clock64() * 10;  // the constant 100 MHz clock of CDNA GPUs (the only AMD ones that run the flags)
#else
  return 0;
#endif
}
FK_DEVICE void spin_pause(uint32_t) {
#if defined(FK_CUDA) && defined(FK_DEVICE_PASS) && __CUDA_ARCH__ >= 700
  __nanosleep(32);
#elif defined(FK_HIP) && defined(FK_DEVICE_PASS)
  __builtin_amdgcn_s_sleep(1);
#endif
}
#endif

}  // namespace fk
