// Every flashkern op's schema, in one place, and the Python module `flashkern._C` that loads them.
// Implementations register elsewhere: the GPU kernels under the CUDA key (gpu_ops.cpp; a ROCm
// build of torch uses the same key), the pure-torch reference under the CPU key and the fake
// (meta) functions and autograd in Python (python/flashkern/).
#include <Python.h>
#include <torch/library.h>

#ifndef FLASHKERN_BACKEND
#define FLASHKERN_BACKEND "cpu"
#endif
#ifndef FLASHKERN_ARCHS
#define FLASHKERN_ARCHS ""
#endif

TORCH_LIBRARY(flashkern, m) {
  // out = input * rsqrt(mean(input^2, -1) + eps) * (weight + weight_offset)
  m.def("rmsnorm(Tensor input, Tensor weight, float eps, float weight_offset) -> Tensor");
  m.def("rmsnorm_out(Tensor(a!) out, Tensor input, Tensor weight, float eps, float weight_offset) -> ()");
  // residual += input; input = rmsnorm(residual)
  m.def(
      "fused_add_rmsnorm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps, float weight_offset) -> ()");
  m.def(
      "rmsnorm_backward(Tensor grad_out, Tensor input, Tensor weight, float eps, float weight_offset) "
      "-> (Tensor grad_input, Tensor grad_weight)");
  // out = act(input[..., :d]) * input[..., d:], act in {silu, gelu, gelu_tanh}
  m.def("act_and_mul(Tensor input, str activation) -> Tensor");
  m.def("act_and_mul_out(Tensor(a!) out, Tensor input, str activation) -> ()");
  m.def("act_and_mul_backward(Tensor grad_out, Tensor input, str activation) -> Tensor");
  // out = act(gate) * up: act_and_mul with the halves as two tensors (no concatenation)
  m.def("act_mul(Tensor gate, Tensor up, str activation) -> Tensor");
  m.def("act_mul_backward(Tensor grad_out, Tensor gate, Tensor up, str activation) -> (Tensor grad_gate, Tensor grad_up)");
  // rotary position embedding of q [tokens, q_heads, head_dim] and k [tokens, k_heads, head_dim] at
  // positions [tokens]; freqs: inv_freq [rotary_dim / 2] or cos_sin_cache [max_position, rotary_dim]
  m.def(
      "rope(Tensor q, Tensor k, Tensor positions, Tensor freqs, bool interleave, bool inverse) "
      "-> (Tensor q_out, Tensor k_out)");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor freqs, bool interleave) -> ()");
  // attention states (v [tokens, heads, head_dim], s = natural-log sum-exp [tokens, heads] float32)
  m.def("merge_state(Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b) -> (Tensor v, Tensor s)");
  m.def("merge_state_in_place(Tensor(a!) v, Tensor(b!) s, Tensor v_other, Tensor s_other, Tensor? mask) -> ()");
  m.def("merge_states(Tensor v, Tensor s) -> (Tensor v_merged, Tensor s_merged)");
}

// What this binary was built with, for flashkern.info().
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "flashkern's compiled ops", -1, nullptr};
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  PyModule_AddStringConstant(m, "BACKEND", FLASHKERN_BACKEND);  // "cuda", "hip" or "cpu"
  PyModule_AddStringConstant(m, "ARCHS", FLASHKERN_ARCHS);      // e.g. "80;90" or "gfx90a;gfx942"
  return m;
}
