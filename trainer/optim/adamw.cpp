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

namespace {

std::vector<size_t> every_element(const ParameterTable& table, std::vector<size_t> owned_numel) {
  if (!owned_numel.empty()) return owned_numel;
  for (const auto& spec : table.specs()) owned_numel.push_back(spec.numel);
  return owned_numel;
}

std::vector<size_t> prefix_sums(const std::vector<size_t>& sizes) {
  std::vector<size_t> offsets(sizes.size() + 1, 0);
  for (size_t i = 0; i < sizes.size(); ++i) offsets[i + 1] = offsets[i] + sizes[i];
  return offsets;
}

}  // namespace

AdamW::AdamW(Backend& backend, const ParameterTable& table, const common::TrainConfig& train,
             std::vector<size_t> owned_numel)
    : backend_(backend),
      table_(table),
      train_(train),
      owned_numel_(every_element(table, std::move(owned_numel))),
      state_offset_(prefix_sums(owned_numel_)) {}

void AdamW::lay_out(Arena& arena) {
  m_ = arena.take<float>(state_offset_.back());
  v_ = arena.take<float>(state_offset_.back());
}

float AdamW::clip_scale(double norm) const {
  if (train_.grad_clip <= 0) return 1.0f;
  return static_cast<float>(std::min(1.0, train_.grad_clip / (norm + 1e-6)));
}

void AdamW::update(const std::vector<Part>& parts, float lr, float grad_scale, int64_t step) {
  std::vector<AdamwTensor> tensors;
  for (const Part& part : parts) {
    const size_t n = owned_numel_[part.t];
    if (n == 0) continue;
    const float decay = table_.specs()[part.t].weight_decay() ? static_cast<float>(train_.weight_decay) : 0.0f;
    tensors.push_back({part.params, part.grads, m_.data() + state_offset_[part.t], v_.data() + state_offset_[part.t], n,
                       decay, part.gemm_copy});
  }
  backend_.adamw_update(tensors, lr, static_cast<float>(train_.beta1), static_cast<float>(train_.beta2),
                        static_cast<float>(train_.eps), grad_scale, step + 1);
}

}  // namespace keel::trainer
