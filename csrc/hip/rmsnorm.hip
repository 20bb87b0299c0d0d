// HIP entry points for rmsnorm, fused_add_rmsnorm and the rmsnorm backward. One fat binary holds
// CDNA (wave64) and RDNA (wave32) targets, so the width is chosen per device at run time; each
// target compiles real code only for its own width (FK_WARP_SIZE_MISMATCH in platform.h).
#include "flashkern/kernels/rmsnorm.cuh"

namespace fk {

static bool current_device_is_wave64() {
  return gpuWarpSize(gpuCurrentDevice()) == 64;
}

const char* launch_rmsnorm(const RmsnormParams& p, void* stream) {
  const auto s = static_cast<gpuStream_t>(stream);
  return current_device_is_wave64() ? run_rmsnorm<64>(p, s) : run_rmsnorm<32>(p, s);
}

size_t rmsnorm_backward_workspace_bytes(const RmsnormBackwardParams& p) {
  return current_device_is_wave64() ? rmsnorm_backward_workspace<64>(p) : rmsnorm_backward_workspace<32>(p);
}

const char* launch_rmsnorm_backward(const RmsnormBackwardParams& p, void* stream) {
  const auto s = static_cast<gpuStream_t>(stream);
  return current_device_is_wave64() ? run_rmsnorm_backward<64>(p, s) : run_rmsnorm_backward<32>(p, s);
}

}  // namespace fk
