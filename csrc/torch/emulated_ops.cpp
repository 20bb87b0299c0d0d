// The torch glue (gpu_ops.cpp) for CPU tensors over the CUDA launchers (warp 32, sm_90) compiled for
// the CPU emulation (emulate.h): torch.ops.flashkern_emulate, module flashkern._emulate (setup.py).
#define FLASHKERN_EMULATED_OPS flashkern_emulate
#define FLASHKERN_EMULATED_MODULE _emulate
#include "gpu_ops.cpp"
