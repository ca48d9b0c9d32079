// Rotary positions, per channel pair: one formula for the CPU and CUDA
// backends. Hugging Face's rotate-half convention pairs channel j of a head
// with channel j + d/2 (Meta's checkpoints pair 2j with 2j + 1; Hugging
// Face permutes q_proj and k_proj rows so the two give the same scores).
#pragma once

#include "trainer/kernels/host_device.h"

namespace keel::trainer {

// (x1, x2) turned by the angle of cosine c and sine s; kBackward turns
// by minus the angle, the transpose, which is the backward of the turn.
template <bool kBackward>
KEEL_HOST_DEVICE inline void rotate_pair(float& x1, float& x2, float c, float s) {
  if constexpr (kBackward) s = -s;
  const float a = x1 * c - x2 * s;
  const float b = x2 * c + x1 * s;
  x1 = a;
  x2 = b;
}

}  // namespace keel::trainer
