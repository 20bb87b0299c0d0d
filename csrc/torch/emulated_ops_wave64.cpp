// The torch glue (gpu_ops.cpp) for CPU tensors over the HIP launchers on a wave64 AMD device (gfx90a) compiled for
// the CPU emulation (emulate.h): torch.ops.flashkern_emulate_wave64, module flashkern._emulate_wave64 (setup.py).
#define FLASHKERN_EMULATED_OPS flashkern_emulate_wave64
#define FLASHKERN_EMULATED_MODULE _emulate_wave64
#include "gpu_ops.cpp"
