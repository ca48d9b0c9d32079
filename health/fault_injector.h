// Fault injection (docs/architecture.md "Health"), shipped in every build and inert unless the
// [faults] section configures it, so that recovery can be shown and tested
// end to end on a real run. Each fault logs what it does before it acts.
#pragma once

#include "common/config.h"

#include <cstdint>
#include <atomic>
#include <string>
#include <string_view>

namespace keel::health {

class FaultInjector {
 public:
  FaultInjector(const common::FaultsConfig& faults, int rank, int64_t generation);

  // Called by the training loop before it trains `step`: kills this rank
  // with SIGKILL when [faults] crash_rank / crash_step / crash_generation
  // say so (crash_in = "step").
  void before_step(int64_t step) const;
  // Called on the checkpoint writer thread once this rank's file of step
  // `step` is written, before it is reported: kills this rank when
  // crash_in = "save" and crash_step = step.
  void during_save(int64_t step) const;
  // Whether this rank's `target` ("gradient" or "loss") is to be made NaN at
  // `step` ([faults] nan_rank / nan_step / nan_target, in fault_generation).
  // Logs it when it says yes.
  bool poisons(int64_t step, const std::string& target) const;
  // Called by Communicator before a call of group `group` ("g0.dp.0")
  // takes its sequence number: from [faults] hang_step on, the first call
  // of a group of axis hang_group blocks this thread for good, so the call
  // never begins and the rank's peers wait for it (the heartbeat goes on:
  // the rank is alive, only stuck).
  void before_collective(std::string_view group) const;

 private:
  void crash(const char* where, int64_t step) const;
  // Whether the faults other than crash fire in this generation.
  bool armed() const;

  common::FaultsConfig faults_;
  int rank_;
  int64_t generation_;
  // The step the training loop is in (before_step), read by the
  // communicators' threads.
  mutable std::atomic<int64_t> step_{-1};
};

}  // namespace keel::health
