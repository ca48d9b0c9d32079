// GELU, tanh form, per element: one formula for the CPU and CUDA backends
// (as adamw_step.h is for AdamW), each passing its own exp: the CPU its
// vectorisable polynomial, CUDA expf. Both clamp the argument to [-87, 88]
// so that the backward's e * s stays finite instead of becoming inf * 0.
//
// 0.5 x (1 + tanh u) is written as x * sigmoid(2u): the same function, but
// without the cancellation of 1 + tanh u for negative u, and needing only
// one exp.
#pragma once

#include "trainer/kernels/host_device.h"

namespace keel::trainer {

inline constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
inline constexpr float kGeluCubic = 0.044715f;

// exp(-2u) of x, u = sqrt(2/pi) (x + 0.044715 x^3).
template <class Exp>
KEEL_HOST_DEVICE inline float gelu_exp(float x, Exp exp) {
  const float u = kGeluScale * (x + kGeluCubic * (x * x * x));
  return exp(-2.0f * u);
}

template <class Exp>
KEEL_HOST_DEVICE inline float gelu(float x, Exp exp) {
  return x / (1.0f + gelu_exp(x, exp));
}

// d gelu / dx = s + 2 x s (1 - s) u' with s = sigmoid(2u), 1 - s = e s.
template <class Exp>
KEEL_HOST_DEVICE inline float gelu_grad(float x, Exp exp) {
  const float e = gelu_exp(x, exp);
  const float s = 1.0f / (1.0f + e);
  const float du = kGeluScale * (1.0f + 3.0f * kGeluCubic * (x * x));
  return s + 2.0f * x * du * (e * s) * s;
}

}  // namespace keel::trainer
