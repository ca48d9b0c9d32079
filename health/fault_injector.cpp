#include "health/fault_injector.h"

#include "common/log.h"

#include <signal.h>
#include <unistd.h>

namespace keel::health {

FaultInjector::FaultInjector(const common::FaultsConfig& faults, int rank, int64_t generation)
    : faults_(faults), rank_(rank), generation_(generation) {}

void FaultInjector::before_step(int64_t step) const {
  if (faults_.crash_in == "step") crash("before training step", step);
}

void FaultInjector::during_save(int64_t step) const {
  if (faults_.crash_in == "save") crash("saving the checkpoint of step", step);
}

void FaultInjector::crash(const char* where, int64_t step) const {
  if (faults_.crash_rank != rank_ || faults_.crash_step != step) return;
  if (faults_.crash_generation != -1 && faults_.crash_generation != generation_) return;
  auto log = common::logger("faults");
  log->warn("fault injection ([faults] crash_rank = {}, crash_step = {}): killing this rank with SIGKILL {} {}", rank_,
            step, where, step);
  log->flush();
  kill(getpid(), SIGKILL);
}

bool FaultInjector::poisons(int64_t step, const std::string& target) const {
  if (faults_.nan_rank != rank_ || faults_.nan_step != step || faults_.nan_target != target || generation_ != 0) {
    return false;
  }
  common::logger("faults")->warn("fault injection ([faults] nan_rank = {}, nan_step = {}): this rank's {} is NaN",
                                 rank_, step, target);
  return true;
}

}  // namespace keel::health
