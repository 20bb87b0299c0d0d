// CUDA entry point for the tensor-parallel all-reduce (+ residual add + RMSNorm) (warp 32).
#include "flashkern/kernels/allreduce.cuh"

namespace fk {

const char* launch_allreduce(const AllReduceParams& p, void* stream) {
  return run_allreduce<32>(p, static_cast<gpuStream_t>(stream));
}

}  // namespace fk
