// CUDA entry point for the rotary position embedding ops.
#include "flashkern/kernels/rope.cuh"

namespace fk {

const char* launch_rope(const RopeParams& p, void* stream) { return run_rope(p, static_cast<gpuStream_t>(stream)); }

}  // namespace fk
