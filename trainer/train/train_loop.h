// The training run of one rank: its memory, model and optimizer state,
// the steps (Step), periodic validation, checkpoints and resume, metrics
// and progress with ETA.
#pragma once

#include "checkpoint/checkpointer.h"
#include "checkpoint/piece.h"
#include "checkpoint/reader.h"
#include "common/config.h"
#include "store/store.h"
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
#include "trainer/train/memory_snapshots.h"
#include "trainer/train/metrics.h"
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

// Who this rank is in the run, for checkpoints: its global rank and the
// Store the ranks report through (nullptr with one rank); and the progress
// board keeld reads (nullptr: none, a rank run by hand).
struct RankContext {
  store::Store* store = nullptr;
  int rank = 0;
  int world_size = 1;
  int64_t generation = 0;
  health::BoardPublisher* board = nullptr;
  // The in-memory snapshot area keeld holds for this rank
  // (KEEL_SNAPSHOT_FD); -1: none, snapshots are not taken.
  int snapshot_fd = -1;
  // keeld copies the snapshots to another node (KEEL_SNAPSHOT_BUDDY).
  bool snapshot_buddy = false;
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

  // Checkpoints (docs/architecture.md "Checkpoints"): with checkpoint.every_steps or every_seconds
  // set, run() saves into config.checkpoint_dir() on that schedule and once
  // more when it ends or stops.
  bool checkpoints_enabled() const;
  // Chooses where training starts and loads it (docs/architecture.md
  // "Resume and retention"): the newest in-memory snapshot every rank holds
  // ("In-memory snapshots"), when it is at least as new as the run's newest
  // committed checkpoint; otherwise that checkpoint, the newest that
  // verifies (checkpoint.verify); when there is none, checkpoint.init_from
  // ("" or "none": step 0, or a checkpoint directory of any layout). When the
  // run's checkpoints exist but none loads, only a snapshot or an explicit
  // init_from starts it elsewhere; otherwise Error(kCheckpointFailure) names
  // each one and why. Every rank reports its snapshots through the Store,
  // rank 0 decides and records the choice (state_restored) and skipped
  // checkpoints as events; the others follow through the Store.
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
  // Copies this rank's state into its in-memory snapshot area, as a copy
  // step for the buddy when the ranks agreed on one.
  void save_snapshot(int64_t steps_done, bool copy_step);
  // The area cannot hold the state (memory): training goes on without
  // snapshots, and this rank's missing ones send the next resume to disk.
  void stop_snapshots(int64_t step, const std::string& cause);
  // Loads the in-memory snapshot of `step` rank 0 chose; `saved`: a
  // committed checkpoint of that step exists.
  void restore_snapshot(int64_t step, bool saved);
  // Every rank's snapshot report, rank 0's own first (resume()).
  std::vector<std::optional<SnapshotReport>> gather_snapshot_reports(std::optional<SnapshotReport> own);
  // Rank 0's choice for resume(): {"from": "memory", "step"}, {"from":
  // "disk", "dir", "verified"} (a null dir: step 0), or {"error"}; with
  // snapshots on, "why" says why not memory. `memory`: nullopt when
  // snapshots are off.
  nlohmann::json choose_start(const std::optional<SnapshotChoice>& memory);
  // The newest committed checkpoint that loads, as choose_start() says it.
  nlohmann::json choose_disk();
  // Error(kBadConfig) unless the checkpoint holds exactly this model's
  // tensors at this model's global shapes.
  void check_shapes(const checkpoint::CheckpointReader& reader) const;
  // Places the storage, the optimizer, the model and the step's buffers in
  // state_memory_, and returns the step's.
  Step::Buffers lay_out_memory();

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
  std::vector<int32_t> inputs_, targets_;  // validation's and evaluation's microbatch
  RankContext rank_;
  health::BoardPublisher no_board_;
  health::BoardPublisher& board_;
  health::FaultInjector faults_;
  SdcGuard sdc_;
  CheckpointFaults checkpoint_faults_;
  std::optional<checkpoint::Checkpointer> checkpointer_;
  std::optional<MemorySnapshots> snapshots_;
  int64_t start_step_ = 0;
  int64_t last_saved_step_ = -1;
  // Declared last: it registers hooks on storage_ and model_ and refers to
  // the members above.
  Step step_;
};

}  // namespace keel::trainer
