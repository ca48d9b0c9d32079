#include "health/duration_budget.h"
#include "health/watched_time.h"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace keel::health {

TEST_SUITE("unit") {
  TEST_CASE("a learned budget is a multiple of the 99th percentile clamped to the floor and the ceiling") {
    struct Case {
      std::string name;
      std::vector<double> durations;
      double budget_s;
    };
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const double inf = std::numeric_limits<double>::infinity();
    std::vector<double> one_outlier(199, 0.4), two_outliers(198, 0.4), three_outliers(197, 0.4);
    one_outlier.push_back(100);
    two_outliers.insert(two_outliers.end(), {100, 100});
    three_outliers.insert(three_outliers.end(), {100, 100, 100});
    const Case cases[] = {
        {"nothing seen keeps the ceiling", {}, 20},
        {"too few durations keep the ceiling", {0.5, 0.5, 0.5, 0.5}, 20},
        {"short durations get the floor", {0.1, 0.1, 0.1, 0.1, 0.1}, 1},
        {"between floor and ceiling it is the multiple", {0.5, 0.5, 0.5, 0.5, 0.5}, 2.5},
        {"fewer than 100 durations take the longest", {0.5, 0.5, 0.5, 0.5, 0.9}, 4.5},
        {"long durations get the ceiling", {0.5, 0.5, 0.5, 0.5, 100}, 20},
        {"negative and non-finite durations are dropped", {0.5, 0.5, 0.5, 0.5, -1, nan, inf, -inf}, 20},
        {"one outlier in 200 is above the 99th percentile", one_outlier, 2},
        {"two outliers in 200 are above it", two_outliers, 2},
        {"three outliers in 200 reach it", three_outliers, 20},
    };
    for (const Case& c : cases) {
      CAPTURE(c.name);
      DurationBudget budget(BudgetRule{5, 1, 20, 512, 5});
      for (double d : c.durations) budget.add(d);
      CHECK(budget.budget_s() == doctest::Approx(c.budget_s));
    }
  }

  TEST_CASE("a learned budget forgets durations older than its window") {
    DurationBudget budget(BudgetRule{5, 1, 20, 5, 5});
    budget.add(100);
    for (int i = 0; i < 4; ++i) budget.add(0.5);
    CHECK(budget.budget_s() == doctest::Approx(20));
    budget.add(0.5);
    CHECK(budget.samples() == 5);
    CHECK(budget.budget_s() == doctest::Approx(2.5));
  }

  TEST_CASE("watched time counts a long gap between observations as the longest credited gap") {
    constexpr int64_t kS = 1'000'000'000;
    WatchedTime time(kS / 4, 100 * kS);
    time.observe(10 * kS);
    time.observe(10 * kS + kS / 4);  // a gap of the limit counts in full
    CHECK(time.age_ns(9 * kS) == kS + kS / 4);
    time.observe(3610 * kS);  // an hour's jump counts a quarter second
    CHECK(time.age_ns(9 * kS) == kS + kS / 2);
    CHECK(time.age_ns(3609 * kS) == kS / 4);  // inside the gap: at most the limit too
    CHECK(time.age_ns(3610 * kS) == 0);
    time.observe(3611 * kS);  // a second in 200 ms polls would count in full; one step is a gap again
    CHECK(time.age_ns(9 * kS) == kS + 3 * kS / 4);
    CHECK(time.age_ns(3700 * kS) == 0);  // the future is no age
  }

  TEST_CASE("watched time forgets its gaps when the clock goes back") {
    constexpr int64_t kS = 1'000'000'000;
    WatchedTime time(kS / 4, 100 * kS);
    time.observe(10 * kS);
    time.observe(3610 * kS);
    time.observe(20 * kS);
    CHECK(time.age_ns(19 * kS) == kS);
    CHECK(time.age_ns(30 * kS) == 0);
  }

  TEST_CASE("watched time never overflows on extreme times") {
    WatchedTime time(1, 1);
    for (int64_t now : {INT64_MIN, INT64_MAX, int64_t{0}, INT64_MIN, INT64_MAX}) {
      time.observe(now);
      CHECK(time.age_ns(INT64_MIN) >= 0);
      CHECK(time.age_ns(INT64_MAX) >= 0);
    }
  }
}

}  // namespace keel::health
