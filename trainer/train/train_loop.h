// The training run of one rank: its memory, model and optimizer state,
// the steps (Step), periodic validation, checkpoints and resume, metrics
// and progress with ETA.
#pragma once

#include "common/config.h"
#include "health/board_publisher.h"
#include "health/fault_injector.h"
#include "trainer/comm/communicator.h"
#include "trainer/data/data_mix.h"
#include "trainer/kernels/backend.h"
#include "trainer/model/gpt.h"
#include "trainer/optim/adamw.h"
#include "trainer/parallel/process_groups.h"
#include "trainer/parallel/schedule.h"
#include "trainer/parallel/zero_storage.h"
#include "trainer/train/fault_hooks.h"
#include "trainer/train/metrics.h"
#include "trainer/train/rank_state.h"
#include "trainer/train/sdc_guard.h"
#include "trainer/train/stage_executor.h"
#include "trainer/train/step.h"

#include <atomic>
#include <filesystem>
#include <functional>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace keel::trainer {

// Bytes this rank holds for the model's state: docs/architecture.md "Parallel layout and communication"'s ZeRO formulas
// count params, grads and optimizer; `working` carries units to and from collectives.
struct MemoryUse {
  size_t params = 0;
  size_t gemm_copy = 0;  // the GEMMs' bf16 copy of the parameters (ZeroStorage)
  size_t grads = 0;
  size_t optimizer = 0;
  size_t working = 0;
  size_t total = 0;  // the one allocation: all of the above and the activations
  // The backend's own working buffers beside it (Backend::scratch_bytes),
  // as large as they grew by the summary's time.
  size_t backend_scratch = 0;
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
  void dump_first_gradients(std::filesystem::path dir, int rank) { step_.dump_first_gradients(std::move(dir), rank); }

  // Checkpoints and snapshots (RankState): with checkpoint.every_steps or
  // every_seconds set, run() saves into config.checkpoint_dir() on that
  // schedule and once more when it ends or stops. resume() chooses where
  // training starts and loads it, restore() loads a checkpoint of any
  // layout (main's --eval), cancel_checkpoint() abandons the commit in
  // flight when a peer failed (safe from any thread).
  void resume() { state_.resume(); }
  void restore(const std::filesystem::path& dir, bool verified = false) { state_.restore(dir, verified); }
  void cancel_checkpoint(const std::string& cause) { state_.cancel_checkpoint(cause); }
  // The step training starts from: 0, or the step of the state loaded.
  int64_t first_step() const { return state_.start_step(); }
  // The rank's fault injector ([faults]); the communicators pass it too.
  const health::FaultInjector& faults() const { return faults_; }
  // XXH3-64 of the parameters this rank holds (16 hex digits).
  std::string parameter_digest();

  // One optimizer step on the batch of global step `step`; loss and
  // gradient norm are the same on every rank. A suspicious result is
  // computed again before it is applied (SdcGuard).
  StepStats train_step(int64_t step) { return step_.run(step); }

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
  // Logs what the run trains, publishes its extent and tests the kernels
  // (the SDC guard).
  void begin_run(int64_t tokens_per_step);
  // Step `step`, between the fault hooks and the board's marks.
  StepStats run_step(int64_t step);
  // Its metrics.jsonl record, before validation and the collectives' counts.
  nlohmann::json step_record(int64_t step, const StepStats& stats, int64_t tokens, int64_t tokens_per_step);
  // Saves the end of the run (finished or stopped), agrees on whether the
  // save committed and fills in the summary's digest, memory and schedules.
  void finish_run(RunSummary& summary);
  // What this rank's DP replicas hold identically (SdcGuard's digests).
  ReplicatedState replicated_state();
  // Runs the forwards of `microbatches` through the pipeline (validation,
  // evaluation): fill(mb) puts microbatch mb's tokens in inputs_ and
  // targets_, batch(mb) says how many sequences it has. Returns the sum of
  // each microbatch's mean loss times its sequences on the last stage, 0
  // on the others.
  double forward_pass(int microbatches, const std::function<int(int mb)>& batch,
                      const std::function<void(int mb)>& fill);
  // Sums a loss over the pipeline (only the last stage's is not 0) and the DP ranks.
  void sum_over_pipeline_and_dp(double* value);
  // Places the storage, the optimizer, the model and the step's buffers in
  // state_memory_, and returns the step's.
  Step::Buffers lay_out_memory();

  common::Config config_;
  Backend& backend_;
  const ProcessGroups& groups_;
  int dp_rank_;
  int dp_size_;
  int tp_rank_;
  DataMix train_;
  std::unique_ptr<TokenStream> val_;
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
  std::vector<int32_t> inputs_, targets_;  // validation's and evaluation's microbatch
  RankContext rank_;
  health::BoardPublisher no_board_;
  health::BoardPublisher& board_;
  health::FaultInjector faults_;
  SdcGuard sdc_;
  RankState state_;
  // Declared last: it registers hooks on storage_ and model_ and refers to
  // the members above.
  Step step_;
};

}  // namespace keel::trainer
