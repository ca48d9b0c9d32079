#include "health/straggler_monitor.h"

#include "common/log.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace keel::health {
namespace {

// A compute time past this (a day) is garbage, not a slow step.
constexpr float kMaxComputeMs = 86'400'000.0f;
// Steps a rank may be ahead of the slowest participant before its oldest
// are dropped (and skipped): bounds the memory a stalled rank can cost.
constexpr size_t kMaxPending = 8 * kRecentSteps;
// The MAD of a normal sample times this estimates its standard deviation.
constexpr double kMadToSigma = 1.4826;
// A slow window's score exceeds this many spreads too, the spread being
// learned from the scores of this many recent windows.
constexpr double kSpreads = 3;
constexpr size_t kSpreadWindows = 20;

bool plausible(float compute_ms) { return std::isfinite(compute_ms) && compute_ms >= 0 && compute_ms <= kMaxComputeMs; }

// The median of `values` (the mean of the middle two for an even count);
// reorders them.
double median(std::vector<double>& values) {
  const size_t n = values.size(), mid = n / 2;
  std::nth_element(values.begin(), values.begin() + mid, values.end());
  const double upper = values[mid];
  if (n % 2 == 1) return upper;
  return (*std::max_element(values.begin(), values.begin() + mid) + upper) / 2;
}

}  // namespace

nlohmann::json StragglerFinding::to_json() const { return {{"rank", rank}, {"score", score}, {"step", step}}; }

StragglerMonitor::StragglerMonitor(const common::HealthConfig& config, size_t history_steps)
    : config_(config), history_steps_(history_steps) {
  // The config was validated (window >= 2, windows >= 1); a hand-made one
  // still never divides a window into nothing.
  config_.straggler_window = std::max<int64_t>(config_.straggler_window, 1);
  config_.straggler_windows = std::max<int64_t>(config_.straggler_windows, 1);
}

std::vector<StragglerFinding> StragglerMonitor::observe(const RankSamples& samples, int64_t /*now_ns*/) {
  // Only step numbers order the evidence, never the time: a clock that
  // jumps changes nothing here.
  if (ranks_.size() < samples.size()) ranks_.resize(samples.size());
  std::vector<int> participants;
  int64_t newest = std::numeric_limits<int64_t>::max();
  for (size_t r = 0; r < samples.size(); ++r) {
    const BoardSnapshot* board = trusted_board(samples[r]);
    if (board == nullptr) continue;
    RankState& rank = ranks_[r];
    if (board->generation != rank.generation) {
      // A restarted rank times its steps again; what the old process
      // timed and nobody took is not this one's.
      rank.generation = board->generation;
      rank.newest = -1;
      rank.pending.clear();
    }
    rank.pending.erase(rank.pending.begin(), rank.pending.lower_bound(next_step_));
    for (const StepTiming& t : board->steps) {
      if (board->timing_of(t.step) != &t || t.step < next_step_ || !plausible(t.compute_ms)) continue;
      rank.pending.emplace(t.step, t.compute_ms);
      rank.newest = std::max(rank.newest, t.step);
    }
    while (rank.pending.size() > kMaxPending) rank.pending.erase(rank.pending.begin());
    participants.push_back(static_cast<int>(r));
    newest = std::min(newest, rank.newest);
  }
  std::vector<StragglerFinding> found;
  if (!participants.empty() && newest >= next_step_) take_steps(participants, newest, found);
  return found;
}

void StragglerMonitor::take_steps(const std::vector<int>& participants, int64_t newest,
                                  std::vector<StragglerFinding>& found) {
  // Every step some participant timed in [next_step_, newest], ascending.
  // Each participant has timed `newest`, and a ring is written in step
  // order, so a step missing now was overwritten before it was read: it is
  // skipped, never guessed.
  std::map<int64_t, std::vector<float>> steps;
  for (int r : participants) {
    auto& pending = ranks_[r].pending;
    const auto end = pending.upper_bound(newest);
    for (auto it = pending.begin(); it != end; ++it) {
      auto& row = steps.try_emplace(it->first, ranks_.size(), std::numeric_limits<float>::quiet_NaN()).first->second;
      row[r] = it->second;
    }
    pending.erase(pending.begin(), end);
  }
  next_step_ = newest + 1;

  if (window_ranks_ != participants) {
    // A rank joined or left: a window compares the same ranks throughout.
    window_ranks_ = participants;
    window_steps_ = 0;
    for (auto& rank : ranks_) {
      rank.ratios.clear();
      rank.computes.clear();
    }
  }
  std::vector<double> computes;
  for (auto& [step, row] : steps) {
    computes.clear();
    for (int r : participants) {
      if (!std::isnan(row[r])) computes.push_back(row[r]);
    }
    if (computes.size() == participants.size()) {
      const double slowest = *std::max_element(computes.begin(), computes.end());
      const double centre = median(computes);
      // A step nobody computed in (zero everywhere) compares nobody.
      if (centre > 0) {
        tax_sum_ += slowest / centre;
        ++tax_steps_;
        for (int r : participants) {
          ranks_[r].ratios.push_back(row[r] / centre);
          ranks_[r].computes.push_back(row[r]);
        }
        window_last_step_ = step;
        if (++window_steps_ == config_.straggler_window) close_window(participants, found);
      }
    }
    history_.emplace_back(step, std::move(row));
    if (history_.size() > history_steps_) history_.pop_front();
  }
}

void StragglerMonitor::close_window(const std::vector<int>& participants, std::vector<StragglerFinding>& found) {
  std::vector<double> values;
  for (int r : participants) {
    RankState& rank = ranks_[r];
    rank.window_ms = median(rank.computes);
    values.push_back(median(rank.ratios));
    rank.ratios.clear();
    rank.computes.clear();
  }
  window_steps_ = 0;
  std::vector<double> sorted = values;
  const double centre = median(sorted);
  std::vector<double> scores(ranks_.size(), std::numeric_limits<double>::quiet_NaN());
  for (size_t i = 0; i < participants.size(); ++i) scores[participants[i]] = values[i] / centre - 1;
  recent_scores_.push_back(scores);
  if (recent_scores_.size() > kSpreadWindows) recent_scores_.pop_front();

  static const auto log = common::logger("health");
  for (int r : participants) {
    RankState& rank = ranks_[r];
    rank.score = scores[r];
    // The spread only matters above the threshold, where it is worth
    // learning without the rank's own scores, which would widen it.
    const double spread = rank.score > config_.straggler_threshold ? spread_without(r) : 0;
    const bool slow = rank.score > config_.straggler_threshold && rank.score > kSpreads * spread;
    // Evidence counts slow windows net of fast ones, so one noisy window
    // delays a flag by a window instead of starting it over; the flag
    // clears only when the evidence is gone, so a slow rank's noisy
    // windows do not raise it again and again.
    rank.evidence = std::clamp<int64_t>(rank.evidence + (slow ? 1 : -1), 0, config_.straggler_windows);
    if (rank.evidence == 0) rank.flagged = false;
    if (!slow) continue;
    log->debug("rank {} slow in the window ending at step {}: score {:.3f}, spread {:.3f}, evidence {}", r,
               window_last_step_, rank.score, spread, rank.evidence);
    if (rank.evidence >= config_.straggler_windows && !rank.flagged) {
      rank.flagged = true;
      found.push_back({r, rank.score, window_last_step_});
    }
  }
}

double StragglerMonitor::spread_without(int rank) const {
  std::vector<double> pool;
  for (const auto& window : recent_scores_) {
    for (size_t r = 0; r < window.size(); ++r) {
      if (static_cast<int>(r) != rank && !std::isnan(window[r])) pool.push_back(window[r]);
    }
  }
  if (pool.empty()) return 0;
  const double centre = median(pool);
  for (double& s : pool) s = std::abs(s - centre);
  return kMadToSigma * median(pool);
}

bool StragglerMonitor::flagged(int rank) const {
  return rank >= 0 && static_cast<size_t>(rank) < ranks_.size() && ranks_[rank].flagged;
}

double StragglerMonitor::score(int rank) const {
  return rank >= 0 && static_cast<size_t>(rank) < ranks_.size() ? ranks_[rank].score : 0;
}

double StragglerMonitor::sync_tax() const { return tax_steps_ > 0 ? tax_sum_ / static_cast<double>(tax_steps_) : 1; }

nlohmann::json StragglerMonitor::report() const {
  nlohmann::json ranks = nlohmann::json::array(), steps = nlohmann::json::array(),
                 compute = nlohmann::json::array();
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const RankState& rank = ranks_[r];
    ranks.push_back({{"rank", r},
                     {"median_compute_ms", rank.window_ms >= 0 ? nlohmann::json(rank.window_ms) : nlohmann::json()},
                     {"score", rank.score},
                     {"flagged", rank.flagged}});
    nlohmann::json row = nlohmann::json::array();
    for (const auto& [step, row_ms] : history_) {
      row.push_back(r < row_ms.size() && !std::isnan(row_ms[r]) ? nlohmann::json(row_ms[r]) : nlohmann::json());
    }
    compute.push_back(std::move(row));
  }
  for (const auto& entry : history_) steps.push_back(entry.first);
  return {{"window", config_.straggler_window},
          {"windows", config_.straggler_windows},
          {"threshold", config_.straggler_threshold},
          {"sync_tax", sync_tax()},
          {"ranks", std::move(ranks)},
          {"steps", std::move(steps)},
          {"compute_ms", std::move(compute)}};
}

}  // namespace keel::health
