// The GPU implementations (CUDA key; a ROCm torch dispatches HIP tensors through it too): check
// the arguments, turn tensors into the torch-free params of flashkern/ops.h, launch on the
// current stream. The checks mirror python/flashkern/_validate.py, which guards the CPU
// reference and the fake functions, so a direct torch.ops caller gets the same TypeError or
// ValueError on every device.
// Built with FLASHKERN_EMULATED_OPS=<namespace> and linked with the launchers compiled for the CPU
// emulation (CMakeLists.txt: FLASHKERN_EMULATE), the same code serves CPU tensors as the ops of that
// namespace, which the emulate backends call (python/flashkern/_backend.py).
// Each op family's glue is its own file in glue/ (norm, activation, rope, attention, sampling, optim,
// kv_compress, page, comm); this file registers them all, for the GPU key or, in the emulated builds, as their own
// op namespace.
#include "glue/activation.h"
#include "glue/attention.h"
#include "glue/comm.h"
#include "glue/kv_compress.h"
#include "glue/norm.h"
#include "glue/optim.h"
#include "glue/page.h"
#include "glue/rope.h"
#include "glue/sampling.h"

namespace {

void register_impls(torch::Library& m) {
  register_norm(m);
  register_activation(m);
  register_rope(m);
  register_attention(m);
  register_sampling(m);
  register_optim(m);
  register_kv_compress(m);
  register_page(m);
  register_comm(m);
}

}  // namespace

#if defined(FLASHKERN_EMULATED_OPS)
#include <Python.h>

#include "schemas.h"

#define FK_CAT(a, b) FK_CAT_(a, b)
#define FK_CAT_(a, b) a##b
#define FK_STRINGIFY(a) FK_STRINGIFY_(a)
#define FK_STRINGIFY_(a) #a
#define FK_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define FK_TORCH_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)
FK_TORCH_LIBRARY(FLASHKERN_EMULATED_OPS, m) { flashkern::define_schemas(m); }
FK_TORCH_LIBRARY_IMPL(FLASHKERN_EMULATED_OPS, CPU, m) { register_impls(m); }

// `import flashkern._emulate` (or _emulate_wave64) loads the ops above.
PyMODINIT_FUNC FK_CAT(PyInit_, FLASHKERN_EMULATED_MODULE)(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, FK_STRINGIFY(FLASHKERN_EMULATED_MODULE),
                               "flashkern's kernels on the CPU emulation", -1, nullptr};
  return PyModule_Create(&module);
}
#else
TORCH_LIBRARY_IMPL(flashkern, CUDA, m) { register_impls(m); }
#endif
