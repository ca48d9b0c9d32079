#include "trainer/optim/adamw.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace keel::trainer {

double learning_rate(const common::TrainConfig& train, int64_t step) {
  if (step < train.warmup_steps) return train.lr * static_cast<double>(step + 1) / train.warmup_steps;
  const double min_lr = train.lr * train.min_lr_ratio;
  const int64_t decay_steps = train.steps - train.warmup_steps;
  if (decay_steps <= 1) return train.lr;
  const double progress = std::min(1.0, static_cast<double>(step - train.warmup_steps) / (decay_steps - 1));
  return min_lr + 0.5 * (train.lr - min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

AdamW::AdamW(Backend& backend, const ParameterTable& table, const common::TrainConfig& train)
    : backend_(backend), table_(table), train_(train), m_(backend, table.total()), v_(backend, table.total()) {}

float AdamW::step(float* params, const float* grads, float lr, int64_t step) {
  // The gaps between tensors in the flat buffer hold zero gradients, so the
  // norm over the whole buffer is the norm over the tensors.
  const double norm = std::sqrt(backend_.sum_squares(grads, table_.total()));
  // Same rule as torch.nn.utils.clip_grad_norm_.
  float scale = 1.0f;
  if (train_.grad_clip > 0) scale = static_cast<float>(std::min(1.0, train_.grad_clip / (norm + 1e-6)));
  for (const ParamSpec& spec : table_.specs()) {
    const float decay = spec.weight_decay() ? static_cast<float>(train_.weight_decay) : 0.0f;
    backend_.adamw_update(params + spec.offset, grads + spec.offset, m_.data() + spec.offset, v_.data() + spec.offset,
                          spec.numel, lr, static_cast<float>(train_.beta1), static_cast<float>(train_.beta2),
                          static_cast<float>(train_.eps), decay, scale, step + 1);
  }
  return static_cast<float>(norm);
}

}  // namespace keel::trainer
