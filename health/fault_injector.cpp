#include "health/fault_injector.h"

#include "common/log.h"

#include <signal.h>
#include <unistd.h>

namespace keel::health {

FaultInjector::FaultInjector(const common::FaultsConfig& faults, int rank, int64_t generation)
    : faults_(faults), rank_(rank), generation_(generation) {}

void FaultInjector::before_step(int64_t step) const {
  step_.store(step);
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

bool FaultInjector::armed() const {
  return faults_.fault_generation == -1 || faults_.fault_generation == generation_;
}

void FaultInjector::before_collective(std::string_view group) const {
  if (faults_.hang_rank != rank_ || !armed() || step_.load() < faults_.hang_step) return;
  // "g0.dp.0": the axis is the middle component.
  const size_t first = group.find('.');
  const size_t second = group.find('.', first + 1);
  if (first == std::string_view::npos || group.substr(first + 1, second - first - 1) != faults_.hang_group) return;
  auto log = common::logger("faults");
  log->warn("fault injection ([faults] hang_rank = {}, hang_step = {}, hang_group = {}): this rank stops before its "
            "next collective of {} and never returns",
            rank_, faults_.hang_step, faults_.hang_group, group);
  log->flush();
  for (;;) pause();
}

bool FaultInjector::poisons(int64_t step, const std::string& target) const {
  if (faults_.nan_rank != rank_ || faults_.nan_step != step || faults_.nan_target != target || !armed()) {
    return false;
  }
  common::logger("faults")->warn("fault injection ([faults] nan_rank = {}, nan_step = {}): this rank's {} is NaN",
                                 rank_, step, target);
  return true;
}

}  // namespace keel::health
