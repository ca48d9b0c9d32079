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
// One step adds at most (kClipThresholds - 1) k to a rank's evidence, and
// flagging takes at least kMinFlagSteps such steps.
constexpr double kClipThresholds = 2.5;
constexpr double kMinFlagSteps = 16;
// Steps of log ratios the noise is learned from, and how many it needs
// before any rank gathers evidence.
constexpr size_t kNoiseSteps = 200;
constexpr size_t kWarmupSteps = 20;

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

// The decision interval for a CUSUM whose steps add `excess` - `allowed`:
// ln(`false_alarms`) / theta, theta > 0 solving mean(exp(theta (y -
// allowed))) = 1 over `excess` (Wald: noise like `excess` crosses it about
// once in `false_alarms` steps), and at least `least`. Infinite when the
// excess averages (`mean`) `allowed` or more: noise alone would cross any
// interval.
double decision_interval(const std::vector<double>& excess, double mean, double allowed, double false_alarms,
                         double least) {
  const double log_alarms = std::log(false_alarms);
  const auto mean_growth = [&](double theta) {
    double sum = 0;
    for (double y : excess) sum += std::exp(theta * (y - allowed));
    return sum / static_cast<double>(excess.size()) - 1;
  };
  // Past this theta the interval would be below `least` anyway; it also
  // keeps the exponents small, as `least` spans several of the largest
  // steps of excess.
  double lo = 0, hi = log_alarms / least;
  if (mean_growth(hi) <= 0) return least;
  if (mean >= allowed) return std::numeric_limits<double>::infinity();
  // mean_growth is convex, 0 at 0 and falling there: one root in (0, hi].
  for (int i = 0; i < 40; ++i) {
    const double mid = (lo + hi) / 2;
    (mean_growth(mid) < 0 ? lo : hi) = mid;
  }
  // lo is below the root, so the interval errs long.
  return lo > 0 ? std::max(log_alarms / lo, least) : std::numeric_limits<double>::infinity();
}

}  // namespace

nlohmann::json StragglerFinding::to_json() const { return {{"rank", rank}, {"score", score}, {"step", step}}; }

StragglerMonitor::StragglerMonitor(const common::HealthConfig& config, size_t history_steps)
    : config_(config),
      allowed_(std::log1p(config.straggler_threshold)),
      clip_(kClipThresholds * allowed_),
      history_steps_(history_steps) {
  // The config was validated (window >= 2, false alarms >= 1000); a
  // hand-made one still never divides a window into nothing.
  config_.straggler_window = std::max<int64_t>(config_.straggler_window, 1);
  config_.straggler_false_alarm_steps = std::max<int64_t>(config_.straggler_false_alarm_steps, 2);
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
    rank.stage = pipeline_stage(*board);
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
  std::vector<double> computes, x(ranks_.size(), std::numeric_limits<double>::quiet_NaN());
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
          // Floored, so a step of no compute is very fast, not -infinity.
          x[r] = std::log(std::max<double>(row[r], centre * 1e-3) / centre);
        }
        recent_x_.push_back(x);
        if (recent_x_.size() > kNoiseSteps) recent_x_.pop_front();
        if (noise_) add_evidence(participants, x, step, found);
        if (++window_steps_ == config_.straggler_window) {
          close_window(participants);
          if (recent_x_.size() >= kWarmupSteps) {
            const bool first = !noise_;
            learn_noise(participants);
            // The warm-up delays the verdict, not the evidence: the steps
            // it held count now.
            if (first && noise_) {
              for (const auto& held : recent_x_) add_evidence(participants, held, step, found);
            }
          }
        }
      }
    }
    history_.emplace_back(step, std::move(row));
    if (history_.size() > history_steps_) history_.pop_front();
  }
}

void StragglerMonitor::add_evidence(const std::vector<int>& participants, const std::vector<double>& x, int64_t step,
                                    std::vector<StragglerFinding>& found) {
  const double h = noise_->decision_interval;
  // Noise that drowns the threshold is no evidence against anyone.
  if (std::isinf(h)) return;
  for (int r : participants) {
    if (std::isnan(x[r])) continue;  // a step from before the rank took part
    RankState& rank = ranks_[r];
    const auto level = noise_->centres.find(rank.stage);
    if (level == noise_->centres.end()) continue;  // a stage the noise was not learned with
    const double excess = x[r] - level->second;
    // Capped at h: a flagged rank that recovers clears within h / k steps.
    rank.evidence = std::min(std::max(0.0, rank.evidence + std::clamp(excess, -clip_, clip_) - allowed_), h);
    if (rank.evidence == 0) {
      rank.flagged = false;
      rank.excess_sum = 0;
      rank.excess_steps = 0;
      continue;
    }
    rank.excess_sum += excess;
    ++rank.excess_steps;
    if (rank.evidence >= h && !rank.flagged) {
      rank.flagged = true;
      found.push_back({r, std::expm1(rank.excess_sum / static_cast<double>(rank.excess_steps)), step});
    }
  }
}

void StragglerMonitor::close_window(const std::vector<int>& participants) {
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
  for (size_t i = 0; i < participants.size(); ++i) ranks_[participants[i]].score = values[i] / centre - 1;
}

void StragglerMonitor::learn_noise(const std::vector<int>& participants) {
  // Each rank's median x; the median of a stage's is its normal level,
  // robust to the slow ranks, which are left out of the noise so as not to
  // widen it.
  std::vector<double> own(ranks_.size(), std::numeric_limits<double>::quiet_NaN()), column;
  std::map<int, std::vector<double>> levels;
  for (int r : participants) {
    column.clear();
    for (const auto& x : recent_x_) {
      if (!std::isnan(x[r])) column.push_back(x[r]);
    }
    if (column.empty()) continue;
    own[r] = median(column);
    levels[ranks_[r].stage].push_back(own[r]);
  }
  if (levels.empty()) return;
  Noise noise;
  for (auto& [stage, stage_levels] : levels) noise.centres[stage] = median(stage_levels);
  std::vector<double> excess;
  for (int r : participants) {
    const auto level = noise.centres.find(ranks_[r].stage);
    if (level == noise.centres.end() || !(own[r] - level->second < allowed_)) continue;
    for (const auto& x : recent_x_) {
      if (!std::isnan(x[r])) excess.push_back(std::clamp(x[r] - level->second, -clip_, clip_));
    }
  }
  if (excess.empty()) return;  // cannot be: the median rank is never slow
  double sum = 0, squares = 0;
  for (double y : excess) {
    sum += y;
    squares += y * y;
  }
  const double n = static_cast<double>(excess.size()), mean = sum / n;
  noise.spread = std::sqrt(std::max(0.0, squares / n - mean * mean));
  noise.decision_interval = decision_interval(
      excess, mean, allowed_,
      static_cast<double>(config_.straggler_false_alarm_steps) * static_cast<double>(participants.size()),
      kMinFlagSteps * (clip_ - allowed_));

  static const auto log = common::logger("health");
  const bool drowned = std::isinf(noise.decision_interval);
  if (drowned != (noise_ && std::isinf(noise_->decision_interval))) {
    if (drowned) {
      log->warn("the ranks' compute varies too much from step to step (spread {:.1f}%) to tell a rank slower by "
                "straggler_threshold = {} apart; no rank is flagged until it calms or the threshold is raised",
                100 * noise.spread, config_.straggler_threshold);
    } else {
      log->info("the ranks' compute noise (spread {:.1f}%) allows flagging stragglers again", 100 * noise.spread);
    }
  }
  log->debug("straggler noise: {} stage level(s), spread {:.4f}, decision interval {:.3f}", noise.centres.size(), noise.spread,
             noise.decision_interval);
  noise_ = noise;
}

bool StragglerMonitor::flagged(int rank) const {
  return rank >= 0 && static_cast<size_t>(rank) < ranks_.size() && ranks_[rank].flagged;
}

double StragglerMonitor::score(int rank) const {
  return rank >= 0 && static_cast<size_t>(rank) < ranks_.size() ? ranks_[rank].score : 0;
}

double StragglerMonitor::sync_tax() const { return tax_steps_ > 0 ? tax_sum_ / static_cast<double>(tax_steps_) : 1; }

nlohmann::json StragglerMonitor::report() const {
  const auto finite_or_null = [](std::optional<double> v) {
    return v && std::isfinite(*v) ? nlohmann::json(*v) : nlohmann::json();
  };
  nlohmann::json ranks = nlohmann::json::array(), steps = nlohmann::json::array(),
                 compute = nlohmann::json::array();
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const RankState& rank = ranks_[r];
    const double h = noise_ ? noise_->decision_interval : 0;
    ranks.push_back({{"rank", r},
                     {"median_compute_ms", rank.window_ms >= 0 ? nlohmann::json(rank.window_ms) : nlohmann::json()},
                     {"score", rank.score},
                     {"evidence", h > 0 && std::isfinite(h) ? rank.evidence / h : 0.0},
                     {"flagged", rank.flagged}});
    nlohmann::json row = nlohmann::json::array();
    for (const auto& [step, row_ms] : history_) {
      row.push_back(r < row_ms.size() && !std::isnan(row_ms[r]) ? nlohmann::json(row_ms[r]) : nlohmann::json());
    }
    compute.push_back(std::move(row));
  }
  for (const auto& entry : history_) steps.push_back(entry.first);
  return {{"window", config_.straggler_window},
          {"threshold", config_.straggler_threshold},
          {"false_alarm_steps", config_.straggler_false_alarm_steps},
          {"sync_tax", sync_tax()},
          {"noise", finite_or_null(noise_ ? std::optional(noise_->spread) : std::nullopt)},
          {"decision_interval", finite_or_null(noise_ ? std::optional(noise_->decision_interval) : std::nullopt)},
          {"ranks", std::move(ranks)},
          {"steps", std::move(steps)},
          {"compute_ms", std::move(compute)}};
}

}  // namespace keel::health
