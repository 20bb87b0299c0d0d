// HIP entry point for batch attention over a paged KV cache. The multi-query kernel's warp tile
// depends on the wavefront: MFMA on wave64 CDNA2/3, plain arithmetic on RDNA (wave32) and older
// CDNA (platform.h: matrix_unit); the width is chosen per device at run time.
#include "flashkern/kernels/batch_attention.cuh"

namespace fk {

const char* launch_batch_attention(const BatchAttentionParams& p, void* stream) {
  const auto s = static_cast<gpuStream_t>(stream);
  return gpuWarpSize(gpuCurrentDevice()) == 64 ? run_batch_attention<64>(p, s) : run_batch_attention<32>(p, s);
}

uint32_t batch_attention_fp8_formats() { return 0xfu; }  // the dequantization is exact bit work on every target

}  // namespace fk
