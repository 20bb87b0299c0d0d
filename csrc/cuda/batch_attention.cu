// CUDA entry point for batch attention over a paged KV cache (decode and cascade; warp width 32).
#include "flashkern/kernels/batch_attention.cuh"

namespace fk {

const char* launch_batch_attention(const BatchAttentionParams& p, void* stream) {
  return run_batch_attention<32>(p, static_cast<gpuStream_t>(stream));
}

}  // namespace fk
