// The rank processes of one generation (docs/architecture.md "Daemon"):
// spawned with a progress board each, reaped, signalled, killed after a
// grace period, and read into the samples the detectors take. What the
// job decides about them is daemon/job_state.h's; this only does it.
#pragma once

#include "checkpoint/memory_snapshot.h"
#include "common/unique_fd.h"
#include "daemon/job_views.h"
#include "health/progress_board.h"
#include "health/rank_sample.h"

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace keel::daemon {

struct RankSetOptions {
  int ranks = 1;                           // the ranks this node runs
  std::filesystem::path trainer;           // keel-trainer
  std::filesystem::path config_path;       // passed to the ranks, with the overrides
  std::vector<std::string> overrides;
  std::string store_address;               // KEEL_STORE
  std::string store_secret;                // KEEL_STORE_SECRET
  std::string bind_address;                // KEEL_BIND_ADDRESS: the node's, for Gloo and NCCL; empty: the ranks' default
  std::filesystem::path run_dir;           // KEEL_RUN_DIR; logs/ holds each rank's log
  bool pin_cpus = true;                    // daemon.pin_cpus
  std::vector<std::string> gpus;           // each rank's CUDA_VISIBLE_DEVICES (gpu_assignment.h); empty: CPU
  // Give each rank an in-memory snapshot area that outlives it
  // (checkpoint.memory_every_steps not 0; checkpoint/memory_snapshot.h).
  bool snapshot_areas = false;
  // And keeld copies them to another node (KEEL_SNAPSHOT_BUDDY; daemon/snapshot_buddy.h).
  bool snapshot_buddy = false;
};

// Where a generation puts this node's ranks (docs/architecture.md
// "Multi-node on etcd"): local rank l is global rank first_rank + l of
// `world`, and `overrides` (the generation's layout) follow the config's.
// On one node: the whole world, no overrides.
struct RankSlice {
  int first_rank = 0;
  int world = 1;
  std::vector<std::string> overrides;
};

class RankSet {
 public:
  explicit RankSet(RankSetOptions options);
  // Kills whatever still runs and removes the boards.
  ~RankSet();
  RankSet(const RankSet&) = delete;
  RankSet& operator=(const RankSet&) = delete;

  // Starts every rank of `generation` in `slice`, each with a fresh board
  // and its log header. When one cannot be started, the ones after it are
  // not either: that rank shows exit 127 and its number is returned, with why.
  struct SpawnFailure {
    int rank = 0;
    std::string why;
  };
  std::optional<SpawnFailure> spawn(int64_t generation, const RankSlice& slice);

  // The rank whose process `pid` exited with `wait_status` (raw waitpid),
  // its exit and its board's last words recorded; nullptr when `pid` is
  // not a running rank.
  const RankReport* reap(pid_t pid, int wait_status);

  // Sends `signal` to every live rank.
  void signal(int signal);
  // SIGTERM now; SIGKILL from the first tick() `grace_s` later.
  void terminate(double grace_s, int64_t now_ns);
  // Sends the SIGKILL terminate() scheduled once its time has come and a
  // rank still runs; true when it did.
  bool tick(int64_t now_ns);
  bool alive() const;

  // Takes in each board's newest snapshot and its heartbeat.
  void read_boards();
  // The detectors' samples, each under its global rank: the number its
  // board says (health::published_board takes no other).
  health::RankSamples samples() const;
  const std::vector<RankReport>& ranks() const { return reports_; }

  // "rank 1 exited 3 (data_error): <the rank's own sentence, from its log>",
  // naming the rank by its global number.
  std::string exit_cause(int rank, int code) const;

  // Requests relayed through the boards; false when `rank` has no board
  // (no generation runs).
  bool request_checkpoint();
  bool request_fault(int rank, const health::FaultRequest& request);

  // The complete in-memory snapshots of each local rank's area, from the
  // slot headers (newest first); empty without snapshot_areas.
  std::vector<std::vector<checkpoint::SnapshotArea::Listed>> snapshots() const;
  // Marks every snapshot of a step after `step` quarantined in every area
  // (an SDC verdict's last good step); returns how many. Only while no
  // rank runs.
  int quarantine_snapshots_after(int64_t step);
  // Each local rank's area (none without snapshot_areas), for the buddy
  // copy (daemon/snapshot_buddy.h).
  std::vector<int> snapshot_area_fds() const;
  // The local ranks whose areas cannot hold their state in `slice`: no
  // rank of theirs ran here as that global rank (keeld started since, or
  // the numbering moved). None without snapshot_areas.
  std::vector<int> areas_lacking(const RankSlice& slice) const;

  void remove_boards();
  // The boards of keelds that died (named after a pid that no longer exists).
  static void remove_orphaned_boards();

 private:
  RankSetOptions options_;
  RankSlice slice_;                                          // the generation's, once spawned
  std::vector<RankReport> reports_;                          // per rank
  std::vector<std::optional<health::ProgressBoard>> boards_;  // per rank; empty between generations
  std::vector<std::vector<int>> cpus_;                       // per rank; empty: pin_cpus is off
  std::string shared_cpus_;  // all of them: where the ranks' communication threads run (common/shared_cpus.h)
  // Per rank, a memfd held for the job's life: a rank's crash loses none of
  // its snapshots, keeld's exit all of them. Empty without snapshot_areas.
  std::vector<common::UniqueFd> snapshot_areas_;
  std::vector<int64_t> area_ranks_;  // per area: the global rank it last served; -1: none yet
  size_t threads_per_rank_ = 1;
  std::optional<int64_t> kill_at_ns_;
};

}  // namespace keel::daemon
