// One optimizer step of a rank (docs/architecture.md "Optimizer and
// loop"), read top to bottom in Step::run: the microbatches' forwards and
// backwards through the stage's schedule, the gradient sums over the
// groups, the global norm, the SDC guard's verdict (a suspicious step is
// computed again before anything uses it) and AdamW. The fault hooks
// (StepFaults) and the SDC guard are objects it calls; the run around the
// steps (resume, checkpoints, validation, metrics) is TrainLoop's.
#pragma once

#include "common/config.h"
#include "health/board_publisher.h"
#include "health/fault_injector.h"
#include "trainer/data/data_mix.h"
#include "trainer/kernels/arena.h"
#include "trainer/kernels/backend.h"
#include "trainer/model/gpt.h"
#include "trainer/optim/adamw.h"
#include "trainer/parallel/process_groups.h"
#include "trainer/parallel/schedule.h"
#include "trainer/parallel/zero_storage.h"
#include "trainer/train/fault_hooks.h"
#include "trainer/train/sdc_guard.h"
#include "trainer/train/stage_executor.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
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
  // The SDC guard's score of the step against its window (SdcGuard::assess); none before the window is full.
  std::optional<double> anomaly_score;
  bool loss_spike = false;  // anomalous twice alike: the data did it, no hardware
  bool skipped = false;     // a loss spike whose update was not applied (health.spike_policy = "skip")
};

class Step {
 public:
  // What a step works on, all owned by the caller and outliving the Step.
  struct Parts {
    const common::Config& config;
    Backend& backend;
    const ProcessGroups& groups;
    const std::vector<Action>& schedule;  // this stage's actions in a step
    ZeroStorage& storage;
    AdamW& optimizer;
    Gpt& model;
    const DataMix& train;
    health::BoardPublisher& board;
    const health::FaultInjector& faults;
    SdcGuard& sdc;
  };
  // The step's working arrays, placed in the rank's one Arena with the
  // model's (lay_out) before the Step exists.
  struct Buffers {
    // The norms' gradients, summed over TP in one all-reduce (sequence parallelism).
    ArenaArray<float> tp_partial_grads;
    // The other stage's gradient of the tied token embedding (pipelines).
    ArenaArray<float> tied_grads;
    size_t bytes() const { return tp_partial_grads.bytes() + tied_grads.bytes(); }
  };
  static Buffers lay_out(Arena& arena, const ZeroStorage& storage, const ProcessGroups& groups);

  // Registers the fault and SDC hooks on parts.storage and parts.model.
  // Error(kBadConfig) when [faults] names a site the model has not.
  Step(Parts parts, Buffers buffers, int micro_batch);

  // One optimizer step on the batch of global step `step`; loss and
  // gradient norm are the same on every rank.
  StepStats run(int64_t step);

  // Writes the summed gradients of the first step to `dir`, each rank the
  // part it owns (rank-NNNNN.json), for layout parity checks.
  void dump_first_gradients(std::filesystem::path dir, int rank);
  // The last step's tokens per expert of each MoE block, over the whole batch (metrics.jsonl's expert_tokens).
  const nlohmann::json& expert_tokens() const { return expert_tokens_; }
  // The training schedules' time over all steps so far.
  const StageTime& schedule_time() const { return schedule_time_; }
  size_t working_bytes() const { return buffers_.bytes(); }

 private:
  // Forward, backward and the gradient sums of `step`'s batch, up to the
  // global norm; the parameters stay untouched, so it can run again.
  struct Gradients {
    StepSignals signals;  // the loss, the norm and what the SDC guard judges them by
    float aux_loss = 0;
  };
  Gradients compute_gradients(int64_t step);
  // An attempt's scalars wait for the device once (docs/architecture.md
  // "GPU step"): each is queued on the backend as it appears (each
  // microbatch's loss after its forward, the SDC fingerprints as gradients
  // and activations appear, the norm's squares per tensor at the end) and
  // all are taken together, in queue order.
  enum class Queued { kLoss, kGradients, kActivations, kSquares, kExpertSquares };
  struct QueuedSum {
    Queued kind;
    int positions = 0;  // kLoss: the positions its sum averages over
  };
  void queue_fingerprint(Queued kind, ConstBuffer data, size_t numel);
  void queue_loss(int slot);
  void queue_norm_squares();
  // The queued sums taken: the fingerprints handed to the SDC guard, the
  // losses (each microbatch's mean, as Gpt::loss gives it) and the norm's
  // squares summed.
  struct TakenSums {
    double loss = 0, squares = 0, expert_squares = 0;
  };
  TakenSums take_queued();
  // Time this rank spent inside collectives since the step began.
  int64_t collective_wait_ns() const;
  // How many MoE blocks come before block `layer`.
  int64_t moe_layers_before(int64_t layer) const;
  // Sums the gradients that sequence parallelism leaves partial over TP.
  void sum_norm_gradients_over_tp();
  // Gives both copies of the tied token embedding (first and last stage)
  // the sum of their gradients.
  void sum_tied_gradients();
  // The step's scalars summed over the world, the same on every rank: the
  // loss and aux loss sums, the squared gradient norm and the activation
  // squares (StepSignals).
  struct StepSums {
    double loss = 0, aux_loss = 0, grad_squares = 0, activation_squares = 0;
  };
  StepSums sum_step_scalars(double loss_sum, double aux_sum, double squares, double expert_squares);
  // Clips by `norm` and applies AdamW to the owned parts.
  void apply_update(float lr, double norm, int64_t step);
  void write_gradients(int64_t step);

  Parts p_;
  const ParameterTable& table_;
  const ModelStage& stage_;
  Buffers buffers_;
  int micro_batch_;
  StepFaults faults_;
  // Whether the forward now running feeds the SDC guard its activation squares.
  bool judging_activations_ = false;
  std::vector<QueuedSum> queued_;  // what each sum queued on the backend is
  bool attempting_ = false;        // inside compute_gradients, until its sums are taken
  std::vector<int32_t> inputs_, targets_;
  std::filesystem::path gradient_dump_dir_;
  int gradient_dump_rank_ = 0;
  StageTime schedule_time_;
  nlohmann::json expert_tokens_ = nlohmann::json::array();
};

}  // namespace keel::trainer
