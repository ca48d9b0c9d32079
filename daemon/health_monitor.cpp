#include "daemon/health_monitor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace keel::daemon {
namespace {

std::string hung_reason(const health::HangFinding& f, int rank) {
  const bool frozen = std::find(f.frozen_ranks.begin(), f.frozen_ranks.end(), rank) != f.frozen_ranks.end();
  return fmt::format("{} while ranks [{}] waited {:.1f} s in {} #{} ({})",
                     frozen ? "frozen (its heartbeat stopped)" : "never began the collective", fmt::join(f.waiting_ranks, ", "),
                     f.detect_s, f.group, f.seq, f.op);
}

std::string suspect_reason(const SdcFinding& f) {
  if (f.method == "replica_digest") {
    return fmt::format("at step {} its replica digest differed from the majority of {} replicas ({})", f.step,
                       f.replicas, f.verdict);
  }
  if (f.method == "rerun") return fmt::format("at step {} a rerun of the step gave other numbers ({})", f.step, f.verdict);
  return fmt::format("at step {} its known-answer kernel test failed ({})", f.step, f.verdict);
}

// Says which of the three it is, with the run-queue wait and the stalls
// that tell them apart (health/straggler_monitor.h).
std::string straggler_reason(const health::StragglerFinding& f) {
  if (f.cause == health::StragglerCause::kStalled) {
    return fmt::format(
        "stalled: up to step {} it spent {:.1f}% of its compute neither running nor waiting for a CPU, the other "
        "ranks {:.1f}% (median), which made it {:.1f}% slower than the median rank: it was stopped (SIGSTOP, a "
        "cgroup's freezer or CPU quota) or blocked in the kernel (page faults, swap); look at what throttles or "
        "stops its process on its host",
        f.step, 100 * f.stalled_share, 100 * f.peers_stalled_share, 100 * f.score);
  }
  if (f.cause == health::StragglerCause::kHost) {
    return fmt::format(
        "host contention: up to step {} it waited for a CPU {:.1f}% of its step time, the other ranks {:.1f}% "
        "(median), which made it {:.1f}% slower than the median rank, more than its own compute explains: find "
        "what else runs on its cores",
        f.step, 100 * f.cpu_wait_share, 100 * f.peers_cpu_wait_share, 100 * f.score);
  }
  return fmt::format(
      "its compute was {:.1f}% above the median rank's up to step {}, not its host's doing: it waited for a CPU "
      "{:.1f}% of its step time, the other ranks {:.1f}% (median)",
      100 * f.score, f.step, 100 * f.cpu_wait_share, 100 * f.peers_cpu_wait_share);
}

}  // namespace

const char* rank_condition_name(RankCondition condition) {
  switch (condition) {
    case RankCondition::kHealthy: return "healthy";
    case RankCondition::kStraggler: return "straggler";
    case RankCondition::kSuspect: return "suspect";
    case RankCondition::kHung: return "hung";
  }
  return "unknown";
}

nlohmann::json SdcFinding::event_fields() const {
  nlohmann::json out = {{"rank", rank}, {"step", step}, {"method", method}, {"verdict", verdict}};
  if (method == "replica_digest") out["replicas"] = replicas;
  if (last_good_step) out["last_good_step"] = *last_good_step;
  if (rank < 0 && !disagreeing.empty()) out["ranks"] = disagreeing;
  return out;
}

HealthMonitor::HealthMonitor(const common::HealthConfig& config, int world)
    : config_(config),
      hangs_(config),
      stragglers_(config),
      digests_(std::in_place),
      flags_(static_cast<size_t>(world)),
      sdc_reports_seen_(static_cast<size_t>(world), 0),
      placement_(static_cast<size_t>(world)) {}

void HealthMonitor::new_generation(const std::vector<std::string>& placement) {
  if (placement != placement_) {
    flags_.assign(placement.size(), Flags{});
    stragglers_ = health::StragglerMonitor(config_);
    placement_ = placement;
  }
  sdc_reports_seen_.resize(placement.size());
  digests_.emplace();
  for (auto& f : flags_) f.hung.clear();
  std::fill(sdc_reports_seen_.begin(), sdc_reports_seen_.end(), 0);
  sdc_seen_.clear();
}

void HealthMonitor::take_sdc(const SdcFinding& finding, Verdicts& verdicts) {
  if (!sdc_seen_.insert({finding.rank, finding.step, finding.method}).second) return;
  ++counts_.sdc;
  if (finding.rank >= 0) flags_[static_cast<size_t>(finding.rank)].suspect = suspect_reason(finding);
  verdicts.sdc.push_back(finding);
}

Verdicts HealthMonitor::observe(const health::RankSamples& samples, int64_t now_ns) {
  Verdicts verdicts;

  for (auto& finding : hangs_.observe(samples, now_ns)) {
    ++counts_.hang;
    for (const int r : finding.culprit_ranks) {
      if (valid_rank(r)) flags_[static_cast<size_t>(r)].hung = hung_reason(finding, r);
    }
    verdicts.hangs.push_back(std::move(finding));
  }

  find_sdc(samples, now_ns, verdicts);

  for (auto& finding : stragglers_.observe(samples, now_ns)) {
    if (!valid_rank(finding.rank)) continue;
    ++counts_.straggler;
    flags_[static_cast<size_t>(finding.rank)].straggler = straggler_reason(finding);
    verdicts.stragglers.push_back(std::move(finding));
  }
  for (int r = 0; r < static_cast<int>(flags_.size()); ++r) {
    if (!stragglers_.flagged(r)) flags_[static_cast<size_t>(r)].straggler.clear();
  }
  return verdicts;
}

Verdicts HealthMonitor::last_words(health::RankSamples samples, int64_t now_ns) {
  for (auto& s : samples) s.running = true;
  Verdicts verdicts;
  find_sdc(samples, now_ns, verdicts);
  return verdicts;
}

void HealthMonitor::find_sdc(const health::RankSamples& samples, int64_t now_ns, Verdicts& verdicts) {
  for (const auto& d : digests_->observe(samples, now_ns)) {
    SdcFinding finding{-1, d.step, "replica_digest", "persistent", d.replicas, {}, d.last_agreed_step};
    if (d.odd_ranks.empty()) {
      finding.disagreeing = d.disagreeing;
      take_sdc(finding, verdicts);
    }
    for (const int r : d.odd_ranks) {
      if (!valid_rank(r)) continue;
      finding.rank = r;
      take_sdc(finding, verdicts);
    }
  }

  // The ranks' own findings: a report is new when the board's count moved.
  // The board is not trusted: a method or verdict out of range names nobody.
  for (const auto& s : samples) {
    if (!s.board || !valid_rank(s.rank)) continue;
    const auto& report = s.board->sdc;
    uint64_t& seen = sdc_reports_seen_[static_cast<size_t>(s.rank)];
    if (report.count == 0 || report.count == seen) continue;
    seen = report.count;
    const std::string method = health::sdc_method_name(report.method);
    const std::string verdict = health::sdc_verdict_name(report.verdict);
    if (method == "none" || method == "unknown" || verdict == "none" || verdict == "unknown") continue;
    take_sdc({valid_rank(report.rank) ? report.rank : -1, report.step, method, verdict, 0, {}, std::nullopt}, verdicts);
  }
}

RankHealth HealthMonitor::rank(int rank) const {
  if (rank < 0 || rank >= static_cast<int>(flags_.size())) return {};
  const Flags& f = flags_[static_cast<size_t>(rank)];
  if (!f.hung.empty()) return {RankCondition::kHung, f.hung};
  if (!f.suspect.empty()) return {RankCondition::kSuspect, f.suspect};
  if (!f.straggler.empty()) return {RankCondition::kStraggler, f.straggler};
  return {};
}

nlohmann::json HealthMonitor::health_json() const {
  nlohmann::json ranks = nlohmann::json::array();
  for (int r = 0; r < static_cast<int>(flags_.size()); ++r) {
    const RankHealth h = rank(r);
    ranks.push_back({{"rank", r}, {"health", rank_condition_name(h.condition)}, {"reason", h.reason}});
  }
  return {{"ranks", ranks},
          {"detections", {{"hang", counts_.hang}, {"sdc", counts_.sdc}, {"straggler", counts_.straggler}}},
          {"hang_budgets", hangs_.budgets_json()},
          {"sync_tax", stragglers_.sync_tax()}};
}

}  // namespace keel::daemon
