// The single-rank training loop: batches from the dataset, microbatched
// forward/backward, clipping and AdamW, periodic validation, metrics and
// progress with ETA.
#pragma once

#include "common/config.h"
#include "trainer/comm/communicator.h"
#include "trainer/data/dataset.h"
#include "trainer/kernels/backend.h"
#include "trainer/model/gpt.h"
#include "trainer/optim/adamw.h"
#include "trainer/parallel/shard_layout.h"
#include "trainer/train/metrics.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace keel::trainer {

struct StepStats {
  int64_t step = 0;
  float loss = 0;       // mean cross-entropy over the step's microbatches
  float aux_loss = 0;   // mean MoE load-balancing loss
  float grad_norm = 0;  // before clipping
  double lr = 0;
  double step_ms = 0;
};

// Bytes this rank holds for the model's state (DESIGN §3.4's ZeRO formulas
// count these three).
struct MemoryUse {
  size_t params = 0;
  size_t grads = 0;
  size_t optimizer = 0;
};

struct RunSummary {
  int64_t steps_done = 0;
  bool stopped_early = false;         // a stop was requested before the last step
  float final_train_loss = 0;         // last step's loss
  std::optional<float> final_val_loss;
  int64_t tokens = 0;
  double wall_s = 0;
  double tokens_per_s = 0;
  MemoryUse memory;
};

class TrainLoop {
 public:
  // Opens the datasets (Error kDataError on bad shards), builds and
  // initialises the model from job.seed. `dp` is the data-parallel group
  // (nullptr: a single rank): each DP rank trains its slice of every global
  // batch and the gradients are summed over the group before the optimizer
  // step, so every replica applies the same update. With parallel.zero = 1
  // each rank holds the optimizer state of its shard of every tensor only,
  // updates that shard and all-gathers the parameters.
  TrainLoop(const common::Config& config, Backend& backend, Communicator* dp = nullptr);

  Gpt& model() { return model_; }
  MemoryUse memory() const;

  // One optimizer step on the batch of global step `step`; loss and
  // gradient norm are the same on every DP rank.
  StepStats train_step(int64_t step);

  // Mean cross-entropy over train.val_batches validation batches; needs
  // data.val (run() validates only when it is set).
  float validate();

  // Trains train.steps steps, logging progress and writing metrics.jsonl;
  // returns after the current step once `stop` becomes true.
  RunSummary run(const std::atomic<bool>& stop);

 private:
  // Sums gradients over the DP group in buckets of kAllReduceBucketFloats.
  void all_reduce_gradients();
  // ZeRO: every rank's updated shards into every rank's parameters.
  void all_gather_parameters();

  common::Config config_;
  Backend& backend_;
  Communicator* dp_;
  int dp_rank_;
  int dp_size_;
  TokenDataset train_;
  std::optional<TokenDataset> val_;
  int micro_batch_;
  Gpt model_;
  std::optional<ShardLayout> shards_;  // set with ZeRO >= 1 and a DP group
  AdamW optimizer_;
  BackendArray<float> packed_, gathered_;  // ZeRO parameter all-gather buffers
  std::vector<int32_t> inputs_, targets_;
};

}  // namespace keel::trainer
