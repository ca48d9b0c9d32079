// Fault injection (docs/architecture.md "Health"), shipped in every build and inert unless the
// [faults] section configures it (or `keelctl inject` asks for it), so that
// recovery can be shown and tested end to end on a real run. Each fault
// logs what it does before it acts.
//
// The injector decides when and where a fault fires; the training loop,
// the communicators and the checkpoint writer call it at their hooks and
// do what it says (trainer/train/fault_hooks.h holds the trainer's side).
#pragma once

#include "common/config.h"
#include "health/progress_board.h"

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace keel::health {

class FaultInjector {
 public:
  // `config` is the whole run configuration: its [faults] section says
  // what fires, job.seed seeds the choice of flipped bits, and a keelctl
  // request is checked against the same rules.
  FaultInjector(const common::Config& config, int rank, int64_t generation);

  // Called by the training loop before it trains `step`: kills this rank
  // with SIGKILL when [faults] crash_rank / crash_step / crash_generation
  // say so (crash_in = "step").
  void before_step(int64_t step) const;
  // Called on the checkpoint writer thread once this rank's file of step
  // `step` is written, before it is reported: kills this rank when
  // crash_in = "save" and crash_step = step.
  void during_save(int64_t step) const;
  // Called halfway through the copy of this rank's in-memory snapshot of
  // `step`: kills this rank when crash_in = "snapshot" and crash_step =
  // step, which leaves that snapshot unfinished.
  void during_snapshot(int64_t step) const;
  // Whether a byte of this rank's in-memory snapshot of `step` flips after
  // its checksum (checkpoint_fault = "snapshot_corrupt" at
  // checkpoint_fault_step, in fault_generation).
  bool corrupts_snapshot(int64_t step) const;
  // Whether this rank's `target` ("gradient" or "loss") is to be made NaN at
  // `step` ([faults] nan_rank / nan_step / nan_target, in fault_generation).
  // Logs it when it says yes.
  bool poisons(int64_t step, const std::string& target) const;
  // What every rank multiplies its share of `step`'s loss by, and so its
  // gradient: [faults] loss_spike_factor at loss_spike_step (in
  // fault_generation), 1 otherwise. Every computation of the step asks, so
  // a rerun reproduces the spike. Logs it when it is not 1.
  double loss_factor(int64_t step) const;
  // Whether the known-answer test that proves a BLAS core keel chose is to
  // get one wrong GEMM output on this rank (bitflip_target = "blas_core" on
  // bitflip_rank, in fault_generation; at start, whatever bitflip_step).
  // Logs it when it says yes.
  bool breaks_blas_core() const;
  // Called by Communicator before a call of group `group` ("g0.dp.0")
  // takes its sequence number: from [faults] hang_step on, the first call
  // of a group of axis hang_group blocks this thread for good, so the call
  // never begins and the rank's peers wait for it (the heartbeat goes on:
  // the rank is alive, only stuck).
  void before_collective(std::string_view group) const;

  // slow_rank / slow_factor with slow_phase "compute": called once a step's
  // forward and backward are done, with the seconds they took (collective
  // wait excluded), and sleeps (slow_factor - 1) times as long, so that the
  // rank's compute takes about slow_factor times as long and its peers wait
  // for it in the gradient sums that follow.
  void slow_compute(double seconds) const;
  // slow_rank / slow_stall_s with slow_phase "checkpoint" or "validation":
  // called inside that phase, and sleeps slow_stall_s when `phase` is
  // slow_phase, so the save or the pass outlasts its peers' while they wait
  // in the next collective.
  void stall(std::string_view phase) const;

  // One place a bit can flip: a tensor (or an activation) this rank holds,
  // by name and number of float32s.
  struct Site {
    std::string name;
    size_t numel = 0;
  };
  struct BitFlip {
    size_t site = 0;   // index into the sites asked about
    size_t index = 0;  // the float32 within it
    int bit = 0;
  };
  // bitflip_rank / bitflip_step / bitflip_target / bitflip_tensor /
  // bitflip_bit: the flip due in the step in progress (before_step) on
  // `target` among `sites`, until record_flip() says it happened; nothing
  // otherwise. The element is drawn uniformly over the sites (or over
  // bitflip_tensor's) from (job.seed, step, rank), so every call of one
  // step answers the same and a rerun of the step flips nothing.
  std::optional<BitFlip> bitflip(std::string_view target, const std::vector<Site>& sites) const;
  // Logs the flip the caller made (tensor, index, bit, old and new value)
  // and marks it done.
  void record_flip(std::string_view target, std::string_view site, size_t index, int bit, float before,
                   float after) const;

  // checkpoint_fault / _rank / _step: the fault for this rank's file of
  // the checkpoint of `step` ("write_error", "corrupt" or "disk_full"), or
  // "" for none. checkpoint_fault_step 0 means the first checkpoint this
  // rank writes. Thread-safe (the checkpoint writer thread asks).
  std::string checkpoint_fault(int64_t step) const;

  // A `keelctl inject` request keeld relayed through the board: from now
  // on it counts as the [faults] keys of the same names, aimed at this
  // rank in this generation; its step -1 means `next_step`, the step about
  // to be trained. A request that [faults] would refuse, or of a kind this
  // side does not inject, is logged and ignored: false.
  bool apply(const FaultRequest& request, int64_t next_step);

 private:
  void crash(const char* where, int64_t step) const;
  // Whether the faults other than crash fire in this generation.
  bool armed() const;

  const common::FaultsConfig& faults() const { return config_.faults; }

  common::Config config_;
  // apply() runs on the training thread while the checkpoint writer thread
  // may read the checkpoint faults: it changes config_ under this lock,
  // and the writer thread reads under it.
  mutable std::mutex mutex_;
  int rank_;
  int64_t generation_;
  // The step the training loop is in (before_step), read by the
  // communicators' threads.
  mutable std::atomic<int64_t> step_{-1};
  int64_t slow_from_step_ = 0;  // a slow fault that keelctl injected starts at its step
  mutable bool flipped_ = false;
  mutable std::atomic<int64_t> first_checkpoint_step_{-1};
};

}  // namespace keel::health
