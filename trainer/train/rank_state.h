// A rank's training state on disk and in memory (docs/architecture.md
// "Checkpoints", "In-memory snapshots"): which blocks of which global
// tensors this rank saves and loads and where they live in its memory, the
// checkpoints it saves on the run's schedule, the in-memory snapshots keeld
// holds for it, and where a run starts: the newest state every rank can
// load. checkpoint/ does the files; this maps the model onto them.
#pragma once

#include "checkpoint/checkpointer.h"
#include "checkpoint/piece.h"
#include "checkpoint/reader.h"
#include "common/config.h"
#include "health/board_publisher.h"
#include "health/fault_injector.h"
#include "store/store.h"
#include "trainer/kernels/backend.h"
#include "trainer/optim/adamw.h"
#include "trainer/parallel/zero_storage.h"
#include "trainer/train/fault_hooks.h"
#include "trainer/train/memory_snapshots.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace keel::trainer {

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

class RankState {
 public:
  // The state of `storage` (parameters) and `optimizer` (moments), this
  // TP rank's slices of `table`. Checkpoints are saved when
  // checkpoint.every_steps or every_seconds is set; snapshots taken when
  // checkpoint.memory_every_steps is and keeld gave the rank an area.
  RankState(const common::Config& config, Backend& backend, const ParameterTable& table, ZeroStorage& storage,
            AdamW& optimizer, int tp_rank, const RankContext& rank, health::BoardPublisher& board,
            health::FaultInjector& faults);
  RankState(const RankState&) = delete;
  RankState& operator=(const RankState&) = delete;

  // Chooses where training starts and loads it (docs/architecture.md
  // "Resume and retention"): the newest in-memory snapshot every rank holds,
  // when it is at least as new as the run's newest committed checkpoint;
  // otherwise that checkpoint, the newest that verifies (checkpoint.verify);
  // when there is none, checkpoint.init_from ("" or "none": step 0, a
  // checkpoint directory of any layout, or "hf:DIR": a Hugging Face model's
  // weights at step 0). When the run's checkpoints exist
  // but none loads, only a snapshot or an explicit init_from starts it
  // elsewhere; otherwise Error(kCheckpointFailure) names each one and why.
  // Every rank reports its snapshots through the Store, rank 0 decides and
  // records the choice (state_restored).
  void resume();
  // Loads checkpoint `dir` (any layout); `verified`: its checksums were
  // checked already. Error(kBadConfig) unless it holds exactly this model.
  void restore(const std::filesystem::path& dir, bool verified = false);
  // Loads the weights of a Hugging Face model directory as step 0, the
  // optimizer's state left fresh (checkpoint.init_from = "hf:DIR").
  // Error(kBadConfig) unless they hold exactly this model's tensors.
  void import_hf(const std::filesystem::path& dir);
  // The step training starts at: 0, or the step of the state loaded.
  int64_t start_step() const { return start_step_; }

  bool checkpoints() const { return checkpointer_.has_value(); }
  // Saves the state after `steps_done` steps in the background (stalling
  // training for the copy, and while the previous save still writes).
  void save_checkpoint(int64_t steps_done);
  // Saves the end of a run unless that step is saved already, and waits
  // for the saves in flight: whether this rank's last save succeeded, or
  // nullopt without checkpoints.
  std::optional<bool> save_end(int64_t steps_done);
  // Abandons the commit in flight (a peer failed: it will never report).
  void cancel_checkpoint(const std::string& cause);

  // Whether a snapshot is due after `steps_done` steps of `step_s` seconds.
  bool snapshot_due(int64_t steps_done, double step_s) const;
  // Whether keeld is still copying this rank's last snapshot to the buddy.
  bool copy_pending() const;
  // Copies the state into the snapshot area; a copy step for the buddy
  // unless some rank's copy is still pending (`copy_pending_anywhere`).
  void save_snapshot(int64_t steps_done, bool copy_pending_anywhere);

 private:
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

  const common::Config& config_;
  Backend& backend_;
  const ParameterTable& table_;
  ZeroStorage& storage_;
  AdamW& optimizer_;
  int tp_rank_;
  RankContext rank_;
  health::BoardPublisher& board_;
  health::FaultInjector& faults_;
  CheckpointFaults checkpoint_faults_;
  std::optional<checkpoint::Checkpointer> checkpointer_;
  std::optional<MemorySnapshots> snapshots_;
  int64_t start_step_ = 0;
  int64_t last_saved_step_ = -1;
};

}  // namespace keel::trainer
