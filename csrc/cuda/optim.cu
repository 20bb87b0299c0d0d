// CUDA entry points for the multi-tensor gradient norm and AdamW (warp 32).
#include "flashkern/kernels/optim.cuh"

namespace fk {

const char* launch_grad_norm(const GradNormParams& p, void* stream) {
  return run_grad_norm<32>(p, static_cast<gpuStream_t>(stream));
}

const char* launch_adamw(const AdamWParams& p, void* stream) { return run_adamw(p, static_cast<gpuStream_t>(stream)); }

}  // namespace fk
