// AdamW with global-norm gradient clipping (DESIGN §3.1), and the learning
// rate schedule: linear warmup, then cosine decay to lr * min_lr_ratio.
#pragma once

#include "common/config.h"
#include "trainer/kernels/backend.h"
#include "trainer/kernels/backend_array.h"
#include "trainer/model/parameters.h"
#include "trainer/parallel/shard_layout.h"

#include <cstdint>
#include <vector>

namespace keel::trainer {

// The learning rate of optimizer step `step` (0-based).
double learning_rate(const common::TrainConfig& train, int64_t step);

class AdamW {
 public:
  // Allocates the first and second moments, zeroed, in backend memory:
  // for every element, or (ZeRO-1 and up, `shards` non-null) for this
  // rank's shard of every tensor only.
  AdamW(Backend& backend, const ParameterTable& table, const common::TrainConfig& train,
        const ShardLayout* shards = nullptr, int shard_rank = 0);

  // Clips the gradients (the whole flat buffer, summed over DP already) to
  // train.grad_clip by global norm and applies one AdamW update at `lr` as
  // optimizer step `step` (0-based) to the elements whose state this rank
  // holds; with shards, the caller gathers the other ranks' updates.
  // Returns the global gradient norm before clipping.
  float step(float* params, const float* grads, float lr, int64_t step);

  // Bytes of optimizer state this rank holds (both moments).
  size_t state_bytes() const { return m_.bytes() + v_.bytes(); }

 private:
  // The elements of tensor i this rank updates: [begin, begin + numel) of
  // the tensor, with their moments at state_offset in m_ and v_.
  struct Owned {
    size_t begin, numel, state_offset;
  };
  static std::vector<Owned> owned_elements(const ParameterTable& table, const ShardLayout* shards, int rank);
  static size_t state_numel(const std::vector<Owned>& owned);

  Backend& backend_;
  const ParameterTable& table_;
  common::TrainConfig train_;
  std::vector<Owned> owned_;
  BackendArray<float> m_, v_;
};

}  // namespace keel::trainer
