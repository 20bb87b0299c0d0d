// CUDA entry points for rmsnorm, fused_add_rmsnorm and the rmsnorm backward (warp width 32).
#include "flashkern/kernels/rmsnorm.cuh"

namespace fk {

constexpr int kWarp = 32;

const char* launch_rmsnorm(const RmsnormParams& p, void* stream) {
  return run_rmsnorm<kWarp>(p, static_cast<gpuStream_t>(stream));
}

size_t rmsnorm_backward_workspace_bytes(const RmsnormBackwardParams& p) {
  return rmsnorm_backward_workspace<kWarp>(p);
}

const char* launch_rmsnorm_backward(const RmsnormBackwardParams& p, void* stream) {
  return run_rmsnorm_backward<kWarp>(p, static_cast<gpuStream_t>(stream));
}

}  // namespace fk
