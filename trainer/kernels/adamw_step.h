// One AdamW step's arithmetic, shared by every backend so that they agree
// to the bit: the scalars are formed once per call in double on the host,
// and the per-element update is one inline function that the host
// compiler and nvcc both compile. The order of operations is
// torch.optim.AdamW's (single-tensor), so the PyTorch oracle agrees to
// the last bit or two.
#pragma once

#include "trainer/kernels/host_device.h"

#include <cmath>
#include <cstddef>
#include <cstdint>


namespace keel::trainer {

struct AdamwStep {
  float step_size;        // lr / (1 - beta1^t)
  float bias2_sqrt;       // sqrt(1 - beta2^t)
  float decay;            // 1 - lr * weight_decay
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float grad_scale;       // the gradients are multiplied by this first (clipping)

  // The scalars of step t (1-based).
  static AdamwStep at(float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale,
                      int64_t t) {
    const double bias1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(t));
    const double bias2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(t));
    return {static_cast<float>(static_cast<double>(lr) / bias1),
            static_cast<float>(std::sqrt(bias2)),
            static_cast<float>(1.0 - static_cast<double>(lr) * weight_decay),
            static_cast<float>(1.0 - static_cast<double>(beta1)),
            beta2,
            static_cast<float>(1.0 - static_cast<double>(beta2)),
            eps,
            grad_scale};
  }

  // Updates element i of the parameters and both moments; returns the new
  // parameter (which the caller may also round into the GEMMs' bf16 copy).
  KEEL_HOST_DEVICE float apply(float* params, const float* grads, float* m, float* v, size_t i) const {
    const float g = grads[i] * grad_scale;
    const float p = params[i] * decay;
    const float mi = m[i] + one_minus_beta1 * (g - m[i]);  // torch's lerp
    const float vi = v[i] * beta2 + one_minus_beta2 * g * g;
    const float denom = sqrtf(vi) / bias2_sqrt + eps;
    m[i] = mi;
    v[i] = vi;
    params[i] = p - step_size * (mi / denom);
    return params[i];
  }
};

}  // namespace keel::trainer
