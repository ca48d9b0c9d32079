// A rank's in-memory snapshots (docs/architecture.md "In-memory
// snapshots"): its training state copied into the area keeld holds for it
// (checkpoint::SnapshotArea), and read back by the next generation without
// touching storage. TrainLoop says which blocks of state and when; this
// moves them, and rank 0's choice between memory and disk is a function of
// every rank's report (choose_snapshot), so it can be tested as data.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/memory_snapshot.h"
#include "checkpoint/piece.h"
#include "trainer/kernels/backend.h"

namespace keel::trainer {

// What one rank holds in memory for a new generation: the steps of its
// snapshots that verified and fit its state exactly, newest first, and a
// sentence for each that did not.
struct SnapshotReport {
  std::vector<int64_t> steps;
  std::vector<std::string> problems;

  nlohmann::json to_json() const;
  // Throws Error(kPeerFailure) naming `rank` when `json` is not a report.
  static SnapshotReport from_json(const nlohmann::json& json, int rank);
};

// Rank 0's choice: the newest step every rank holds (none: `why` says
// which rank lacks what). `reports[r]` is rank r's, nullopt when rank r
// keeps no snapshots.
struct SnapshotChoice {
  std::optional<int64_t> step;
  std::string why;
};
SnapshotChoice choose_snapshot(const std::vector<std::optional<SnapshotReport>>& reports);

// Copies regions of backend memory to the host, as both a checkpoint's
// staging and a snapshot do: on the CPU a memcpy over `threads` threads
// (checkpoint::parallel_copy), elsewhere the backend's own snapshot copy.
void copy_state_to_host(Backend& backend, const std::vector<Backend::HostCopy>& copies, unsigned threads);

class MemorySnapshots {
 public:
  struct Options {
    int keep = 2;
    // checkpoint.memory_every_steps (-1: by the stall budget) and
    // checkpoint.memory_stall_budget.
    int64_t every_steps = -1;
    double stall_budget = 0.02;
    // The hash of what makes a snapshot fit this rank (its rank, the layout
    // and the model).
    uint64_t layout = 0;
    unsigned threads = 0;  // the CPU copy's
    // keeld copies the snapshots the ranks agree on to another node
    // (KEEL_SNAPSHOT_BUDDY; daemon/snapshot_buddy.h).
    bool copied = false;
  };
  // Over the area keeld passed as `fd` (not owned).
  MemorySnapshots(int fd, const Options& options, Backend& backend);
  ~MemorySnapshots();
  MemorySnapshots(const MemorySnapshots&) = delete;
  MemorySnapshots& operator=(const MemorySnapshots&) = delete;

  // Whether this rank wants a snapshot after `steps_done` steps, the last
  // of which took `step_s`: every `every_steps` steps or, with -1, once the
  // steps since its last snapshot took long enough that its stall is at
  // most `stall_budget` of them (at once when there was none). The ranks
  // agree on it by a vote, so that every rank holds the same steps.
  bool due(int64_t steps_done, double step_s) const;
  // How long the last save()'s copy took, which due() goes by.
  double last_stall_s() const { return last_stall_s_; }

  bool copied() const { return options_.copied; }
  // Whether this rank's next snapshot may be a copy step: keeld copies
  // them, and its buddy accepted the copy of the last one this process
  // took (or it took none). The ranks agree on it by a vote, so that a
  // copy step is begun only once every node's copies of the one before
  // are held: those copies and every rank's kept copy steps then share
  // a step (docs/architecture.md "In-memory snapshots", "Many nodes").
  bool ready_to_copy() const;

  // Fault injection between the copy's halves and after the commit.
  struct Faults {
    std::function<void()> halfway;  // may kill the rank: the slot stays unfinished
    bool corrupt = false;           // flips a byte of the committed snapshot
  };
  // Copies `pieces` from `local` (backend memory) into the next slot, all
  // training waits for, and commits them as `step` on a thread of its own
  // (hash and finite check; a slot holding a non-finite value is logged
  // and never committed), a copy step when the ranks agreed on one. Waits
  // first for the commit before. Error(kCheckpointFailure) when the area
  // cannot grow.
  void save(const std::vector<checkpoint::Piece>& pieces, const std::vector<float*>& local, int64_t step,
            int64_t tokens, bool copy_step, const Faults& faults);

  // Lays the area out for `pieces` unless it holds them already, so that
  // the first snapshot does not pay for it (checkpoint::SnapshotArea::
  // reserve). Error(kCheckpointFailure) when the node's memory cannot.
  void reserve(const std::vector<checkpoint::Piece>& pieces) {
    area_.reserve(pieces);
    pin();
  }

  // Reads the area once for a new generation: the snapshots that verify
  // and hold exactly `pieces`.
  SnapshotReport report(const std::vector<checkpoint::Piece>& pieces);
  // Copies the snapshot of `step` from the last report() into `local`.
  // Error(kCheckpointFailure) when that report had no such step.
  void restore(int64_t step, const std::vector<float*>& local);
  // Never restores a snapshot of a step after `step` (the run went back
  // to it): they are marked quarantined.
  void discard_after(int64_t step) {
    wait();
    area_.quarantine_after(step);
  }

 private:
  // Registers the area's mapping with the backend, again after it moved.
  void pin();
  // Waits for the commit in flight, if any.
  void wait();

  Options options_;
  checkpoint::SnapshotArea area_;
  Backend& backend_;
  int64_t last_step_ = -1;       // of the last snapshot this rank took
  int64_t last_copy_step_ = -1;  // and of the last copy step
  double last_stall_s_ = 0;
  void* pinned_ = nullptr;
  std::vector<checkpoint::SnapshotArea::Snapshot> found_;  // the last report's
  std::future<void> commit_;                               // the commit in flight
};

}  // namespace keel::trainer
