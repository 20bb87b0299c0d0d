// HIP entry point for appending to a paged KV cache: the kernel uses no cross-lane operation, so one
// launcher serves wave64 (CDNA) and wave32 (RDNA).
#include "flashkern/kernels/page.cuh"

namespace fk {

const char* launch_append_paged_kv(const AppendPagedKvParams& p, void* stream) {
  return run_append_paged_kv(p, static_cast<gpuStream_t>(stream));
}

}  // namespace fk
