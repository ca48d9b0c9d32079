// The straggler monitor (docs/architecture.md "Health": stragglers). Fed
// every poll of the boards, it gathers each rank's per-step compute time
// (StepTiming::compute_ms: the step's wall time minus collective wait and
// data time, so the ranks that wait for a slow one are not blamed: their
// wait rises, their compute does not) and scores the ranks against each
// other, with no collective in the training stream.
//
// Every `straggler_window` steps that every running rank has timed, each
// rank's window value is the median of its compute times; the window's
// centre is the median over ranks of those values and its spread 1.4826 x
// their MAD. A rank's score is (value - centre) / centre; the window is slow
// for that rank when the value exceeds the centre by more than
// `straggler_threshold` x centre and by more than 3 spreads. A rank slow in
// `straggler_windows` consecutive windows is flagged (once; a fast window
// clears the streak and, after a flag, the flag too). The synchronisation
// tax is the mean over steps of the slowest rank's compute over the median
// rank's.
#pragma once

#include "common/config.h"
#include "health/rank_sample.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <deque>
#include <vector>

namespace keel::health {

struct StragglerFinding {
  int rank = -1;
  double score = 0;    // of the window that completed the streak
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
  //  "ranks": [{"rank", "median_compute_ms", "score", "flagged"}, ...],
  //  "steps": [s0, s1, ...],                      // the steps of the heat map, ascending
  //  "compute_ms": [[rank 0's per step], ...]}    // null where a rank's step was not seen
  nlohmann::json report() const;

 private:
  common::HealthConfig config_;
  size_t history_steps_;
  // ... (the implementation's state)
};

}  // namespace keel::health
