// HIP entry point for the rotary position embedding ops (elementwise: no warp width involved).
#include "flashkern/kernels/rope.cuh"

namespace fk {

const char* launch_rope(const RopeParams& p, void* stream) { return run_rope(p, static_cast<gpuStream_t>(stream)); }

}  // namespace fk
