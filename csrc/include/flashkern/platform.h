// The one file that knows whether it is compiled by nvcc, hipcc or a plain host compiler.
// Everything else in csrc/include/flashkern/ is written against the small interface below:
//   FK_HOST_DEVICE, FK_DEVICE, FK_INLINE       function qualifiers
//   fk::gpuStream_t, fk::gpuError_t, ...       runtime aliases (device builds only)
//   fk::shfl_xor(v, lane_mask)                 maskless butterfly shuffle over the whole warp
//   fk::hw::*, FK_HW_HALF, FK_HW_BF16          16-bit float conversion instructions where the pass
//                                              has them (numeric.h falls back to bit-exact software)
//   fk::store16(p, uint4)                      one 16-byte global store
//   fk::trap()                                 abort the kernel
//   FK_LAUNCH(kernel, grid, block, stream)(args...)
//                                              launch on a stream (emulate.h: on host threads)
//   FK_WARP_SIZE_MISMATCH(kWarp)               true when a kernel instantiated for kWarp is compiled
//                                              for a device whose wavefront is another width
#pragma once

#include <cstdint>

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
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, block_threads, 0) == cudaSuccess && n > 0 ? n : 1;
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
  return hipOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, block_threads, 0) == hipSuccess && n > 0 ? n : 1;
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
#endif

#if defined(FK_EMU)
#define FK_LAUNCH(kernel, grid, block, stream) ::fk::emu::launcher(kernel, grid, block)
#else
#define FK_LAUNCH(kernel, grid, block, stream) kernel<<<grid, block, 0, stream>>>
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
#else
  *static_cast<uint4*>(p) = v;  // global_store_dwordx4
#endif
}
#endif

// A kernel template instantiated for one wavefront width is compiled for every offload target
// of a HIP fat binary; on a target of the other width its body is dead and becomes a trap, so
// each target carries real code only for its own width (host code picks the width at run time).
// Both spellings fold to a constant per target, so a plain `if` leaves no dead code behind: the
// macro (clang up to 19: ROCm 5.2 here) and the builtin that replaces it in newer clang.
#if defined(FK_HIP) && defined(__HIP_DEVICE_COMPILE__) && defined(__AMDGCN_WAVEFRONT_SIZE)
#define FK_WARP_SIZE_MISMATCH(kWarp) ((kWarp) != __AMDGCN_WAVEFRONT_SIZE)
#elif defined(FK_HIP) && defined(__HIP_DEVICE_COMPILE__)
#define FK_WARP_SIZE_MISMATCH(kWarp) ((kWarp) != __builtin_amdgcn_wavefrontsize())
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

}  // namespace fk
