// The training loop of one rank: batches from the dataset, microbatched
// forward/backward, the gradient sums of its DP and TP groups, clipping and
// AdamW, periodic validation, metrics and progress with ETA.
#pragma once

#include "checkpoint/checkpointer.h"
#include "checkpoint/piece.h"
#include "checkpoint/reader.h"
#include "common/config.h"
#include "common/store.h"
#include "health/board_publisher.h"
#include "health/fault_injector.h"
#include "trainer/comm/communicator.h"
#include "trainer/data/dataset.h"
#include "trainer/kernels/backend.h"
#include "trainer/model/gpt.h"
#include "trainer/optim/adamw.h"
#include "trainer/parallel/process_groups.h"
#include "trainer/parallel/schedule.h"
#include "trainer/parallel/zero_storage.h"
#include "trainer/train/fault_hooks.h"
#include "trainer/train/metrics.h"
#include "trainer/train/sdc_guard.h"
#include "trainer/train/stage_executor.h"

#include <atomic>
#include <filesystem>
#include <functional>
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
  // The SDC guard's score of the step against its window (SdcGuard::assess); none before the window is full.
  std::optional<double> anomaly_score;
  bool loss_spike = false;  // anomalous twice alike: the data did it, no hardware
  bool skipped = false;     // a loss spike whose update was not applied (health.spike_policy = "skip")
};

// Bytes this rank holds for the model's state: docs/architecture.md "Parallel layout and communication"'s ZeRO formulas
// count the first three; `working` carries units to and from collectives.
struct MemoryUse {
  size_t params = 0;
  size_t grads = 0;
  size_t optimizer = 0;
  size_t working = 0;
  size_t total = 0;  // the one allocation: all of the above and the activations
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
  int64_t first_step = 0;          // where training started (a resumed run: the checkpoint's step)
  bool final_checkpoint_failed = false;
  std::string parameter_digest;    // XXH3 of the parameters this rank holds, after the last step
  // This rank's training schedules over the run: time computing and time
  // in all. Every stage starts a step's schedule together and the first
  // stage ends it (its last backward is the pipeline's last), so a stage's
  // idle share of the pipeline is 1 - compute_s / the first stage's total_s.
  StageTime schedules;
};

// Who this rank is in the run, for checkpoints: its global rank and the
// Store the ranks report through (nullptr with one rank); and the progress
// board keeld reads (nullptr: none, a rank run by hand).
struct RankContext {
  common::Store* store = nullptr;
  int rank = 0;
  int world_size = 1;
  int64_t generation = 0;
  health::BoardPublisher* board = nullptr;
};

class TrainLoop {
 public:
  // Opens the datasets (Error kDataError on bad shards), builds and
  // initialises this rank's part of the model from job.seed.
  // `groups` are the rank's process groups (none: a single rank), which
  // must outlive the loop. Each DP rank trains its slice of every global
  // batch and the gradients are summed over dp x cp, as parallel.zero says
  // (see ZeroStorage), so every replica applies the same update; the TP
  // ranks train the same sequences on their slices of the model (see Gpt).
  TrainLoop(const common::Config& config, Backend& backend, const ProcessGroups& groups = ProcessGroups::none(),
            RankContext rank = {});

  Gpt& model() { return model_; }
  ZeroStorage& storage() { return storage_; }
  MemoryUse memory() const;

  // Writes the summed gradients of the first step to `dir`, each rank the
  // part it owns (rank-NNNNN.json), for layout parity checks.
  void dump_first_gradients(std::filesystem::path dir, int rank);

  // Checkpoints (docs/architecture.md "Checkpoints"): with checkpoint.every_steps or every_seconds
  // set, run() saves into config.checkpoint_dir() on that schedule and once
  // more when it ends or stops.
  bool checkpoints_enabled() const;
  // Chooses where training starts and loads it (docs/architecture.md
  // "Resume and retention"): the run's newest committed checkpoint that
  // verifies (checkpoint.verify); when there is none, checkpoint.init_from
  // ("" or "none": step 0, or a checkpoint directory of any layout). When the
  // run's checkpoints exist but none loads, only an explicit init_from
  // starts it elsewhere; otherwise Error(kCheckpointFailure) names each one
  // and why. Rank 0 decides and records skipped ones as events; the others
  // follow through the Store.
  void resume();
  // Loads the checkpoint in `dir`, whatever layout wrote it, and makes
  // run() continue from its step; `verified`: its checksums were checked
  // already. Throws Error(kBadConfig) naming the tensors and model keys when
  // its shapes differ from this model's, Error(kCheckpointFailure) when it
  // does not load.
  void restore(const std::filesystem::path& dir, bool verified = false);
  // Abandons the checkpoint commit in flight and any later one: a peer
  // failed, so its file will never be reported. Safe from any thread.
  void cancel_checkpoint(const std::string& cause);
  // The step training starts from: 0, or the step of the restored checkpoint.
  int64_t first_step() const { return start_step_; }
  // The rank's fault injector ([faults]); the communicators pass it too.
  const health::FaultInjector& faults() const { return faults_; }
  // XXH3-64 of the parameters this rank holds (16 hex digits).
  std::string parameter_digest();

  // One optimizer step on the batch of global step `step`; loss and
  // gradient norm are the same on every rank. A suspicious result is
  // computed again before it is applied (SdcGuard).
  StepStats train_step(int64_t step);

  struct Evaluation {
    float loss = 0;  // mean cross-entropy per token
    int64_t sequences = 0;
  };
  // Mean cross-entropy over the first `sequences` non-overlapping windows of
  // seq_len + 1 tokens of the token file at `path` (window i: tokens
  // i*(T+1) .. i*(T+1)+T; inputs its first T, targets its last T); -1: every
  // whole window. DP ranks split the windows. Throws Error(kDataError) when
  // the file is bad or holds fewer windows.
  Evaluation evaluate(const std::filesystem::path& path, int64_t sequences);

  // Mean cross-entropy over train.val_batches validation batches; needs
  // data.val (run() validates only when it is set).
  float validate();

  // Trains up to train.steps steps, logging progress and writing
  // metrics.jsonl; returns after the current step once `stop` becomes true
  // or `stop_after` steps are done (-1: never), as a stop request does.
  // A checkpoint request from keeld (through the board) saves after the
  // step in progress.
  RunSummary run(const std::atomic<bool>& stop, int64_t stop_after = -1);

 private:
  RunSummary train_until(const std::atomic<bool>& stop, int64_t stop_after);
  // Forward, backward and the gradient sums of `step`'s batch, up to the
  // global norm; the parameters stay untouched, so it can run again.
  struct Gradients {
    StepSignals signals;  // the loss, the norm and what the SDC guard judges them by
    float aux_loss = 0;
  };
  Gradients compute_gradients(int64_t step);
  // Time this rank spent inside collectives since the step began.
  int64_t collective_wait_ns() const;
  // The hooks of fault injection and of the SDC fingerprints.
  void on_local_gradients(int unit, float* grads, size_t numel);
  void flip_state_bit();
  // Where fault injection may flip a bit of `target`, by tensor (or block
  // output) name; Error(kBadConfig) when faults.bitflip_tensor names none.
  void describe_flip_sites();
  // What this rank's DP replicas hold identically (SdcGuard's digests).
  ReplicatedState replicated_state();
  // Sums `values` over the world in place, one grid axis after another.
  void sum_over_world(float* values, size_t count);
  // Runs the forwards of `microbatches` through the pipeline (validation,
  // evaluation): fill(mb) puts microbatch mb's tokens in inputs_ and
  // targets_, batch(mb) says how many sequences it has. Returns the sum of
  // each microbatch's mean loss times its sequences on the last stage, 0
  // on the others.
  double forward_pass(int microbatches, const std::function<int(int mb)>& batch,
                      const std::function<void(int mb)>& fill);
  // How many MoE blocks come before block `layer`.
  int64_t moe_layers_before(int64_t layer) const;
  // Sums a loss over the pipeline (only the last stage's is not 0) and the DP ranks.
  void sum_over_pipeline_and_dp(double* value);
  // Gives both copies of the tied token embedding (first and last stage)
  // the sum of their gradients.
  void sum_tied_gradients();
  // A block of a global tensor this rank saves or loads, and where its rows
  // live in this rank's memory.
  struct StateBlock {
    checkpoint::Piece piece;
    float* local;
  };
  // Saved: each DP rank its dim-0 shard of every tensor, a tensor
  // replicated over TP from TP rank 0 only, so every element is written
  // once. Held: everything this rank keeps (all it needs on a load).
  // `sections`: the checkpoint groups ("model", "optim/exp_avg", ...).
  std::vector<StateBlock> state_blocks(bool saved, const std::vector<std::string>& sections);
  // The checkpoint groups this run saves, and those it loads from `reader`.
  std::vector<std::string> saved_groups() const;
  std::vector<std::string> loaded_groups(const checkpoint::CheckpointReader& reader) const;
  void save_checkpoint(int64_t steps_done);
  // Rank 0's choice for resume(): {"dir", "verified"} or {"error"}.
  nlohmann::json choose_start();
  // Error(kBadConfig) unless the checkpoint holds exactly this model's
  // tensors at this model's global shapes.
  void check_shapes(const checkpoint::CheckpointReader& reader) const;
  // Sums the gradients that sequence parallelism leaves partial over TP.
  void sum_norm_gradients_over_tp();
  // The step's scalars summed over the world, the same on every rank: the
  // loss and aux loss sums, the squared gradient norm and the activation
  // squares (StepSignals).
  struct StepSums {
    double loss = 0, aux_loss = 0, grad_squares = 0, activation_squares = 0;
  };
  StepSums sum_step_scalars(double loss_sum, double aux_sum);
  // Clips by `norm` and applies AdamW to the owned parts.
  void apply_update(float lr, double norm, int64_t step);
  void write_gradients(int64_t step);
  // The loop's own working arrays, placed after the model's.
  struct Buffers {
    // The norms' gradients, summed over TP in one all-reduce (sequence parallelism).
    ArenaArray<float> tp_partial_grads;
    // The other stage's gradient of the tied token embedding (pipelines).
    ArenaArray<float> tied_grads;
  };
  // Places the storage, the optimizer, the model and the Buffers in state_memory_.
  Buffers lay_out_memory();

  common::Config config_;
  Backend& backend_;
  const ProcessGroups& groups_;
  int dp_rank_;
  int dp_size_;
  int tp_rank_;
  TokenDataset train_;
  std::optional<TokenDataset> val_;
  int micro_batch_;
  ModelStage stage_;
  // This stage's actions in a training step.
  std::vector<Action> schedule_;
  ParameterTable table_;
  // The memory of everything below, placed once (docs/architecture.md
  // "Memory") by lay_out_memory() when the last of it is initialised.
  // Declared first so it is freed last: ZeroStorage's destructor may still
  // be aborting collectives that write into it.
  std::unique_ptr<Arena> state_memory_;
  ZeroStorage storage_;
  AdamW optimizer_;
  Gpt model_;
  Buffers buffers_;
  std::vector<int32_t> inputs_, targets_;
  std::filesystem::path gradient_dump_dir_;
  int gradient_dump_rank_ = 0;
  RankContext rank_;
  health::BoardPublisher no_board_;
  health::BoardPublisher& board_;
  health::FaultInjector faults_;
  // Whether the forward now running feeds the SDC guard its activation squares.
  bool judging_activations_ = false;
  // Whether backward's unit 0 gradient gets a NaN ([faults] nan_target = "gradient").
  bool poison_gradient_ = false;
  std::vector<health::FaultInjector::Site> tensor_sites_, owned_sites_, activation_sites_;
  SdcGuard sdc_;
  CheckpointFaults checkpoint_faults_;
  std::optional<checkpoint::Checkpointer> checkpointer_;
  int64_t start_step_ = 0;
  int64_t last_saved_step_ = -1;
  StageTime schedule_time_;  // the training schedules' time over the run
  // The last step's tokens per expert of each MoE block of the model, over
  // the whole batch (metrics.jsonl's expert_tokens).
  nlohmann::json step_expert_tokens_ = nlohmann::json::array();
};

}  // namespace keel::trainer
