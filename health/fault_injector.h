// Fault injection (docs/architecture.md "Health"), shipped in every build and inert unless the
// [faults] section configures it, so that recovery can be shown and tested
// end to end on a real run. Each fault logs what it does before it acts.
#pragma once

#include "common/config.h"

#include <cstdint>

namespace keel::health {

class FaultInjector {
 public:
  FaultInjector(const common::FaultsConfig& faults, int rank, int64_t generation);

  // Called by the training loop before it trains `step`: kills this rank
  // with SIGKILL when [faults] crash_rank / crash_step / crash_generation
  // say so.
  void before_step(int64_t step) const;

 private:
  common::FaultsConfig faults_;
  int rank_;
  int64_t generation_;
};

}  // namespace keel::health
