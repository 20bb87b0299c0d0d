// HIP entry points for the multi-tensor gradient norm (wave64 on CDNA, wave32 on RDNA, chosen per
// device as in rmsnorm.hip) and AdamW (elementwise: no warp width involved).
#include "flashkern/kernels/optim.cuh"

namespace fk {

const char* launch_grad_norm(const GradNormParams& p, void* stream) {
  const auto s = static_cast<gpuStream_t>(stream);
  return gpuWarpSize(gpuCurrentDevice()) == 64 ? run_grad_norm<64>(p, s) : run_grad_norm<32>(p, s);
}

const char* launch_adamw(const AdamWParams& p, void* stream) { return run_adamw(p, static_cast<gpuStream_t>(stream)); }

}  // namespace fk
