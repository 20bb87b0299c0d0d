// HIP entry points for KV-cache compression: the selection's block prefix sums are per wavefront,
// wave64 (CDNA) or wave32 (RDNA) chosen per device, as in sampling.hip; scores and compaction use
// no cross-lane operation.
#include "flashkern/kernels/kv_compress.cuh"

namespace fk {

const char* launch_kv_scores(const KvScoresParams& p, void* stream) {
  return run_kv_scores(p, static_cast<gpuStream_t>(stream));
}

const char* launch_kv_select(const KvSelectParams& p, void* stream) {
  const auto s = static_cast<gpuStream_t>(stream);
  return gpuWarpSize(gpuCurrentDevice()) == 64 ? run_kv_select<64>(p, s) : run_kv_select<32>(p, s);
}

const char* launch_kv_compact(const KvCompactParams& p, void* stream) {
  return run_kv_compact(p, static_cast<gpuStream_t>(stream));
}

}  // namespace fk
