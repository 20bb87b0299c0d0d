// Sampling (top-k / top-p / min-p), top-k / top-p renormalization and speculative verification.
// Part of the torch glue: included once, by gpu_ops.cpp (one translation unit). The checks mirror
// python/flashkern/_validate.py (check_sampling, check_renorm, check_speculative).
#pragma once

#include "common.h"

namespace {

// A per-row parameter: a [batch] tensor of `dtype` on the device, or nothing (the scalar is used).
void check_row_param(const char* op, const char* name, const std::optional<Tensor>& t, const Tensor& ref,
                     int64_t batch, at::ScalarType dtype) {
  if (!t) return;
  FK_CHECK_VALUE(t->device() == ref.device(), op, ": ", name, " is on ", t->device(), " but probs is on ",
                    ref.device());
  FK_CHECK_TYPE(t->scalar_type() == dtype, op, ": ", name, " must be ", dtype_name(dtype), ", got ",
                   dtype_name(t->scalar_type()));
  FK_CHECK_VALUE(t->dim() == 1 && t->size(0) == batch && t->is_contiguous(), op, ": ", name,
                    " must be a contiguous tensor of shape (", batch, ",), got ", as_tuple(t->sizes()));
}

// seed / offset: a value, or a [1] or [batch] int64 tensor on the device.
fk::RandomSource random_source(const char* op, const Tensor& ref, int64_t batch, const std::optional<Tensor>& seed_arr,
                               int64_t seed, const std::optional<Tensor>& offset_arr, int64_t offset) {
  fk::RandomSource r{};
  r.seed = seed;
  r.offset = offset;
  r.seed_len = r.offset_len = 1;
  const std::pair<const std::optional<Tensor>*, const char*> arrays[] = {{&seed_arr, "seed"}, {&offset_arr, "offset"}};
  for (const auto& [arr, name] : arrays) {
    if (!*arr) continue;
    const Tensor& t = **arr;
    FK_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but the input is on ",
                      ref.device());
    FK_CHECK_TYPE(t.scalar_type() == at::kLong, op, ": a ", name, " tensor must be torch.int64, got ",
                     dtype_name(t.scalar_type()));
    FK_CHECK_VALUE(t.dim() == 1 && (t.size(0) == 1 || t.size(0) == batch) && t.is_contiguous(), op, ": a ", name,
                      " tensor must be contiguous of shape (1,) or (", batch, ",), got ", as_tuple(t.sizes()));
  }
  if (seed_arr) r.seed_arr = seed_arr->const_data_ptr<int64_t>(), r.seed_len = seed_arr->size(0);
  if (offset_arr) r.offset_arr = offset_arr->const_data_ptr<int64_t>(), r.offset_len = offset_arr->size(0);
  return r;
}

fk::SampleFilter to_filter(const char* op, const std::string& name) {
  if (name == "none") return fk::SampleFilter::none;
  if (name == "top_k") return fk::SampleFilter::top_k;
  if (name == "top_p") return fk::SampleFilter::top_p;
  if (name == "min_p") return fk::SampleFilter::min_p;
  if (name == "top_k_top_p") return fk::SampleFilter::top_k_top_p;
  FK_CHECK_VALUE(false, op, ": filter must be 'none', 'top_k', 'top_p', 'min_p' or 'top_k_top_p', got '", name, "'");
  return fk::SampleFilter::none;  // not reached
}

void check_probs(const char* op, const char* name, const Tensor& probs) {
  FK_CHECK_TYPE(probs.scalar_type() == at::kFloat, op, ": ", name, " must be torch.float32, got ",
                   dtype_name(probs.scalar_type()));
  FK_CHECK_VALUE(probs.dim() == 2, op, ": ", name, " must be 2-D (batch, vocab), got shape ",
                    as_tuple(probs.sizes()));
  FK_CHECK_VALUE(probs.size(1) > 0 && probs.size(1) < (int64_t(1) << 31), op, ": ", name,
                    " must have between 1 and 2^31 - 1 columns, got ", probs.size(1));
  check_last_dim_contiguous(op, name, probs);
}

std::tuple<Tensor, Tensor> sampling(const Tensor& probs, const std::optional<Tensor>& indices,
                                    const std::string& filter, const std::optional<Tensor>& top_k_arr, int64_t top_k,
                                    const std::optional<Tensor>& top_p_arr, double top_p,
                                    const std::optional<Tensor>& min_p_arr, double min_p,
                                    const std::optional<Tensor>& seed_arr, int64_t seed,
                                    const std::optional<Tensor>& offset_arr, int64_t offset) {
  const char* op = "sampling";
  check_probs(op, "probs", probs);
  int64_t batch = probs.size(0);
  if (indices) {
    FK_CHECK_VALUE(indices->device() == probs.device(), op, ": indices is on ", indices->device(),
                      " but probs is on ", probs.device());
    FK_CHECK_TYPE(indices->scalar_type() == at::kInt || indices->scalar_type() == at::kLong, op,
                     ": indices must be torch.int32 or torch.int64, got ", dtype_name(indices->scalar_type()));
    FK_CHECK_VALUE(indices->dim() == 1 && indices->is_contiguous(), op,
                      ": indices must be a contiguous 1-D tensor, got shape ", as_tuple(indices->sizes()));
    batch = indices->size(0);
  }
  check_row_param(op, "top_k", top_k_arr, probs, batch, at::kInt);
  check_row_param(op, "top_p", top_p_arr, probs, batch, at::kFloat);
  check_row_param(op, "min_p", min_p_arr, probs, batch, at::kFloat);
  const c10::DeviceGuard guard(probs.device());
  Tensor samples = at::empty({batch}, probs.options().dtype(indices ? indices->scalar_type() : at::kInt));
  Tensor valid = at::empty({batch}, probs.options().dtype(at::kBool));
  fk::SamplingParams p{};
  p.out = samples.data_ptr();
  p.out_int64 = samples.scalar_type() == at::kLong;
  p.valid = valid.data_ptr<bool>();
  p.probs = probs.const_data_ptr<float>();
  p.probs_stride = probs.stride(0);
  p.indices = indices ? indices->const_data_ptr() : nullptr;
  p.indices_int64 = indices && indices->scalar_type() == at::kLong;
  p.top_k_arr = top_k_arr ? top_k_arr->const_data_ptr<int32_t>() : nullptr;
  p.top_p_arr = top_p_arr ? top_p_arr->const_data_ptr<float>() : nullptr;
  p.min_p_arr = min_p_arr ? min_p_arr->const_data_ptr<float>() : nullptr;
  p.top_k = top_k;
  p.top_p = float(top_p);
  p.min_p = float(min_p);
  p.batch = batch;
  p.rows = probs.size(0);
  p.vocab = probs.size(1);
  p.filter = to_filter(op, filter);
  p.rng = random_source(op, probs, batch, seed_arr, seed, offset_arr, offset);
  check_launch(fk::launch_sampling(p, current_stream(probs)), op);
  return {samples, valid};
}

Tensor renorm(const Tensor& input, const std::string& kind, const std::optional<Tensor>& top_k_arr, int64_t top_k,
              const std::optional<Tensor>& top_p_arr, double top_p) {
  const char* op = kind == "top_k_logits" ? "top_k_mask_logits" : kind == "top_p_probs" ? "top_p_renorm_probs"
                                                                                          : "top_k_renorm_probs";
  FK_CHECK_VALUE(kind == "top_k_probs" || kind == "top_p_probs" || kind == "top_k_logits", op,
                    ": kind must be 'top_k_probs', 'top_p_probs' or 'top_k_logits', got '", kind, "'");
  check_float(op, kind == "top_k_logits" ? "logits" : "probs", input);
  FK_CHECK_VALUE(input.dim() == 2, op, ": input must be 2-D (batch, vocab), got shape ", as_tuple(input.sizes()));
  FK_CHECK_VALUE(input.size(1) < (int64_t(1) << 31), op, ": at most 2^31 - 1 columns, got ", input.size(1));
  check_last_dim_contiguous(op, "input", input);
  check_row_param(op, "top_k", top_k_arr, input, input.size(0), at::kInt);
  check_row_param(op, "top_p", top_p_arr, input, input.size(0), at::kFloat);
  const c10::DeviceGuard guard(input.device());
  Tensor out = at::empty(input.sizes(), input.options());
  fk::RenormParams p{};
  p.out = out.data_ptr();
  p.in = input.const_data_ptr();
  p.out_stride = out.size(0) > 0 ? out.stride(0) : 0;
  p.in_stride = input.size(0) > 0 ? input.stride(0) : 0;
  p.top_k_arr = top_k_arr ? top_k_arr->const_data_ptr<int32_t>() : nullptr;
  p.top_p_arr = top_p_arr ? top_p_arr->const_data_ptr<float>() : nullptr;
  p.top_k = top_k;
  p.top_p = float(top_p);
  p.rows = input.size(0);
  p.vocab = input.size(1);
  p.dtype = to_dtype(input.scalar_type());
  p.kind = kind == "top_k_logits" ? fk::RenormKind::top_k_logits
           : kind == "top_p_probs" ? fk::RenormKind::top_p_probs
                                   : fk::RenormKind::top_k_probs;
  check_launch(fk::launch_renorm(p, current_stream(input)), op);
  return out;
}

Tensor softmax(const Tensor& logits, const std::optional<Tensor>& temperature_arr, double temperature,
               bool enable_pdl) {
  const char* op = "softmax";
  check_float(op, "logits", logits);
  FK_CHECK_VALUE(logits.dim() == 2, op, ": logits must be 2-D (batch, vocab), got shape ", as_tuple(logits.sizes()));
  check_last_dim_contiguous(op, "logits", logits);
  check_row_param(op, "temperature", temperature_arr, logits, logits.size(0), at::kFloat);
  FK_CHECK_VALUE(std::isfinite(float(temperature)) && float(temperature) > 0, op,
                 ": temperature must be a finite float32 number > 0, got ",
                 temperature);
  const c10::DeviceGuard guard(logits.device());
  const int64_t rows = logits.size(0), vocab = logits.size(1), chunks = fk::softmax_chunks(vocab);
  Tensor out = at::empty(logits.sizes(), logits.options().dtype(at::kFloat));
  Tensor partial = chunks > 1 ? at::empty({rows * chunks * 2}, out.options()) : Tensor();
  fk::SoftmaxParams p{};
  p.out = out.data_ptr<float>();
  p.in = logits.const_data_ptr();
  p.in_stride = rows > 0 ? logits.stride(0) : 0;
  p.temperature_arr = temperature_arr ? temperature_arr->const_data_ptr<float>() : nullptr;
  p.temperature = float(temperature);
  p.partial = chunks > 1 ? partial.data_ptr<float>() : nullptr;
  p.rows = rows;
  p.vocab = vocab;
  p.dtype = to_dtype(logits.scalar_type());
  p.pdl = enable_pdl;
  check_launch(fk::launch_softmax(p, current_stream(logits)), op);
  return out;
}

// target [batch, nodes, vocab]; draft [batch, >= nodes - 1, vocab] or none; candidates [batch, nodes -
// first_candidate] int32; parents [nodes] or [batch, nodes] int32, or none (a chain).
std::tuple<Tensor, Tensor, Tensor, Tensor> speculative(const Tensor& target, const std::optional<Tensor>& draft,
                                                       const Tensor& candidates, int64_t first_candidate,
                                                       const std::optional<Tensor>& parents, const std::string& mode,
                                                       const std::optional<Tensor>& seed_arr, int64_t seed,
                                                       const std::optional<Tensor>& offset_arr, int64_t offset) {
  const char* op = mode == "greedy" ? "verify_tree_greedy" : "speculative_sampling";
  FK_CHECK_VALUE(mode == "greedy" || mode == "sample", op, ": mode must be 'greedy' or 'sample', got '", mode, "'");
  const bool greedy = mode == "greedy";
  const char* target_name = greedy ? "target_logits" : "target_probs";
  if (greedy)
    check_float(op, target_name, target);
  else
    FK_CHECK_TYPE(target.scalar_type() == at::kFloat, op, ": ", target_name, " must be torch.float32, got ",
                     dtype_name(target.scalar_type()));
  FK_CHECK_VALUE(target.dim() == 3, op, ": ", target_name, " must be 3-D (batch, nodes, vocab), got shape ",
                    as_tuple(target.sizes()));
  check_last_dim_contiguous(op, target_name, target);
  const int64_t batch = target.size(0), nodes = target.size(1), vocab = target.size(2);
  FK_CHECK_VALUE(nodes >= 1 && nodes <= 1024, op, ": between 1 and 1024 tree nodes, got ", nodes);
  FK_CHECK_VALUE(vocab >= 1 && vocab < (int64_t(1) << 31), op, ": vocab must be between 1 and 2^31 - 1, got ", vocab);
  FK_CHECK_VALUE(first_candidate == 0 || first_candidate == 1, op, ": first_candidate must be 0 or 1");
  FK_CHECK_VALUE(candidates.device() == target.device(), op, ": candidates are on ", candidates.device(),
                    " but ", target_name, " is on ", target.device());
  FK_CHECK_TYPE(candidates.scalar_type() == at::kInt, op, ": candidate token ids must be torch.int32, got ",
                   dtype_name(candidates.scalar_type()));
  const std::vector<int64_t> cand_shape{batch, nodes - first_candidate};
  FK_CHECK_VALUE(candidates.sizes() == at::IntArrayRef(cand_shape) && (candidates.numel() == 0 || candidates.stride(1) == 1),
                    op, ": candidate token ids must have shape ", as_tuple(cand_shape), " (contiguous rows), got ",
                    as_tuple(candidates.sizes()));
  if (draft) {
    FK_CHECK_VALUE(!greedy, op, ": greedy verification takes no draft probabilities");
    check_same(op, "draft_probs", *draft, target_name, target, /*same_shape=*/false);
    FK_CHECK_VALUE(draft->dim() == 3 && draft->size(0) == batch && draft->size(1) >= nodes - 1 &&
                          draft->size(2) == vocab,
                      op, ": draft_probs must have shape (", batch, ", ", nodes - 1, ", ", vocab, ") or more nodes, got ",
                      as_tuple(draft->sizes()));
    check_last_dim_contiguous(op, "draft_probs", *draft);
  }
  if (parents) {
    FK_CHECK_VALUE(parents->device() == target.device(), op, ": parents are on ", parents->device(), " but ",
                      target_name, " is on ", target.device());
    FK_CHECK_TYPE(parents->scalar_type() == at::kInt, op, ": parents must be torch.int32, got ",
                     dtype_name(parents->scalar_type()));
    FK_CHECK_VALUE((parents->dim() == 1 && parents->size(0) == nodes) ||
                          (parents->dim() == 2 && parents->size(0) == batch && parents->size(1) == nodes),
                      op, ": parents must have shape (", nodes, ",) or (", batch, ", ", nodes, "), got ",
                      as_tuple(parents->sizes()));
    FK_CHECK_VALUE(parents->size(-1) <= 1 || parents->stride(-1) == 1, op, ": parents must be contiguous in its last dimension");
  }
  const c10::DeviceGuard guard(target.device());
  const auto i32 = target.options().dtype(at::kInt);
  Tensor tokens = at::empty({batch, nodes}, i32), nodes_out = at::empty({batch, nodes - 1}, i32);
  Tensor accepted = at::empty({batch}, i32), independent = at::empty({batch}, i32);
  fk::SpeculativeParams p{};
  p.out_tokens = tokens.data_ptr<int32_t>();
  p.out_nodes = nodes_out.data_ptr<int32_t>();
  p.num_accepted = accepted.data_ptr<int32_t>();
  p.independent_accepted = independent.data_ptr<int32_t>();
  p.candidates = candidates.const_data_ptr<int32_t>();
  p.cand_stride = candidates.dim() == 2 && candidates.size(0) > 0 ? candidates.stride(0) : 0;
  p.first_candidate = int(first_candidate);
  p.parents = parents ? parents->const_data_ptr<int32_t>() : nullptr;
  p.parents_stride = parents && parents->dim() == 2 ? parents->stride(0) : 0;
  p.target = target.const_data_ptr();
  p.target_strides[0] = target.stride(0);
  p.target_strides[1] = target.stride(1);
  p.draft = draft ? draft->const_data_ptr<float>() : nullptr;
  p.draft_strides[0] = draft ? draft->stride(0) : 0;
  p.draft_strides[1] = draft ? draft->stride(1) : 0;
  p.batch = batch;
  p.vocab = vocab;
  p.nodes = int(nodes);
  p.out_len = int(nodes);
  p.target_dtype = to_dtype(target.scalar_type());
  p.mode = greedy ? fk::SpeculativeMode::greedy : fk::SpeculativeMode::sample;
  p.rng = random_source(op, target, batch, seed_arr, seed, offset_arr, offset);
  check_launch(fk::launch_speculative(p, current_stream(target)), op);
  return {tokens, nodes_out, accepted, independent};
}

void register_sampling(torch::Library& m) {
  m.impl("sampling", &sampling);
  m.impl("renorm", &renorm);
  m.impl("softmax", &softmax);
  m.impl("speculative", &speculative);
}

}  // namespace
