// CUDA entry point for batch attention over a paged KV cache (decode and cascade; warp width 32).
#include "flashkern/kernels/batch_attention.cuh"

namespace fk {

uint32_t batch_attention_fp8_formats() {  // OCP's formats: the ones NVIDIA GPUs convert
  return 1u << int(numeric::Fp8::e4m3fn) | 1u << int(numeric::Fp8::e5m2);
}

const char* launch_batch_attention(const BatchAttentionParams& p, void* stream) {
  if (p.kv_format >= 0 && !(batch_attention_fp8_formats() >> p.kv_format & 1))
    return "batch_attention: this fp8 format (AMD's fnuz) has no NVIDIA kernels";
  return run_batch_attention<32>(p, static_cast<gpuStream_t>(stream));
}

}  // namespace fk
