// CUDA entry points for sampling, top-k / top-p renormalization, softmax and speculative verification (warp 32).
#include "flashkern/kernels/softmax.cuh"
#include "flashkern/kernels/speculative.cuh"

namespace fk {

constexpr int kWarp = 32;

const char* launch_sampling(const SamplingParams& p, void* stream) {
  return run_sampling<kWarp>(p, static_cast<gpuStream_t>(stream));
}

const char* launch_renorm(const RenormParams& p, void* stream) {
  return run_renorm<kWarp>(p, static_cast<gpuStream_t>(stream));
}

const char* launch_softmax(const SoftmaxParams& p, void* stream) {
  return run_softmax<kWarp>(p, static_cast<gpuStream_t>(stream));
}

const char* launch_speculative(const SpeculativeParams& p, void* stream) {
  return run_speculative<kWarp>(p, static_cast<gpuStream_t>(stream));
}

}  // namespace fk
