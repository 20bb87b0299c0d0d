// CUDA entry point for merge_state, merge_state_in_place and merge_states.
#include "flashkern/kernels/merge_states.cuh"

namespace fk {

const char* launch_merge_states(const MergeStatesParams& p, void* stream) {
  return run_merge_states(p, static_cast<gpuStream_t>(stream));
}

}  // namespace fk
