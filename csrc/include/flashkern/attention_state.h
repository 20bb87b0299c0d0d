// Attention states and how two of them merge. A state (v, s) of a query over a set of keys holds
// v = sum_j softmax_j * value_j and s = log(sum_j exp(logit_j)), the natural-log sum-exp of the
// scaled logits (as FlashAttention, vLLM and torch.logsumexp; FlashInfer uses base 2). An empty
// key set is (0, -inf); merging with it is exact. Host-device: tests/test_host_code.py checks it.
//
// Inside the attention kernels a state is kept in base 2: logits are pre-scaled by
// sm_scale * log2(e), so every exponential is one exp2; m is the running maximum of those logits
// and l = sum_j exp2(logit_j - m). Natural-log s = (m + log2 l) * ln 2 leaves the kernel.
#pragma once

#include <cmath>

#include "flashkern/platform.h"

namespace fk {

struct MergeWeights {
  float a, b;  // v = a * v_a + b * v_b
  float s;     // the merged log-sum-exp
};

FK_HOST_DEVICE MergeWeights merge_weights(float s_a, float s_b) {
  if (s_a != s_a || s_b != s_b) return {NAN, NAN, NAN};  // NaN in, NaN out (never an "empty" state)
  const float m = s_a > s_b ? s_a : s_b;
  if (m == -INFINITY) return {0.f, 0.f, -INFINITY};  // both empty
  const float e_a = expf(s_a - m), e_b = expf(s_b - m);  // the larger one is exactly 1
  const float sum = e_a + e_b;
  return {e_a / sum, e_b / sum, m + logf(sum)};
}

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// exp2(x - m) for a weight relative to the running maximum m. While everything seen is masked
// (m = -inf) the reference is 0 instead: a masked logit weighs 0 instead of exp2(-inf + inf) = NaN,
// and a NaN logit still weighs NaN, so it reaches l and the values even when the maxima (fmaxf)
// skipped it. The select is on m only, so it leaves the loop over logits.
FK_HOST_DEVICE float softmax_weight(float x, float m) { return exp2f(x - (m == -INFINITY ? 0.f : m)); }

// Raises the running maximum m to include `tile_max` and returns the factor exp2(m_old - m_new)
// by which l and the accumulated values must be multiplied (1 while everything is masked).
FK_HOST_DEVICE float softmax_rescale(float& m, float tile_max) {
  const float m_new = m > tile_max ? m : tile_max;
  const float alpha = softmax_weight(m, m_new);
  m = m_new;
  return m_new == -INFINITY ? 1.f : alpha;
}

// The natural-log sum-exp of a base-2 state; an empty one (l = 0) is -inf, a NaN stays NaN.
FK_HOST_DEVICE float state_lse(float m, float l) { return l == 0.f ? -INFINITY : (m + log2f(l)) * kLn2; }

// The end of a query's attention: its state (v, s) over all its keys merged with its head's sink, a
// key of logit `sink` (already scaled, natural log: -inf for none) whose value is zero, as GPT-OSS and
// FlashInfer define sinks; out = v * scale, and lse = log(exp(s) + exp(sink)) includes the sink.
// out_scale multiplies every output (FlashInfer's v_scale).
struct FinalState {
  float scale, lse;
};
FK_HOST_DEVICE FinalState final_state(float s, float sink, float out_scale) {
  if (sink == -INFINITY) return {out_scale, s};
  if (sink == INFINITY && s == s) return {0.f, INFINITY};  // the sink takes all the weight (not inf - inf)
  const MergeWeights w = merge_weights(s, sink);
  return {w.a * out_scale, w.s};
}

}  // namespace fk
