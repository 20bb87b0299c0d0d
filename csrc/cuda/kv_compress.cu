// CUDA entry points for KV-cache compression: scores, selection, compaction (warp 32).
#include "flashkern/kernels/kv_compress.cuh"

namespace fk {

const char* launch_kv_scores(const KvScoresParams& p, void* stream) {
  return run_kv_scores(p, static_cast<gpuStream_t>(stream));
}

const char* launch_kv_select(const KvSelectParams& p, void* stream) {
  return run_kv_select<32>(p, static_cast<gpuStream_t>(stream));
}

const char* launch_kv_compact(const KvCompactParams& p, void* stream) {
  return run_kv_compact(p, static_cast<gpuStream_t>(stream));
}

}  // namespace fk
