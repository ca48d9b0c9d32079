// AdamW with global-norm gradient clipping (DESIGN §3.1), and the learning
// rate schedule: linear warmup, then cosine decay to lr * min_lr_ratio.
#pragma once

#include "common/config.h"
#include "trainer/kernels/backend.h"
#include "trainer/kernels/backend_array.h"
#include "trainer/model/parameters.h"

#include <cstdint>

namespace keel::trainer {

// The learning rate of optimizer step `step` (0-based).
double learning_rate(const common::TrainConfig& train, int64_t step);

class AdamW {
 public:
  // Allocates the first and second moments, zeroed, in backend memory.
  AdamW(Backend& backend, const ParameterTable& table, const common::TrainConfig& train);

  // Clips the gradients to train.grad_clip by global norm and applies one
  // AdamW update at `lr` as optimizer step `step` (0-based). Returns the
  // global gradient norm before clipping.
  float step(float* params, const float* grads, float lr, int64_t step);

 private:
  Backend& backend_;
  const ParameterTable& table_;
  common::TrainConfig train_;
  BackendArray<float> m_, v_;
};

}  // namespace keel::trainer
