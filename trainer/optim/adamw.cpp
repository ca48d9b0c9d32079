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

std::vector<AdamW::Owned> AdamW::owned_elements(const ParameterTable& table, const ShardLayout* shards, int rank) {
  std::vector<Owned> owned;
  size_t state = 0;
  for (size_t i = 0; i < table.specs().size(); ++i) {
    const size_t begin = shards != nullptr ? shards->shard_begin(i, rank) : 0;
    const size_t numel = shards != nullptr ? shards->shard_numel(i, rank) : table.specs()[i].numel;
    owned.push_back(Owned{begin, numel, state});
    state += numel;
  }
  return owned;
}

size_t AdamW::state_numel(const std::vector<Owned>& owned) {
  return owned.empty() ? 0 : owned.back().state_offset + owned.back().numel;
}

AdamW::AdamW(Backend& backend, const ParameterTable& table, const common::TrainConfig& train,
             const ShardLayout* shards, int shard_rank)
    : backend_(backend),
      table_(table),
      train_(train),
      owned_(owned_elements(table, shards, shard_rank)),
      m_(backend, state_numel(owned_)),
      v_(backend, state_numel(owned_)) {}

float AdamW::step(float* params, const float* grads, float lr, int64_t step) {
  // The gaps between tensors in the flat buffer hold zero gradients, so the
  // norm over the whole buffer is the norm over the tensors.
  const double norm = std::sqrt(backend_.sum_squares(grads, table_.total()));
  // Same rule as torch.nn.utils.clip_grad_norm_.
  float scale = 1.0f;
  if (train_.grad_clip > 0) scale = static_cast<float>(std::min(1.0, train_.grad_clip / (norm + 1e-6)));
  for (size_t i = 0; i < owned_.size(); ++i) {
    const ParamSpec& spec = table_.specs()[i];
    const Owned& own = owned_[i];
    if (own.numel == 0) continue;
    const float decay = spec.weight_decay() ? static_cast<float>(train_.weight_decay) : 0.0f;
    const size_t at = spec.offset + own.begin;
    backend_.adamw_update(params + at, grads + at, m_.data() + own.state_offset, v_.data() + own.state_offset,
                          own.numel, lr, static_cast<float>(train_.beta1), static_cast<float>(train_.beta2),
                          static_cast<float>(train_.eps), decay, scale, step + 1);
  }
  return static_cast<float>(norm);
}

}  // namespace keel::trainer
