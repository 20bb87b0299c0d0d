// Every flashkern op's schema, in one place, and the Python module `flashkern._C` that loads them.
// Implementations register elsewhere: the GPU kernels under the CUDA key (gpu_ops.cpp; a ROCm
// build of torch uses the same key), the pure-torch reference under the CPU key and the fake
// (meta) functions and autograd in Python (python/flashkern/).
#include <Python.h>
#include <torch/library.h>

#include <vector>

#include "flashkern/attention_plan.h"

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
  // attention over a paged KV cache as planned in `workspace` (attention_work.h): q [batch, qo_heads,
  // head_dim], k_cache and v_cache [pages, page_size, kv_heads, head_dim] (views of the cache), one
  // kv_indices per level; writes out [batch, qo_heads, head_dim] and lse [batch, qo_heads] (natural
  // log). grid: blocks for the decode, 16-row and 64-row kernels and (0 or 1) the merge.
  m.def(
      "batch_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor[] kv_indices, Tensor(a!) workspace, "
      "Tensor(b!) out, Tensor(c!) lse, int[] grid, float sm_scale) -> ()");
}

// _C.plan_attention(levels, batch, page_size, group_size, kv_heads, cta_budget, min_chunk,
//                   item_capacity, slot_capacity, names, indexed, out, out_words)
//   -> (words, (count per kind), slots, chunk, needs_merge), or ValueError naming the bad argument.
// levels: [(qo_indptr, kv_indptr, kv_last_page_len, groups, num_indices)] with the data pointers
// of contiguous int32 CPU tensors (qo_indptr 0: one query per group); names: the caller's names
// of (qo_indptr, kv_indptr, kv_indices, kv_last_page_len) for messages, indexed: name[level]; out:
// an int32 CPU buffer of out_words words that receives the plan (attention_plan.h).
static PyObject* plan_attention(PyObject*, PyObject* args) {
  PyObject* level_list = nullptr;
  fk::PlanShape shape{};
  const char* names[4] = {};
  int indexed = 0;
  unsigned long long out_ptr = 0;
  long long out_words = 0;
  if (!PyArg_ParseTuple(args, "OLLLLLLLL(ssss)pKL", &level_list, &shape.batch, &shape.page_size, &shape.group_size,
                        &shape.kv_heads, &shape.cta_budget, &shape.min_chunk, &shape.item_capacity,
                        &shape.slot_capacity, &names[0], &names[1], &names[2], &names[3], &indexed, &out_ptr,
                        &out_words))
    return nullptr;
  for (int i = 0; i < 4; ++i) shape.names[i] = names[i];
  shape.indexed = indexed != 0;
  PyObject* seq = PySequence_Fast(level_list, "levels must be a sequence");
  if (seq == nullptr) return nullptr;
  std::vector<fk::PlanLevel> levels;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    unsigned long long qo = 0, kv = 0, last = 0;
    long long groups = 0, num_indices = 0;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KKKLL", &qo, &kv, &last, &groups, &num_indices)) {
      Py_DECREF(seq);
      return nullptr;
    }
    levels.push_back({reinterpret_cast<const int32_t*>(qo), reinterpret_cast<const int32_t*>(kv),
                      reinterpret_cast<const int32_t*>(last), groups, num_indices});
  }
  Py_DECREF(seq);
  const fk::PlanResult r = fk::plan_attention(levels.data(), int(levels.size()), shape,
                                              reinterpret_cast<int32_t*>(out_ptr), out_words);
  if (!r.error.empty()) {
    PyErr_SetString(PyExc_ValueError, r.error.c_str());
    return nullptr;
  }
  return Py_BuildValue("L(iii)LLO", (long long)r.words, r.count[0], r.count[1], r.count[2], (long long)r.slots,
                       (long long)r.chunk, r.needs_merge ? Py_True : Py_False);
}

// _C.workspace_layout(bytes, batch, qo_heads, head_dim)
//   -> (int_words, item_capacity, slot_capacity, partial_s_offset, partial_v_offset)
static PyObject* workspace_layout(PyObject*, PyObject* args) {
  long long bytes = 0, batch = 0, heads = 0, head_dim = 0;
  if (!PyArg_ParseTuple(args, "LLLL", &bytes, &batch, &heads, &head_dim)) return nullptr;
  const fk::WorkspaceLayout w = fk::workspace_layout(bytes, batch, heads, head_dim);
  return Py_BuildValue("LLLLL", (long long)w.int_words, (long long)w.item_capacity, (long long)w.slot_capacity,
                       (long long)w.partial_s_offset, (long long)w.partial_v_offset);
}

// _C.workspace_bytes(slots, batch, qo_heads, head_dim): a workspace with room for `slots` partial states
static PyObject* workspace_bytes(PyObject*, PyObject* args) {
  long long slots = 0, batch = 0, heads = 0, head_dim = 0;
  if (!PyArg_ParseTuple(args, "LLLL", &slots, &batch, &heads, &head_dim)) return nullptr;
  return PyLong_FromLongLong(fk::workspace_bytes(slots, batch, heads, head_dim));
}

// _C.attention_kind(queries, group_size): the kernel (0 decode, 1 tile16, 2 tile64) a group runs
static PyObject* attention_kind(PyObject*, PyObject* args) {
  long long queries = 0, group = 0;
  if (!PyArg_ParseTuple(args, "LL", &queries, &group)) return nullptr;
  return PyLong_FromLong(long(fk::attention_kind(queries, group)));
}

static PyMethodDef methods[] = {
    {"plan_attention", plan_attention, METH_VARARGS, "Plan batch attention over a paged KV cache (host)."},
    {"workspace_layout", workspace_layout, METH_VARARGS, "Where a plan and its partial states sit in a workspace."},
    {"workspace_bytes", workspace_bytes, METH_VARARGS, "The workspace size for a number of partial states."},
    {"attention_kind", attention_kind, METH_VARARGS, "The attention kernel a group of queries runs."},
    {nullptr, nullptr, 0, nullptr},
};

// What this binary was built with, for flashkern.info().
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "flashkern's compiled ops", -1, methods};
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  PyModule_AddStringConstant(m, "BACKEND", FLASHKERN_BACKEND);  // "cuda", "hip" or "cpu"
  PyModule_AddStringConstant(m, "ARCHS", FLASHKERN_ARCHS);      // e.g. "80;90" or "gfx90a;gfx942"
  PyModule_AddIntConstant(m, "MAX_LEVELS", fk::kMaxLevels);     // attention levels (kv_indices per launch)
  PyModule_AddObject(m, "KIND_ROWS", Py_BuildValue("(iii)", fk::kind_rows(fk::AttentionKind::decode),
                                                   fk::kind_rows(fk::AttentionKind::tile16),
                                                   fk::kind_rows(fk::AttentionKind::tile64)));
  return m;
}
