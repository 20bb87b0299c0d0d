// The tensor-parallel all-reduce (+ residual add + RMSNorm) over symmetric memory: checks, params,
// launch. The workspaces and the peers' addresses come from python/flashkern/comm.py.
// Part of the torch glue: included once, by gpu_ops.cpp (one translation unit).
#pragma once

#include "common.h"

namespace {

void check_comm_rows(const char* name, const std::optional<Tensor>& t, const Tensor& input) {
  if (!t) return;
  check_same("allreduce_fusion", name, *t, "input", input);
  FK_CHECK_VALUE(t->is_contiguous(), "allreduce_fusion: ", name, " must be contiguous");
}

// The kernels move 16-byte vectors. A tensor that starts elsewhere is read from an aligned copy, or written
// through one, on this rank alone: refusing it would leave the peers waiting in their kernels.
bool starts_aligned16(const Tensor& t) { return (reinterpret_cast<uintptr_t>(t.const_data_ptr()) & 15u) == 0; }
std::optional<Tensor> aligned_in(const std::optional<Tensor>& t) {
  return t && !starts_aligned16(*t) ? std::optional<Tensor>(t->clone()) : t;
}
std::optional<Tensor> aligned_out(const std::optional<Tensor>& t) {
  return t && !starts_aligned16(*t) ? std::optional<Tensor>(at::empty(t->sizes(), t->options())) : t;
}

void allreduce_fusion(const Tensor& input, const std::optional<Tensor>& residual_in, const std::optional<Tensor>& weight,
                      const std::optional<Tensor>& out, const std::optional<Tensor>& residual_out,
                      const std::optional<Tensor>& norm_out, Tensor& workspace, at::IntArrayRef peers, int64_t rank,
                      bool two_shot, double eps, double weight_offset, bool enable_pdl) {
  const char* op = "allreduce_fusion";
  FK_CHECK_VALUE(input.dim() == 2 && input.is_contiguous(), op, ": input must be a contiguous 2-D tensor [tokens, hidden]");
  FK_CHECK_TYPE(input.scalar_type() == at::kHalf || input.scalar_type() == at::kBFloat16, op,
                ": input must be float16 or bfloat16, got ", dtype_name(input.scalar_type()));
  const int64_t rows = input.size(0), cols = input.size(1);
  FK_CHECK_VALUE(fk::comm_fits(cols, fk::kCommThreads), op, ": the hidden size must be a multiple of 8 up to ",
                 int64_t(fk::kCommThreads) * 8 * fk::kCommMaxVecsPerThread, ", got ", cols);
  const bool norm = residual_in.has_value();
  FK_CHECK_VALUE(norm ? (residual_out && norm_out && weight && !out) : (out && !residual_out && !norm_out), op,
                 ": give out alone (all-reduce), or residual_in, weight, residual_out and norm_out (add + RMSNorm)");
  for (const auto& [name, t] : {std::pair{"residual_in", &residual_in}, std::pair{"out", &out},
                                std::pair{"residual_out", &residual_out}, std::pair{"norm_out", &norm_out}})
    check_comm_rows(name, *t, input);
  if (weight) {
    FK_CHECK_VALUE(weight->device() == input.device() && weight->dim() == 1 && weight->size(0) == cols &&
                       weight->is_contiguous(),
                   op, ": weight must be a contiguous [", cols, "] tensor on ", input.device());
    FK_CHECK_TYPE(weight->scalar_type() == input.scalar_type() || weight->scalar_type() == at::kFloat, op,
                  ": weight must be float32 or the dtype of input, got ", dtype_name(weight->scalar_type()));
  }
  FK_CHECK_VALUE(workspace.device() == input.device() && workspace.scalar_type() == at::kByte &&
                     workspace.is_contiguous(),
                 op, ": workspace must be a contiguous uint8 tensor on ", input.device());
  const int64_t message_bytes = fk::comm_message_bytes(workspace.numel());
  FK_CHECK_VALUE(rows * cols * 2 <= message_bytes, op, ": a message of ", rows * cols * 2,
                 " bytes does not fit the workspace (", message_bytes, ")");
  const int64_t world = int64_t(peers.size());
  FK_CHECK_VALUE(world >= 1 && world <= fk::kCommMaxRanks && rank >= 0 && rank < world, op, ": ", world,
                 " peers and rank ", rank, ": 1 to ", fk::kCommMaxRanks, " ranks");
  FK_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0, op, ": eps must be a finite number >= 0, got ", eps);
  if (rows == 0) return;
  const c10::DeviceGuard guard(input.device());
  const std::optional<Tensor> in = aligned_in(input), res_in = aligned_in(residual_in), w = aligned_in(weight);
  const std::optional<Tensor> o = aligned_out(out), res_o = aligned_out(residual_out), n_o = aligned_out(norm_out);
  fk::AllReduceParams p{};
  for (int64_t r = 0; r < world; ++r) p.peers[r] = reinterpret_cast<void*>(uintptr_t(peers[size_t(r)]));
  p.peers[rank] = workspace.data_ptr();  // the tensor the schema says is written (opcheck passes copies)
  p.world = int(world), p.rank = int(rank), p.message_bytes = message_bytes;
  p.input = in->const_data_ptr();
  p.residual_in = norm ? res_in->const_data_ptr() : nullptr;
  p.weight = weight ? w->const_data_ptr() : nullptr;
  p.out = out ? o->data_ptr() : nullptr;
  p.residual_out = residual_out ? res_o->data_ptr() : nullptr;
  p.norm_out = norm_out ? n_o->data_ptr() : nullptr;
  p.rows = rows, p.cols = cols;
  p.dtype = to_dtype(input.scalar_type());
  p.weight_dtype = weight ? to_dtype(weight->scalar_type()) : p.dtype;
  p.eps = float(eps), p.weight_offset = float(weight_offset);
  p.two_shot = two_shot, p.pdl = enable_pdl;
  p.blocks = fk::kCommBlocks, p.threads = fk::comm_threads(cols);  // the shapes', never the rank's
  p.timeout_ns = fk::kCommTimeoutNs;
  check_launch(fk::launch_allreduce(p, current_stream(input)), op);
  for (const auto& [given, used] : {std::pair{&out, &o}, std::pair{&residual_out, &res_o}, std::pair{&norm_out, &n_o}})
    if (*given && !used->value().is_same(given->value())) given->value().copy_(used->value());
}

void register_comm(torch::Library& m) { m.impl("allreduce_fusion", &allreduce_fusion); }

}  // namespace
