#include "health/duration_budget.h"

#include <algorithm>
#include <cmath>

namespace keel::health {

DurationBudget::DurationBudget(const BudgetRule& rule) : rule_(rule) {
  rule_.window = std::max<size_t>(rule_.window, 1);
  durations_.reserve(rule_.window);
}

void DurationBudget::add(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return;
  if (durations_.size() < rule_.window) {
    durations_.push_back(seconds);
  } else {
    durations_[next_] = seconds;
    next_ = (next_ + 1) % rule_.window;
  }
  budget_s_ = -1;
}

double DurationBudget::budget_s() const {
  if (durations_.size() < std::max<size_t>(rule_.min_samples, 1)) return rule_.ceiling_s;
  if (budget_s_ < 0) {
    // Nearest rank: with fewer than 100 durations the 99th percentile is
    // the longest one, never an interpolation below it.
    std::vector<double> sorted = durations_;
    const auto rank = static_cast<size_t>(std::ceil(0.99 * static_cast<double>(sorted.size()))) - 1;
    std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(rank), sorted.end());
    // min(max()) rather than std::clamp: a ceiling below the floor (refused
    // by config validation) must not be undefined behaviour here.
    budget_s_ = std::min(std::max(rule_.multiple * sorted[rank], rule_.floor_s), rule_.ceiling_s);
  }
  return budget_s_;
}

}  // namespace keel::health
