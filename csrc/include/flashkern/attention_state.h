// Attention states and how two of them merge. A state (v, s) of a query over a set of keys holds
// v = sum_j softmax_j * value_j and s = log(sum_j exp(logit_j)), the natural-log sum-exp of the
// scaled logits (as FlashAttention, vLLM and torch.logsumexp; FlashInfer uses base 2). An empty
// key set is (0, -inf); merging with it is exact. Host-device: tests/test_host_code.py checks it.
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

}  // namespace fk
