// The gating activations of the *_and_mul ops and their derivatives, in fp32, host and device.
#pragma once

#include <cmath>

#include "flashkern/platform.h"

namespace fk {

enum class Activation : int { silu = 0, gelu = 1, gelu_tanh = 2 };

template <Activation A>
struct Act;

template <>
struct Act<Activation::silu> {  // x * sigmoid(x)
  FK_HOST_DEVICE static float f(float x) { return x / (1.f + expf(-x)); }
  FK_HOST_DEVICE static float df(float x) {
    const float s = 1.f / (1.f + expf(-x));
    return s * (1.f + x * (1.f - s));
  }
};

template <>
struct Act<Activation::gelu> {  // x * Phi(x), the exact (erf) form
  FK_HOST_DEVICE static float f(float x) { return 0.5f * x * (1.f + erff(x * 0.70710678118654752f)); }
  FK_HOST_DEVICE static float df(float x) {
    const float cdf = 0.5f * (1.f + erff(x * 0.70710678118654752f));
    const float pdf = 0.39894228040143268f * expf(-0.5f * x * x);
    return cdf + x * pdf;
  }
};

template <>
struct Act<Activation::gelu_tanh> {  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  static constexpr float kAlpha = 0.79788456080286536f;  // sqrt(2 / pi)
  static constexpr float kBeta = 0.044715f;
  FK_HOST_DEVICE static float f(float x) {
    return 0.5f * x * (1.f + tanhf(kAlpha * (x + kBeta * x * x * x)));
  }
  FK_HOST_DEVICE static float df(float x) {
    const float t = tanhf(kAlpha * (x + kBeta * x * x * x));
    return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kAlpha * (1.f + 3.f * kBeta * x * x);
  }
};

}  // namespace fk
