// CUDA entry point for appending to a paged KV cache (warp 32; the kernel uses no cross-lane operation).
#include "flashkern/kernels/page.cuh"

namespace fk {

const char* launch_append_paged_kv(const AppendPagedKvParams& p, void* stream) {
  return run_append_paged_kv(p, static_cast<gpuStream_t>(stream));
}

}  // namespace fk
