// CUDA entry points for silu_and_mul, gelu_and_mul, gelu_tanh_and_mul and their backward.
#include "flashkern/kernels/act_and_mul.cuh"

namespace fk {

const char* launch_act_and_mul(const ActAndMulParams& p, void* stream) {
  return run_act_and_mul(p, static_cast<gpuStream_t>(stream));
}

const char* launch_act_and_mul_backward(const ActAndMulBackwardParams& p, void* stream) {
  return run_act_and_mul_backward(p, static_cast<gpuStream_t>(stream));
}

}  // namespace fk
