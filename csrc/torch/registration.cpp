// The op schemas (schemas.h) as torch.ops.flashkern, and the Python module `flashkern._C` that loads them.
// Implementations register elsewhere: the GPU kernels under the CUDA key (gpu_ops.cpp; a ROCm
// build of torch uses the same key), the pure-torch reference under the CPU key and the fake
// (meta) functions and autograd in Python (python/flashkern/).
#include <Python.h>
#include <torch/library.h>

#include <exception>
#include <new>
#include <vector>

#include "flashkern/attention_plan.h"
#include "flashkern/ops.h"
#include "flashkern/prefix_plan.h"
#include "schemas.h"

#ifndef FLASHKERN_BACKEND
#define FLASHKERN_BACKEND "cpu"
#endif
#ifndef FLASHKERN_ARCHS
#define FLASHKERN_ARCHS ""
#endif

TORCH_LIBRARY(flashkern, m) { flashkern::define_schemas(m); }

// _C.plan_attention(levels, batch, page_size, group_size, kv_heads, head_dim, cta_budget, min_chunk,
//                   item_capacity, slot_capacity, names, indexed, out, out_words, invariant)
//   -> (words, (count per kind), slots, chunk, needs_merge), or ValueError naming the bad argument.
// levels: [(qo_indptr, kv_indptr, kv_last_page_len, groups, num_indices, causal, window_left, custom_mask,
// identity)] with the data
// pointers of contiguous int32 CPU tensors (qo_indptr 0: one query per group); names: the caller's names
// of (qo_indptr, kv_indptr, kv_indices, kv_last_page_len) for messages, indexed: name[level]; out:
// an int32 CPU buffer of out_words words that receives the plan (attention_plan.h); invariant: a
// batch-invariant plan (PlanShape::invariant).
static PyObject* plan_attention(PyObject*, PyObject* args) {
  PyObject* level_list = nullptr;
  fk::PlanShape shape{};
  const char* names[4] = {};
  int indexed = 0, invariant = 0;
  unsigned long long out_ptr = 0;
  long long out_words = 0;
  if (!PyArg_ParseTuple(args, "OLLLLLLLLL(ssss)pKLp", &level_list, &shape.batch, &shape.page_size, &shape.group_size,
                        &shape.kv_heads, &shape.head_dim, &shape.cta_budget, &shape.min_chunk, &shape.item_capacity,
                        &shape.slot_capacity, &names[0], &names[1], &names[2], &names[3], &indexed, &out_ptr,
                        &out_words, &invariant))
    return nullptr;
  for (int i = 0; i < 4; ++i) shape.names[i] = names[i];
  shape.indexed = indexed != 0;
  shape.invariant = invariant != 0;
  PyObject* seq = PySequence_Fast(level_list, "levels must be a sequence");
  if (seq == nullptr) return nullptr;
  std::vector<fk::PlanLevel> levels;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    unsigned long long qo = 0, kv = 0, last = 0;
    long long groups = 0, num_indices = 0;
    long long window_left = -1;
    int causal = 0, custom_mask = 0, identity = 0;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KKKLLpLpp", &qo, &kv, &last, &groups, &num_indices,
                          &causal, &window_left, &custom_mask, &identity)) {
      Py_DECREF(seq);
      return nullptr;
    }
    levels.push_back({reinterpret_cast<const int32_t*>(qo), reinterpret_cast<const int32_t*>(kv),
                      reinterpret_cast<const int32_t*>(last), groups, num_indices, causal != 0, window_left,
                      custom_mask != 0, identity != 0});
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

// _C.plan_prefix_cascade(prev, num_pages, page_size, slots, n, slot_last, slot_tokens, num_slots, qo_lens, max_levels)
// _C.plan_prefix_decode(the same, qo_lens 0, max_levels 1)
//   -> ([(qo_indptr, kv_indptr, kv_indices, last_page_len)] per level, order), each a bytearray of int32,
//   or ValueError. Addresses of host buffers (prefix_plan.h): prev, slots, slot_last (int32),
//   slot_tokens (int64) and qo_lens (int32 [n], or 0: one query each).
static PyObject* int32_bytes(const std::vector<int32_t>& v) {
  return PyByteArray_FromStringAndSize(reinterpret_cast<const char*>(v.data()), Py_ssize_t(v.size() * sizeof(int32_t)));
}

template <bool kCascade>
static PyObject* plan_prefix(PyObject*, PyObject* args) {
  unsigned long long prev = 0, slots = 0, slot_last = 0, slot_tokens = 0, qo = 0;
  long long num_pages = 0, page_size = 0, n = 0, num_slots = 0;
  int max_levels = 0;
  if (!PyArg_ParseTuple(args, "KLLKLKKLKi", &prev, &num_pages, &page_size, &slots, &n, &slot_last, &slot_tokens,
                        &num_slots, &qo, &max_levels))
    return nullptr;
  if (n < 0 || num_slots < 0 || num_pages < 0) {
    PyErr_SetString(PyExc_ValueError, "negative sizes");
    return nullptr;
  }
  std::vector<int32_t> last;
  std::vector<int64_t> tokens;
  fk::PrefixPlan plan;
  try {
    plan.error = fk::gather_requests(reinterpret_cast<const int32_t*>(slots), n,
                                     reinterpret_cast<const int32_t*>(slot_last),
                                     reinterpret_cast<const int64_t*>(slot_tokens), num_slots, last, tokens);
    if (plan.error.empty()) {
      const fk::PrefixPlanInput in{reinterpret_cast<const int32_t*>(prev), num_pages, page_size, last.data(),
                                   tokens.data(), reinterpret_cast<const int32_t*>(qo), n};
      plan = kCascade ? fk::plan_prefix_cascade(in, max_levels) : fk::plan_prefix_decode(in);
    }
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
  if (!plan.error.empty()) {
    PyErr_SetString(PyExc_ValueError, plan.error.c_str());
    return nullptr;
  }
  PyObject* levels = PyList_New(0);
  if (levels == nullptr) return nullptr;
  for (const fk::PrefixPlanLevel& l : plan.levels) {
    PyObject* t = Py_BuildValue("(NNNN)", int32_bytes(l.qo_indptr), int32_bytes(l.kv_indptr), int32_bytes(l.kv_indices),
                                int32_bytes(l.last_page_len));
    if (t == nullptr || PyList_Append(levels, t) != 0) {
      Py_XDECREF(t);
      Py_DECREF(levels);
      return nullptr;
    }
    Py_DECREF(t);
  }
  return Py_BuildValue("(NN)", levels, int32_bytes(plan.order));
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

// _C.attention_kind(queries, group_size, head_dim): the kernel (0 decode, 1 tile16, 2 tile64) a group runs
static PyObject* attention_kind(PyObject*, PyObject* args) {
  long long queries = 0, group = 0;
  int head_dim = 0;
  if (!PyArg_ParseTuple(args, "LLi", &queries, &group, &head_dim)) return nullptr;
  return PyLong_FromLong(long(fk::attention_kind(queries, group, head_dim)));
}

static PyMethodDef methods[] = {
    {"plan_attention", plan_attention, METH_VARARGS, "Plan batch attention over a paged KV cache (host)."},
    {"plan_prefix_cascade", plan_prefix<true>, METH_VARARGS, "Plan the cascade levels of a prefix cache's batch (host)."},
    {"plan_prefix_decode", plan_prefix<false>, METH_VARARGS, "The flat page table of a prefix cache's batch (host)."},
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
  PyModule_AddIntConstant(m, "MAX_WIDE_HEAD_DIM", fk::kMaxWideHeadDim);  // wider head dims: 16-row tiles only
  PyModule_AddIntConstant(m, "OPTIM_TABLE_ENTRY_BYTES", int(sizeof(fk::OptimTensor)));  // grad_norm, adamw tables
  PyModule_AddIntConstant(m, "OPTIM_CHUNK", int(fk::kOptimChunk));
  PyModule_AddObject(m, "KIND_ROWS", Py_BuildValue("(iii)", fk::kind_rows(fk::AttentionKind::decode),
                                                   fk::kind_rows(fk::AttentionKind::tile16),
                                                   fk::kind_rows(fk::AttentionKind::tile64)));
  return m;
}
