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
// The shapes of slowness the streams' CUSUMs look for (why:
// straggler_monitor.h), in thresholds k: a step adds its excess past
// `allowance` k, at most `clip` k, and flagging takes at least
// `least_steps` steps at the clip.
// The noise is learned from the ranks that do not look slow, `quiet`:
// those whose median is within k of their level, or the quieter half by
// the mean of their increments.
enum class Quiet { kNotSlow, kQuieterHalf };
struct TierShape {
  double allowance, clip, least_steps;
  Quiet quiet;
};
constexpr TierShape kTierShapes[] = {
    {1, 2.5, 16, Quiet::kNotSlow},     // steady: every step a little slow
    {1.5, 10, 6, Quiet::kNotSlow},     // in bursts: some steps much slower
    {0.5, 25, 1.5, Quiet::kQuieterHalf},  // stalls: some seen, each counted up to as long as it worked
};
// The tiers each stream runs: compute and busy time the first two, stalls the third.
constexpr bool kRunsTier[3][3] = {{true, true, false}, {true, true, false}, {false, false, true}};
// Steps of log ratios the noise is learned from, and how many it needs
// before any rank gathers evidence.
constexpr size_t kNoiseSteps = 200;
constexpr size_t kWarmupSteps = 20;

bool plausible(float compute_ms) { return std::isfinite(compute_ms) && compute_ms >= 0 && compute_ms <= kMaxComputeMs; }

// A step's stalls over its work (compute less stalls), 0 for a step of no
// compute, and at most 1000: its mean over steps is the share of its
// time a rank loses to stalls.
double stall_of(const double compute_ms, const double stalled_ms) {
  if (!(compute_ms > 0)) return 0;
  const double stalled = std::clamp(stalled_ms, 0.0, compute_ms);
  return stalled / std::max(compute_ms - stalled, compute_ms * 1e-3);
}

// The median of `values` (the mean of the middle two for an even count);
// reorders them.
double median(std::vector<double>& values) {
  const size_t n = values.size(), mid = n / 2;
  std::nth_element(values.begin(), values.begin() + mid, values.end());
  const double upper = values[mid];
  if (n % 2 == 1) return upper;
  return (*std::max_element(values.begin(), values.begin() + mid) + upper) / 2;
}

// The decision interval for a CUSUM that moves by `increments` (a step's
// clipped excess minus k): ln(`false_alarms`) / theta, theta > 0 solving
// mean(exp(theta d)) = 1 over the increments d (Wald: noise like them
// crosses it about once in `false_alarms` steps), and at least `least`.
// Infinite when the increments average 0 or more: noise alone would cross
// any interval.
double decision_interval(const std::vector<double>& increments, double false_alarms, double least) {
  const double log_alarms = std::log(false_alarms);
  const auto mean_growth = [&](double theta) {
    double sum = 0;
    for (double d : increments) sum += std::exp(theta * d);
    return sum / static_cast<double>(increments.size()) - 1;
  };
  // Past this theta the interval would be below `least` anyway; it also
  // keeps the exponents small, as `least` spans several of the largest
  // increments.
  double lo = 0, hi = log_alarms / least;
  if (mean_growth(hi) <= 0) return least;
  double mean = 0;
  for (double d : increments) mean += d / static_cast<double>(increments.size());
  if (mean >= 0) return std::numeric_limits<double>::infinity();
  // mean_growth is convex, 0 at 0 and falling there: one root in (0, hi].
  for (int i = 0; i < 40; ++i) {
    const double mid = (lo + hi) / 2;
    (mean_growth(mid) < 0 ? lo : hi) = mid;
  }
  // lo is below the root, so the interval errs long.
  return lo > 0 ? std::max(log_alarms / lo, least) : std::numeric_limits<double>::infinity();
}

}  // namespace

const char* straggler_cause_name(StragglerCause cause) {
  switch (cause) {
    case StragglerCause::kHost: return "host";
    case StragglerCause::kStalled: return "stalled";
    case StragglerCause::kCompute: break;
  }
  return "compute";
}

nlohmann::json StragglerFinding::to_json() const {
  return {{"rank", rank},
          {"score", score},
          {"step", step},
          {"cause", straggler_cause_name(cause)},
          {"cpu_wait_share", cpu_wait_share},
          {"peers_cpu_wait_share", peers_cpu_wait_share},
          {"stalled_share", stalled_share},
          {"peers_stalled_share", peers_stalled_share}};
}

StragglerMonitor::StragglerMonitor(const common::HealthConfig& config, size_t history_steps)
    : config_(config),
      allowed_(std::log1p(config.straggler_threshold)),
      history_steps_(history_steps) {
  for (int tier = 0; tier < kTiers; ++tier) {
    const TierShape& shape = kTierShapes[tier];
    tiers_[tier] = {shape.allowance * allowed_, shape.clip * allowed_,
                    shape.least_steps * (shape.clip - shape.allowance) * allowed_};
  }
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
      const bool wait_plausible = plausible(t.cpu_wait_ms) && plausible(t.own_cpu_wait_ms) && plausible(t.total_ms);
      // The host's part of its run-queue wait: its own threads' is keel's.
      const float host_wait = std::max(0.0f, t.cpu_wait_ms - t.own_cpu_wait_ms);
      rank.pending.emplace(t.step, Timing{t.compute_ms, wait_plausible ? host_wait : 0.0f,
                                          wait_plausible ? t.total_ms : 0.0f,
                                          plausible(t.stalled_ms) ? t.stalled_ms : 0.0f});
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
  const Timing unseen{std::numeric_limits<float>::quiet_NaN(), 0, 0, 0};
  std::map<int64_t, std::vector<Timing>> steps;
  for (int r : participants) {
    auto& pending = ranks_[r].pending;
    const auto end = pending.upper_bound(newest);
    for (auto it = pending.begin(); it != end; ++it) {
      steps.try_emplace(it->first, ranks_.size(), unseen).first->second[r] = it->second;
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
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> computes, busy, stalls(ranks_.size(), 0.0), others;
  for (auto& [step, row] : steps) {
    computes.clear();
    busy.clear();
    for (int r : participants) {
      if (std::isnan(row[r].compute_ms)) continue;
      computes.push_back(row[r].compute_ms);
      busy.push_back(row[r].compute_ms + row[r].cpu_wait_ms);
      stalls[r] = stall_of(row[r].compute_ms, row[r].stalled_ms);
    }
    if (computes.size() == participants.size()) {
      const double slowest = *std::max_element(computes.begin(), computes.end());
      const double centre = median(computes), busy_centre = median(busy);
      // A step nobody computed in (zero everywhere) compares nobody.
      if (centre > 0) {
        tax_sum_ += slowest / centre;
        ++tax_steps_;
        StepRatios x;
        x.fill(std::vector<double>(ranks_.size(), nan));
        for (int r : participants) {
          RankState& rank = ranks_[r];
          const Timing& t = row[r];
          rank.ratios.push_back(t.compute_ms / centre);
          rank.computes.push_back(t.compute_ms);
          // Floored, so a step of no compute is very fast, not -infinity.
          x[kCompute][r] = std::log(std::max<double>(t.compute_ms, centre * 1e-3) / centre);
          x[kBusy][r] = std::log(std::max<double>(t.compute_ms + t.cpu_wait_ms, busy_centre * 1e-3) / busy_centre);
          others.clear();
          for (int o : participants) {
            if (o != r) others.push_back(stalls[o]);
          }
          x[kStalled][r] = stalls[r] - (others.empty() ? 0.0 : median(others));
          // What the table shows: averages over about a window of steps.
          const double alpha = 1.0 / static_cast<double>(config_.straggler_window);
          const double c = centre_of(kCompute, rank.stage).value_or(0.0);
          rank.recent_excess += alpha * (x[kCompute][r] - c - rank.recent_excess);
          rank.recent_stall_excess +=
              alpha * (x[kStalled][r] - centre_of(kStalled, rank.stage).value_or(0.0) - rank.recent_stall_excess);
          if (t.total_ms > 0) rank.cpu_wait_share += alpha * (t.cpu_wait_ms / t.total_ms - rank.cpu_wait_share);
          if (t.compute_ms > 0) {
            rank.stalled_share +=
                alpha * (std::clamp<double>(t.stalled_ms / t.compute_ms, 0, 1) - rank.stalled_share);
          }
        }
        recent_x_.push_back(x);
        if (recent_x_.size() > kNoiseSteps) recent_x_.pop_front();
        if (noise_) add_evidence(participants, x, step, found);
        if (++window_steps_ == config_.straggler_window) {
          close_window(participants);
          if (recent_x_.size() >= kWarmupSteps) {
            const bool first = !noise_;
            // The warm-up delays the verdict, not the evidence: the steps
            // it held count now.
            if (learn_noise(participants) && first) {
              for (const auto& held : recent_x_) add_evidence(participants, held, step, found);
            }
          }
        }
      }
    }
    std::vector<float> computed(row.size());
    for (size_t r = 0; r < row.size(); ++r) computed[r] = row[r].compute_ms;
    history_.emplace_back(step, std::move(computed));
    if (history_.size() > history_steps_) history_.pop_front();
  }
}

std::optional<double> StragglerMonitor::centre_of(Stream stream, int stage) const {
  if (!noise_) return std::nullopt;
  const auto& centres = (*noise_)[stream].centres;
  const auto level = centres.find(stage);
  return level == centres.end() ? std::nullopt : std::optional(level->second);
}

void StragglerMonitor::add_evidence(const std::vector<int>& participants, const StepRatios& x, int64_t step,
                                    std::vector<StragglerFinding>& found) {
  for (int r : participants) {
    RankState& rank = ranks_[r];
    for (const Stream stream : {kCompute, kBusy, kStalled}) {
      const auto level = centre_of(stream, rank.stage);
      // A step from before the rank took part is no evidence against it,
      // nor is a stage the noise was not learned with.
      if (std::isnan(x[stream][r]) || !level) continue;
      const double excess = x[stream][r] - *level;
      for (int tier = 0; tier < kTiers; ++tier) {
        const Cusum& cusum = tiers_[tier];
        const double h = (*noise_)[stream].decision_interval[tier];
        // Noise that drowns the allowance is no evidence against anyone,
        // and a tier the stream has not is no evidence at all.
        if (std::isinf(h)) continue;
        Evidence& e = rank.evidence[stream][tier];
        // Capped at h: a flagged rank that recovers clears within h /
        // allowance steps.
        e.sum = std::min(std::max(0.0, e.sum + std::clamp(excess, -cusum.clip, cusum.clip) - cusum.allowance), h);
        if (e.sum == 0) {
          e = Evidence{};
          continue;
        }
        e.excess_sum += excess;
        ++e.excess_steps;
        e.flagged = e.flagged || e.sum >= h;
      }
    }
    const auto flagged_on = [&](Stream stream) {
      return std::any_of(std::begin(rank.evidence[stream]), std::end(rank.evidence[stream]),
                         [](const Evidence& e) { return e.flagged; });
    };
    const bool own_flagged = flagged_on(kCompute), busy_flagged = flagged_on(kBusy),
               stall_flagged = flagged_on(kStalled);
    if (!own_flagged && !busy_flagged && !stall_flagged) {
      rank.cause.reset();
      continue;
    }
    if (rank.cause) continue;
    // Stalled when its stalls crossed h, or when its compute is slow by
    // stalls past the threshold and without them would be within it.
    const bool stalled = stall_flagged || (own_flagged && rank.recent_stall_excess > allowed_ &&
                                           rank.recent_excess - rank.recent_stall_excess < allowed_);
    // Its host's doing when its busy time crossed h with its own compute
    // within the threshold, or when it waits for a CPU more than its peers
    // by more than its compute is slow: a process sharing its core also
    // slows the work it lets through (caches, switches), seen in fault-free
    // runs beside a test's status polls.
    const double peers_share = peers_median(participants, r, &RankState::cpu_wait_share);
    const bool host = (!own_flagged && rank.recent_excess < allowed_) ||
                      rank.cpu_wait_share - peers_share > std::expm1(rank.recent_excess);
    // A rank whose host starves it has its communication threads run on
    // its peers' cores (common/shared_cpus.h), which slows their compute:
    // a compute verdict waits while another rank waits for a CPU more than
    // this one by more than this one is slow.
    if (!stalled && !host && most_waiting(participants, r) - rank.cpu_wait_share > std::expm1(rank.recent_excess)) {
      continue;
    }
    rank.cause = stalled ? StragglerCause::kStalled : host ? StragglerCause::kHost : StragglerCause::kCompute;
    const Stream judged = stalled ? kStalled : host ? kBusy : kCompute;
    const Evidence* gathered = &rank.evidence[judged][strongest(rank, judged).first];
    if (gathered->excess_steps == 0) gathered = &rank.evidence[kCompute][strongest(rank, kCompute).first];
    const double mean_excess = gathered->excess_sum / static_cast<double>(std::max<int64_t>(gathered->excess_steps, 1));
    found.push_back({r, std::expm1(mean_excess), step, *rank.cause, rank.cpu_wait_share, peers_share, rank.stalled_share,
                     peers_median(participants, r, &RankState::stalled_share)});
  }
}

std::pair<StragglerMonitor::Tier, double> StragglerMonitor::strongest(const RankState& rank, Stream stream) const {
  std::pair<Tier, double> best{kSteady, -1};
  bool best_flagged = false;
  for (int tier = 0; tier < kTiers; ++tier) {
    const Evidence& e = rank.evidence[stream][tier];
    const double h = noise_ ? (*noise_)[stream].decision_interval[tier] : 0;
    const double share = h > 0 && std::isfinite(h) ? e.sum / h : 0.0;
    if (std::pair(e.flagged, share) > std::pair(best_flagged, best.second)) {
      best = {static_cast<Tier>(tier), share};
      best_flagged = e.flagged;
    }
  }
  return best;
}

double StragglerMonitor::most_waiting(const std::vector<int>& participants, int rank) const {
  double most = 0;
  for (int r : participants) {
    if (r != rank) most = std::max(most, ranks_[r].cpu_wait_share);
  }
  return most;
}

double StragglerMonitor::peers_median(const std::vector<int>& participants, int rank,
                                      double RankState::*share) const {
  std::vector<double> shares;
  for (int r : participants) {
    if (r != rank) shares.push_back(ranks_[r].*share);
  }
  return shares.empty() ? 0 : median(shares);
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

bool StragglerMonitor::learn_noise(const std::vector<int>& participants) {
  auto compute = learn_stream(participants, kCompute), busy = learn_stream(participants, kBusy),
       stalls = learn_stream(participants, kStalled);
  if (!compute || !busy || !stalls) return false;
  static const auto log = common::logger("health");
  const bool drowned = std::isinf(compute->decision_interval[kSteady]);
  if (drowned != (noise_ && std::isinf((*noise_)[kCompute].decision_interval[kSteady]))) {
    if (drowned) {
      log->warn("the ranks' compute varies too much from step to step (spread {:.1f}%) to tell a rank slower by "
                "straggler_threshold = {} apart; no rank is flagged until it calms or the threshold is raised",
                100 * compute->spread, config_.straggler_threshold);
    } else {
      log->info("the ranks' compute noise (spread {:.1f}%) allows flagging stragglers again", 100 * compute->spread);
    }
  }
  log->debug("straggler noise: {} stage level(s); compute spread {:.4f}, decision intervals {:.3f} steady, {:.3f} "
             "bursts; busy spread {:.4f}, decision intervals {:.3f} steady, {:.3f} bursts; stall spread {:.4f}, "
             "decision interval {:.3f}",
             compute->centres.size(), compute->spread, compute->decision_interval[kSteady],
             compute->decision_interval[kBursts], busy->spread, busy->decision_interval[kSteady],
             busy->decision_interval[kBursts], stalls->spread, stalls->decision_interval[kStalls]);
  noise_ = {*std::move(compute), *std::move(busy), *std::move(stalls)};
  return true;
}

std::optional<StragglerMonitor::Noise> StragglerMonitor::learn_stream(const std::vector<int>& participants,
                                                                      Stream stream) const {
  // Each rank's median x; the median of a stage's is its normal level,
  // robust to the slow ranks, which are left out of the noise so as not to
  // widen it.
  std::vector<double> own(ranks_.size(), std::numeric_limits<double>::quiet_NaN()), column;
  std::map<int, std::vector<double>> levels;
  for (int r : participants) {
    column.clear();
    for (const auto& x : recent_x_) {
      if (!std::isnan(x[stream][r])) column.push_back(x[stream][r]);
    }
    if (column.empty()) continue;
    own[r] = median(column);
    levels[ranks_[r].stage].push_back(own[r]);
  }
  if (levels.empty()) return std::nullopt;
  Noise noise;
  for (auto& [stage, stage_levels] : levels) noise.centres[stage] = median(stage_levels);
  const double false_alarms =
      static_cast<double>(config_.straggler_false_alarm_steps) * static_cast<double>(participants.size());
  bool spread_taken = false;
  for (int tier = 0; tier < kTiers; ++tier) {
    noise.decision_interval[tier] = std::numeric_limits<double>::infinity();
    if (!kRunsTier[stream][tier]) continue;
    // The quiet ranks' increments: what their CUSUMs would take. A rank
    // that looks slow is left out, so as not to widen it.
    const Cusum& cusum = tiers_[tier];
    std::vector<std::vector<double>> by_rank;
    std::vector<double> means;
    for (int r : participants) {
      const auto level = noise.centres.find(ranks_[r].stage);
      if (level == noise.centres.end()) continue;
      if (kTierShapes[tier].quiet == Quiet::kNotSlow && !(own[r] - level->second < allowed_)) continue;
      auto& rank_increments = by_rank.emplace_back();
      for (const auto& x : recent_x_) {
        if (std::isnan(x[stream][r])) continue;
        rank_increments.push_back(std::clamp(x[stream][r] - level->second, -cusum.clip, cusum.clip) - cusum.allowance);
      }
      double mean = 0;
      for (const double d : rank_increments) mean += d / static_cast<double>(rank_increments.size());
      means.push_back(mean);
    }
    std::vector<double> sorted_means = means;
    const double most = kTierShapes[tier].quiet == Quiet::kQuieterHalf && !means.empty()
                            ? median(sorted_means)
                            : std::numeric_limits<double>::infinity();
    std::vector<double> increments;
    double sum = 0, squares = 0;
    for (size_t i = 0; i < by_rank.size(); ++i) {
      if (by_rank[i].empty() || means[i] > most) continue;
      for (const double d : by_rank[i]) {
        increments.push_back(d);
        sum += d + cusum.allowance;
        squares += (d + cusum.allowance) * (d + cusum.allowance);
      }
    }
    // None quiet: no noise to judge against, so the tier judges nobody (h stays infinite).
    if (increments.empty()) continue;
    if (!spread_taken) {
      const double n = static_cast<double>(increments.size()), mean = sum / n;
      noise.spread = std::sqrt(std::max(0.0, squares / n - mean * mean));
      spread_taken = true;
    }
    noise.decision_interval[tier] = decision_interval(increments, false_alarms, cusum.least_interval);
  }
  return noise;
}

bool StragglerMonitor::flagged(int rank) const {
  return rank >= 0 && static_cast<size_t>(rank) < ranks_.size() && ranks_[rank].cause.has_value();
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
    ranks.push_back({{"rank", r},
                     {"median_compute_ms", rank.window_ms >= 0 ? nlohmann::json(rank.window_ms) : nlohmann::json()},
                     {"score", rank.score},
                     {"slowdown", std::expm1(rank.recent_excess)},
                     {"cpu_wait_share", rank.cpu_wait_share},
                     {"stalled_share", rank.stalled_share},
                     {"evidence", strongest(rank, kCompute).second},
                     {"host_evidence", strongest(rank, kBusy).second},
                     {"stall_evidence", strongest(rank, kStalled).second},
                     {"flagged", rank.cause.has_value()},
                     {"cause", rank.cause ? nlohmann::json(straggler_cause_name(*rank.cause)) : nlohmann::json()}});
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
          {"noise", finite_or_null(noise_ ? std::optional((*noise_)[kCompute].spread) : std::nullopt)},
          {"decision_interval",
           finite_or_null(noise_ ? std::optional((*noise_)[kCompute].decision_interval[kSteady]) : std::nullopt)},
          {"ranks", std::move(ranks)},
          {"steps", std::move(steps)},
          {"compute_ms", std::move(compute)}};
}

}  // namespace keel::health
