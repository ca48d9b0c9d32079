// AdamW with global-norm gradient clipping (docs/architecture.md "Model"), and the learning
// rate schedule: linear warmup, then cosine decay to lr * min_lr_ratio.
#pragma once

#include "common/config.h"
#include "trainer/kernels/backend.h"
#include "trainer/kernels/arena.h"
#include "trainer/params/parameters.h"

#include <cstdint>
#include <vector>

namespace keel::trainer {

// The learning rate of optimizer step `step` (0-based).
double learning_rate(const common::TrainConfig& train, int64_t step);

class AdamW {
 public:
  // Plans the first and second moments for owned_numel[t] elements of
  // every tensor t: the part of it this rank updates (all of it without
  // ZeRO). Empty: every element of every tensor. lay_out() places them,
  // zeroed, before any other call.
  AdamW(Backend& backend, const ParameterTable& table, const common::TrainConfig& train,
        std::vector<size_t> owned_numel = {});
  void lay_out(Arena& arena);

  // The factor that clips gradients of global norm `norm` to
  // train.grad_clip, as torch.nn.utils.clip_grad_norm_ computes it.
  float clip_scale(double norm) const;

  // The owned part of tensor t: params and grads point at its first
  // element; gemm_copy, when not null, at where the updated parameters go
  // rounded to bf16 as well (ZeroStorage::owned_gemm_copy).
  struct Part {
    size_t t;
    float* params;
    const float* grads;
    bf16* gemm_copy = nullptr;
  };
  // One AdamW update at `lr` as optimizer step `step` (0-based) of each
  // part, in one backend call; grads are multiplied by grad_scale first.
  void update(const std::vector<Part>& parts, float lr, float grad_scale, int64_t step);

  // The moments of the owned part of tensor t (owned_numel[t] floats each).
  float* exp_avg(size_t t) { return m_.data() + state_offset_[t]; }
  float* exp_avg_sq(size_t t) { return v_.data() + state_offset_[t]; }

  // Bytes of optimizer state this rank holds (both moments).
  size_t state_bytes() const { return m_.bytes() + v_.bytes(); }

 private:
  Backend& backend_;
  const ParameterTable& table_;
  common::TrainConfig train_;
  std::vector<size_t> owned_numel_;
  std::vector<size_t> state_offset_;
  ArenaArray<float> m_, v_;
};

}  // namespace keel::trainer
