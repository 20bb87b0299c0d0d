// HIP entry point for the tensor-parallel all-reduce (+ residual add + RMSNorm): wave64 (CDNA) or
// wave32 (RDNA), chosen per device at run time (FK_WARP_SIZE_MISMATCH in platform.h).
#include "flashkern/kernels/allreduce.cuh"

namespace fk {

const char* launch_allreduce(const AllReduceParams& p, void* stream) {
  const auto s = static_cast<gpuStream_t>(stream);
  return gpuWarpSize(gpuCurrentDevice()) == 64 ? run_allreduce<64>(p, s) : run_allreduce<32>(p, s);
}

}  // namespace fk
