#include "health/fault_injector.h"

#include "common/counter_rng.h"
#include "common/error.h"
#include "common/log.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <thread>

namespace keel::health {

FaultInjector::FaultInjector(const common::Config& config, int rank, int64_t generation)
    : config_(config), rank_(rank), generation_(generation) {}

void FaultInjector::before_step(int64_t step) const {
  step_.store(step);
  if (faults().crash_in == "step") crash("before training step", step);
}

void FaultInjector::during_save(int64_t step) const {
  std::lock_guard lock(mutex_);
  if (faults().crash_in == "save") crash("saving the checkpoint of step", step);
}

void FaultInjector::during_snapshot(int64_t step) const {
  if (faults().crash_in == "snapshot") crash("halfway through the in-memory snapshot of step", step);
}

bool FaultInjector::corrupts_snapshot(int64_t step) const {
  std::lock_guard lock(mutex_);
  const auto& f = faults();
  if (f.checkpoint_fault != "snapshot_corrupt" || f.checkpoint_fault_rank != rank_ || !armed() ||
      f.checkpoint_fault_step != step) {
    return false;
  }
  common::logger("faults")->warn(
      "fault injection ([faults] checkpoint_fault = snapshot_corrupt): a byte of the in-memory snapshot of step {} "
      "flips after its checksum",
      step);
  return true;
}

void FaultInjector::crash(const char* where, int64_t step) const {
  if (faults().crash_rank != rank_ || faults().crash_step != step) return;
  if (faults().crash_generation != -1 && faults().crash_generation != generation_) return;
  auto log = common::logger("faults");
  log->warn("fault injection ([faults] crash_rank = {}, crash_step = {}): killing this rank with SIGKILL {} {}", rank_,
            step, where, step);
  log->flush();
  kill(getpid(), SIGKILL);
}

bool FaultInjector::armed() const {
  return faults().fault_generation == -1 || faults().fault_generation == generation_;
}

void FaultInjector::before_collective(std::string_view group) const {
  if (faults().hang_rank != rank_ || !armed() || step_.load() < faults().hang_step) return;
  // "g0.dp.0": the axis is the middle component.
  const size_t first = group.find('.');
  const size_t second = group.find('.', first + 1);
  if (first == std::string_view::npos || group.substr(first + 1, second - first - 1) != faults().hang_group) return;
  auto log = common::logger("faults");
  log->warn("fault injection ([faults] hang_rank = {}, hang_step = {}, hang_group = {}): this rank stops before its "
            "next collective of {} and never returns",
            rank_, faults().hang_step, faults().hang_group, group);
  log->flush();
  for (;;) pause();
}

bool FaultInjector::poisons(int64_t step, const std::string& target) const {
  if (faults().nan_rank != rank_ || faults().nan_step != step || faults().nan_target != target || !armed()) {
    return false;
  }
  common::logger("faults")->warn("fault injection ([faults] nan_rank = {}, nan_step = {}): this rank's {} is NaN",
                                 rank_, step, target);
  return true;
}

bool FaultInjector::breaks_blas_core() const {
  if (faults().bitflip_rank != rank_ || faults().bitflip_target != "blas_core" || !armed()) return false;
  common::logger("faults")->warn(
      "fault injection ([faults] bitflip_rank = {}, bitflip_target = blas_core): one GEMM output of the known-answer "
      "test that proves the BLAS core is wrong by one bit",
      rank_);
  return true;
}

double FaultInjector::loss_factor(int64_t step) const {
  if (faults().loss_spike_step != step || !armed()) return 1.0;
  common::logger("faults")->warn(
      "fault injection ([faults] loss_spike_step = {}, loss_spike_factor = {}): this step's loss and gradient are "
      "scaled by {}",
      step, faults().loss_spike_factor, faults().loss_spike_factor);
  return faults().loss_spike_factor;
}

void FaultInjector::slow_compute(double seconds) const {
  if (faults().slow_rank != rank_ || faults().slow_factor <= 1.0 || faults().slow_phase != "compute" || !armed() ||
      step_.load() < slow_from_step_) {
    return;
  }
  // Every step is stretched, so this is logged quietly.
  const double extra_s = (faults().slow_factor - 1.0) * seconds;
  common::logger("faults")->debug(
      "fault injection ([faults] slow_rank = {}, slow_factor = {}): compute stretched by {:.1f} ms", rank_,
      faults().slow_factor, extra_s * 1e3);
  // Spun, not slept: a slower device works longer, it does not stop (a
  // rank asleep in its compute is stalled, health/straggler_monitor.h).
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(extra_s);
  for (volatile uint64_t spin = 0; std::chrono::steady_clock::now() < until;) spin = spin + 1;
}

void FaultInjector::stall(std::string_view phase) const {
  if (faults().slow_rank != rank_ || faults().slow_stall_s <= 0 || phase != faults().slow_phase || !armed() ||
      step_.load() < slow_from_step_) {
    return;
  }
  common::logger("faults")->info(
      "fault injection ([faults] slow_rank = {}, slow_phase = \"{}\", slow_stall_s = {}): {} stretched by {:.1f} ms",
      rank_, phase, faults().slow_stall_s, phase, faults().slow_stall_s * 1e3);
  std::this_thread::sleep_for(std::chrono::duration<double>(faults().slow_stall_s));
}

std::optional<FaultInjector::BitFlip> FaultInjector::bitflip(std::string_view target,
                                                             const std::vector<Site>& sites) const {
  const auto& f = faults();
  const int64_t step = step_.load();
  if (f.bitflip_rank != rank_ || f.bitflip_step != step || f.bitflip_target != target || flipped_ || !armed()) {
    return std::nullopt;
  }
  auto eligible = [&](const Site& s) { return f.bitflip_tensor.empty() || s.name == f.bitflip_tensor; };
  uint64_t total = 0;
  for (const Site& s : sites) total += eligible(s) ? s.numel : 0;
  if (total == 0) return std::nullopt;
  const uint64_t key = common::stream_key(static_cast<uint64_t>(config_.job.seed), "faults.bitflip");
  uint64_t pick =
      common::counter_uniform_below(key, static_cast<uint64_t>(step) << 20 | static_cast<uint64_t>(rank_), total);
  for (size_t i = 0; i < sites.size(); ++i) {
    if (!eligible(sites[i])) continue;
    if (pick < sites[i].numel) return BitFlip{i, static_cast<size_t>(pick), static_cast<int>(f.bitflip_bit)};
    pick -= sites[i].numel;
  }
  return std::nullopt;
}

void FaultInjector::record_flip(std::string_view target, std::string_view site, size_t index, int bit, float before,
                                float after) const {
  flipped_ = true;
  common::logger("faults")->warn(
      "fault injection ([faults] bitflip_rank = {}, bitflip_step = {}, bitflip_target = "
      "{}): flipped bit {} of {}[{}]: {:.9g} -> {:.9g}",
      rank_, step_.load(), target, bit, site, index, before, after);
}

std::string FaultInjector::checkpoint_fault(int64_t step) const {
  std::lock_guard lock(mutex_);
  const auto& f = faults();
  if (f.checkpoint_fault.empty() || f.checkpoint_fault == "snapshot_corrupt" || f.checkpoint_fault_rank != rank_ ||
      !armed()) {
    return "";
  }
  int64_t unset = -1;
  first_checkpoint_step_.compare_exchange_strong(unset, step);
  const int64_t due = f.checkpoint_fault_step == 0 ? first_checkpoint_step_.load() : f.checkpoint_fault_step;
  return step == due ? f.checkpoint_fault : "";
}

bool FaultInjector::apply(const FaultRequest& request, int64_t next_step) {
  auto log = common::logger("faults");
  const int64_t step = request.step == -1 ? next_step : request.step;
  common::Config changed = config_;
  auto& f = changed.faults;
  // Faults of the config meant for another generation stay off: the
  // request arms this generation only.
  if (!armed()) {
    f.nan_rank = f.hang_rank = f.slow_rank = f.bitflip_rank = -1;
    f.checkpoint_fault.clear();
  }
  f.fault_generation = generation_;
  const std::string target = board_text(request.target), group = board_text(request.group);
  switch (static_cast<FaultKind>(request.kind)) {
    case FaultKind::kCrash:
      f.crash_rank = rank_;
      f.crash_step = step;
      f.crash_generation = generation_;
      f.crash_in = "step";
      break;
    case FaultKind::kHang:
      f.hang_rank = rank_;
      f.hang_step = step;
      if (!group.empty()) f.hang_group = group;
      break;
    case FaultKind::kSlow:
      f.slow_rank = rank_;
      f.slow_factor = request.factor;
      break;
    case FaultKind::kBitflip:
      if (target == "blas_core") {
        log->warn("ignoring keelctl inject request {}: a BLAS core is proved at start only; set "
                  "faults.bitflip_target = \"blas_core\" in the config instead",
                  request.count);
        return false;
      }
      f.bitflip_rank = rank_;
      f.bitflip_step = step;
      if (!target.empty()) f.bitflip_target = target;
      f.bitflip_tensor = board_text(request.tensor);
      f.bitflip_bit = request.bit;
      break;
    case FaultKind::kNan:
      f.nan_rank = rank_;
      f.nan_step = step;
      if (!target.empty()) f.nan_target = target;
      break;
    default:
      log->warn("ignoring keelctl inject request {}: kind {} is not a fault this rank injects", request.count,
                request.kind);
      return false;
  }
  try {
    changed.validate();
  } catch (const common::Error& e) {
    log->warn("ignoring keelctl inject request {} ({}): {}", request.count, fault_kind_name(request.kind), e.what());
    return false;
  }
  log->warn("keelctl inject request {}: {} on this rank at step {}", request.count, fault_kind_name(request.kind),
            step);
  {
    std::lock_guard lock(mutex_);
    config_ = std::move(changed);
  }
  if (static_cast<FaultKind>(request.kind) == FaultKind::kSlow) slow_from_step_ = step;
  if (static_cast<FaultKind>(request.kind) == FaultKind::kBitflip) flipped_ = false;
  return true;
}

}  // namespace keel::health
