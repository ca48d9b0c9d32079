// A time budget learned from observed durations (docs/architecture.md
// "Health": hangs): the hang detector keeps one per process-group kind and
// one per phase. The budget is `multiple` x the 99th percentile of the last
// `window` durations, clamped to [floor_s, ceiling_s]; with fewer than
// `min_samples` durations it is the ceiling, so nothing seen too rarely to
// know it is ever judged tighter than the most lenient budget.
#pragma once

#include <cstddef>
#include <vector>

namespace keel::health {

struct BudgetRule {
  double multiple = 5;
  double floor_s = 30;
  double ceiling_s = 100;
  size_t window = 512;     // durations kept, the newest
  size_t min_samples = 5;  // durations needed before the budget is learned
};

class DurationBudget {
 public:
  explicit DurationBudget(const BudgetRule& rule);

  // Adds one observed duration. A negative or non-finite one is dropped:
  // it comes from an untrusted board or a clock that went back.
  void add(double seconds);
  size_t samples() const { return durations_.size(); }
  // The ceiling until min_samples durations were added.
  double budget_s() const;

 private:
  BudgetRule rule_;
  std::vector<double> durations_;  // a ring once it holds rule_.window
  size_t next_ = 0;                // where the next duration goes once full
  mutable double budget_s_ = -1;   // cached; -1: stale
};

}  // namespace keel::health
