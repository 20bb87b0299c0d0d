// HIP entry points for sampling, top-k / top-p renormalization, softmax and speculative verification: wave64
// (CDNA) or wave32 (RDNA) chosen per device, as in rmsnorm.hip.
#include "flashkern/kernels/softmax.cuh"
#include "flashkern/kernels/speculative.cuh"

namespace fk {

static bool current_device_is_wave64() {
  return gpuWarpSize(gpuCurrentDevice()) == 64;
}

const char* launch_sampling(const SamplingParams& p, void* stream) {
  const auto s = static_cast<gpuStream_t>(stream);
  return current_device_is_wave64() ? run_sampling<64>(p, s) : run_sampling<32>(p, s);
}

const char* launch_renorm(const RenormParams& p, void* stream) {
  const auto s = static_cast<gpuStream_t>(stream);
  return current_device_is_wave64() ? run_renorm<64>(p, s) : run_renorm<32>(p, s);
}

const char* launch_softmax(const SoftmaxParams& p, void* stream) {
  const auto s = static_cast<gpuStream_t>(stream);
  return current_device_is_wave64() ? run_softmax<64>(p, s) : run_softmax<32>(p, s);
}

const char* launch_speculative(const SpeculativeParams& p, void* stream) {
  const auto s = static_cast<gpuStream_t>(stream);
  return current_device_is_wave64() ? run_speculative<64>(p, s) : run_speculative<32>(p, s);
}

}  // namespace fk
