// C entry points over the host-device code of csrc/include/flashkern (no GPU needed), loaded by
// tests/test_host_code.py with ctypes and checked against torch on the CPU.
#include <cstdint>

#include "flashkern/activations.h"
#include "flashkern/attention_state.h"
#include "flashkern/divmod.h"
#include "flashkern/numeric.h"
#include "flashkern/ops.h"
#include "flashkern/philox.h"
#include "flashkern/rows.h"

extern "C" {

void fk_half_to_float(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = fk::to_float(fk::half_t{in[i]});
}
void fk_float_to_half(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = fk::from_float<fk::half_t>(in[i]).bits;
}
void fk_bf16_to_float(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = fk::to_float(fk::bf16_t{in[i]});
}
void fk_float_to_bf16(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = fk::from_float<fk::bf16_t>(in[i]).bits;
}
// format: fk::numeric::Fp8 (0 e4m3fn, 1 e5m2, 2 e4m3fnuz, 3 e5m2fnuz)
void fk_fp8_to_float(const uint8_t* in, float* out, int64_t n, int format) {
  for (int64_t i = 0; i < n; ++i) out[i] = fk::numeric::fp8_bits_to_float(in[i], fk::numeric::Fp8(format));
}
void fk_float_to_fp8(const float* in, uint8_t* out, int64_t n, int format) {
  for (int64_t i = 0; i < n; ++i) out[i] = fk::numeric::float_to_fp8_bits(in[i], fk::numeric::Fp8(format));
}

// limits: 0 rmsnorm and fused_add_rmsnorm, 1 rmsnorm backward.
// out: threads_per_row, rows_per_block, vecs_per_thread, in_registers, block_threads, blocks
void fk_plan_rows(int64_t rows, int64_t cols, int vec, int limits, int64_t* out) {
  const fk::RowPlanLimits lim =
      limits == 0 ? fk::kRmsnormLimits : fk::kRmsnormBackwardLimits;
  const fk::RowPlan p = fk::plan_rows(rows, cols, vec, lim);
  const int64_t values[] = {p.threads_per_row, p.rows_per_block, p.vecs_per_thread, p.in_registers,
                            p.block_threads,   p.blocks};
  for (int i = 0; i < 6; ++i) out[i] = values[i];
}
void fk_plan_limits(int limits, int64_t* out) {
  const fk::RowPlanLimits lim =
      limits == 0 ? fk::kRmsnormLimits : fk::kRmsnormBackwardLimits;
  out[0] = lim.max_block_threads;
  out[1] = lim.max_vecs_per_thread;
  out[2] = lim.target_block_threads;
  out[3] = fk::kMinBlockThreads;
  out[4] = fk::kMaxBlocks;
}

// Offsets of every row of a tensor with the given leading sizes/strides; returns 0 when the
// leading dimensions do not collapse to a RowLayout.
int fk_row_offsets(const int64_t* sizes, const int64_t* strides, int leading_dims, int64_t rows, int64_t* out) {
  fk::RowLayout layout;
  if (!fk::collapse_rows(sizes, strides, leading_dims, &layout)) return 0;
  for (int64_t r = 0; r < rows; ++r) out[r] = layout.offset(r);
  return 1;
}

// activation: 0 silu, 1 gelu, 2 gelu_tanh
void fk_activation(int activation, const float* x, float* f, float* df, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    switch (activation) {
      case 0:
        f[i] = fk::Act<fk::Activation::silu>::f(x[i]);
        df[i] = fk::Act<fk::Activation::silu>::df(x[i]);
        break;
      case 1:
        f[i] = fk::Act<fk::Activation::gelu>::f(x[i]);
        df[i] = fk::Act<fk::Activation::gelu>::df(x[i]);
        break;
      default:
        f[i] = fk::Act<fk::Activation::gelu_tanh>::f(x[i]);
        df[i] = fk::Act<fk::Activation::gelu_tanh>::df(x[i]);
    }
  }
}

// out: (a, b, s) per pair of log-sum-exps
void fk_merge_weights(const float* s_a, const float* s_b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const fk::MergeWeights w = fk::merge_weights(s_a[i], s_b[i]);
    out[3 * i] = w.a, out[3 * i + 1] = w.b, out[3 * i + 2] = w.s;
  }
}

// out: (scale, lse) per state s and sink logit, with out_scale
void fk_final_state(const float* s, const float* sink, float out_scale, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const fk::FinalState f = fk::final_state(s[i], sink[i], out_scale);
    out[2 * i] = f.scale, out[2 * i + 1] = f.lse;
  }
}

// out: (visible_begin, visible_end, sees_chunk) of each query i of an item (kv_begin, kv_end, first, last)
void fk_visible(int32_t kv_begin, int32_t kv_end, int32_t first, int32_t last, const int32_t* i, int32_t* out,
                int64_t n) {
  fk::AttentionWorkItem item{};
  item.kv_begin = kv_begin, item.kv_end = kv_end, item.first = first, item.last = last;
  for (int64_t j = 0; j < n; ++j) {
    out[3 * j] = fk::visible_begin(item, i[j]);
    out[3 * j + 1] = fk::visible_end(item, i[j]);
    out[3 * j + 2] = fk::sees_chunk(item, i[j]);
  }
}

// q, r: n / d and n % d for every n
void fk_divmod(uint32_t d, const uint32_t* n, uint32_t* q, uint32_t* r, int64_t count) {
  const fk::Divmod div(d);
  for (int64_t i = 0; i < count; ++i) div.divmod(n[i], q[i], r[i]);
}

// The kernels' online softmax over natural-log logits x[0..n), fed `tile` at a time (base 2,
// pre-scaled by log2 e); out: (m, l, lse). Also the weights: w[i] = exp(x[i] - lse) as the kernels
// normalize them at the end.
void fk_online_softmax(const float* x, int64_t n, int64_t tile, float* out, float* w) {
  float m = -INFINITY, l = 0.f;
  for (int64_t start = 0; start < n; start += tile) {
    const int64_t end = start + tile < n ? start + tile : n;
    float tile_max = -INFINITY;
    for (int64_t i = start; i < end; ++i) tile_max = fmaxf(tile_max, x[i] * fk::kLog2e);
    l *= fk::softmax_rescale(m, tile_max);
    for (int64_t i = start; i < end; ++i) l += fk::softmax_weight(x[i] * fk::kLog2e, m);
  }
  out[0] = m, out[1] = l, out[2] = fk::state_lse(m, l);
  for (int64_t i = 0; i < n; ++i) w[i] = l > 0.f ? fk::softmax_weight(x[i] * fk::kLog2e, m) / l : 0.f;
}

// Philox4x32-10 of one counter and key (out: 4 words), and the sampling kernels' uniforms:
// out[i] = RowRandom(seed, offset, row).uniform(i).
void fk_philox(const uint32_t* counter, uint32_t key0, uint32_t key1, uint32_t* out) {
  const fk::Philox4 r = fk::philox4x32_10({{counter[0], counter[1], counter[2], counter[3]}}, key0, key1);
  for (int i = 0; i < 4; ++i) out[i] = r.v[i];
}
void fk_uniforms(uint64_t seed, uint64_t offset, uint32_t row, float* out, int64_t n) {
  const fk::RowRandom random(seed, offset, row);
  for (int64_t i = 0; i < n; ++i) out[i] = random.uniform(uint32_t(i));
}

}  // extern "C"
