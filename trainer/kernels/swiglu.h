// SwiGLU's activation, per element: one formula for the CPU and CUDA
// backends (as gelu.h is for GELU), each passing its own exp, clamped to
// [-87, 88] like GELU's so that a large negative gate gives 0, not NaN.
// silu(g) = g * sigmoid(g); silu'(g) = s (1 + g (1 - s)), s = sigmoid(g).
#pragma once

#include "trainer/kernels/host_device.h"

namespace keel::trainer {

template <class Exp>
KEEL_HOST_DEVICE inline float sigmoid(float x, Exp exp) {
  return 1.0f / (1.0f + exp(-x));
}

// silu(gate) * up.
template <class Exp>
KEEL_HOST_DEVICE inline float swiglu(float gate, float up, Exp exp) {
  return gate * sigmoid(gate, exp) * up;
}

// The gradients of gate and up from that of swiglu(gate, up).
template <class Exp>
KEEL_HOST_DEVICE inline void swiglu_grad(float gate, float up, float dout, Exp exp, float* dgate, float* dup) {
  const float s = sigmoid(gate, exp);
  const float silu = gate * s;
  *dgate = dout * up * (s * (1.0f + gate * (1.0f - s)));
  *dup = dout * silu;
}

}  // namespace keel::trainer
