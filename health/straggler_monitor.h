// The straggler monitor (docs/architecture.md "Health": stragglers). Fed
// every poll of the boards, it gathers each rank's per-step compute time
// (StepTiming::compute_ms: the step's wall time minus collective wait, data
// time and time waiting for a CPU, so the ranks that wait for a slow one are
// not blamed: their wait rises, their compute does not) and scores the ranks
// against each other, with no collective in the training stream.
//
// Every `straggler_window` steps that every running rank (with a trusted
// board, rank_sample.h) has timed, each rank's window value is the median
// over those steps of its compute relative to that step's median rank: a
// load that slows every rank at once (another process on the machine)
// cancels out step by step. A rank's score is its value over the median
// rank's value, minus 1. The window is slow for a rank when its score
// exceeds `straggler_threshold` and 3 spreads, the spread being 1.4826 x
// the MAD of the other ranks' scores over the last 20 windows: how far
// scores stray by noise alone, learned from many samples rather than from
// the 3 or 4 values of one small window (whose MAD is 0 when the ranks are
// identical, so the threshold guards that case), and without the rank's
// own scores, which would widen it. A rank's evidence counts its slow
// windows net of its fast ones, between 0 and `straggler_windows`; the
// rank is flagged (once) when it reaches `straggler_windows`, and the flag
// clears when it is back at 0 (a discrete CUSUM: a noisy window among slow
// ones costs a window, not the streak). With two ranks the median is their
// mean, so the slower one's score is about half the gap. The
// synchronisation tax is the mean over steps of the slowest rank's compute
// over the median rank's (1 before any step).
//
// The defaults (10 steps, 3 windows, 0.05) were chosen by replaying
// compute times recorded from keel-trainer jobs of 3 and 4 CPU ranks on a
// 2-core machine busy with other builds, their noise scaled down to find
// where detection holds, with one rank's compute scaled by 1.10 from a
// random step. A 1.10x rank is flagged 23 to 40 steps after it slows when
// the per-step noise of a rank's compute against the step's median is
// 2.4-3.5% (standard deviation): in 98-100% of replays; at 4% in 89%, at
// 6% in 77%, at 8% in 33%. With more noise (17-32% was recorded with a few
// ms of compute per step) the spread outgrows the score and mostly nobody
// is flagged (7-15%); once in 150 such replays another rank was flagged as
// well. No rank was flagged in 1,900 unslowed steps of 4 ranks; with 3
// ranks on 2 cores the scheduler made one rank share a core, 6-11% slower
// for 150 steps, and that rank was flagged, as it should be. 12-step
// windows did about as well; longer or more windows would not fit 50
// steps. Only step numbers order the evidence, never the time, so a clock
// that jumps changes nothing.
//
// Live, once compute left out the time waiting for a CPU (4 single-threaded
// ranks of 20-40 ms compute per step on that machine, keeld at the
// defaults): a 1.10x rank was flagged in 10 of 10 runs of 80 steps, at step
// 29 in 6, 39, 49 and 59 (so within 50 steps in 9 of 10), never another
// rank; in the chaos series of 10 runs of 200 steps (keeld_chaos_test) all
// 10, by step 50 in 7, the rest at 59, 79 and 79; no rank was flagged in
// 2,000 unslowed steps. Those counted consecutive windows. On a noisier
// day (per-step noise 6.3-9.0%) a chaos series with the evidence count
// flagged 9 of 10, 5 by step 50. Replayed offline, ten recorded runs of
// that noise (300 steps, one rank 1.10x): consecutive windows flagged 6 by
// step 50, the evidence count 7, at 2.5 and 2 spreads 8 and 9; a CUSUM on
// per-step log ratios (reference log 1.05, noise learned from the other
// ranks, decision interval for 10^6 steps between false alarms) flagged
// all 10 at steps 23-47, and in none of the 30 unslowed rank-runs did any
// rule flag a rank.
#pragma once

#include "common/config.h"
#include "health/rank_sample.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <deque>
#include <map>
#include <utility>
#include <vector>

namespace keel::health {

struct StragglerFinding {
  int rank = -1;
  double score = 0;    // of the window that completed the evidence
  int64_t step = -1;   // the last step of that window
  // {"rank", "score", "step"}: the fields of the straggler_flagged event.
  nlohmann::json to_json() const;
};

class StragglerMonitor {
 public:
  // `history_steps`: how many steps of per-rank compute times report()
  // keeps for the heat map.
  explicit StragglerMonitor(const common::HealthConfig& config, size_t history_steps = 2000);

  // Takes the steps of `samples` not seen before; returns the ranks flagged
  // now. Steps a rank's ring no longer holds are skipped, never guessed.
  std::vector<StragglerFinding> observe(const RankSamples& samples, int64_t now_ns);

  // Whether `rank` is flagged now.
  bool flagged(int rank) const;
  // The newest window score of `rank` (0 before the first window).
  double score(int rank) const;
  double sync_tax() const;

  // The reply to `keelctl stragglers`:
  // {"window": N, "windows": W, "threshold": t, "sync_tax": x,
  //  "ranks": [{"rank", "median_compute_ms", "score", "flagged"}, ...],  // of the newest window; null ms before one
  //  "steps": [s0, s1, ...],                      // the steps of the heat map, ascending
  //  "compute_ms": [[rank 0's per step], ...]}    // null where a rank's step was not seen
  nlohmann::json report() const;

 private:
  struct RankState {
    int64_t generation = -1;           // of the board its steps came from
    int64_t newest = -1;               // the newest step it timed in that generation
    std::map<int64_t, float> pending;  // steps timed and not yet taken, by step
    std::vector<double> ratios;        // its compute / the step's median, in the current window
    std::vector<double> computes;      // its compute in the current window
    double window_ms = -1;             // median compute of its newest window; -1: none yet
    double score = 0;
    int64_t evidence = 0;              // slow windows net of fast ones, 0..straggler_windows
    bool flagged = false;
  };
  // Takes the steps up to `newest` (the newest every participant timed).
  void take_steps(const std::vector<int>& participants, int64_t newest, std::vector<StragglerFinding>& found);
  void close_window(const std::vector<int>& participants, std::vector<StragglerFinding>& found);
  // 1.4826 x the MAD of the recent windows' scores of every rank but `rank`.
  double spread_without(int rank) const;

  common::HealthConfig config_;
  size_t history_steps_;
  std::vector<RankState> ranks_;
  int64_t next_step_ = 0;           // every step before it was taken or skipped
  std::vector<int> window_ranks_;   // the participants of the current window
  int64_t window_steps_ = 0;
  int64_t window_last_step_ = -1;
  std::deque<std::vector<double>> recent_scores_;  // per recent window, by rank (NaN: not in it)
  double tax_sum_ = 0;
  int64_t tax_steps_ = 0;
  // The heat map: steps ascending, each with every rank's compute (NaN: not seen).
  std::deque<std::pair<int64_t, std::vector<float>>> history_;
};

}  // namespace keel::health
