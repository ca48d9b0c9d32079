#include "health/fault_injector.h"

#include "common/log.h"

#include <signal.h>
#include <unistd.h>

namespace keel::health {

FaultInjector::FaultInjector(const common::FaultsConfig& faults, int rank, int64_t generation)
    : faults_(faults), rank_(rank), generation_(generation) {}

void FaultInjector::before_step(int64_t step) const {
  if (faults_.crash_rank != rank_ || faults_.crash_step != step) return;
  if (faults_.crash_generation != -1 && faults_.crash_generation != generation_) return;
  auto log = common::logger("faults");
  log->warn("fault injection ([faults] crash_rank = {}, crash_step = {}): killing this rank with SIGKILL", rank_,
            step);
  log->flush();
  kill(getpid(), SIGKILL);
}

}  // namespace keel::health
