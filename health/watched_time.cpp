#include "health/watched_time.h"

#include <algorithm>
#include <cstdint>

namespace keel::health {
namespace {

// Enough for any horizon at keeld's cadence; a caller that observes less
// often than max_gap_ns records a gap every time, and must not grow this
// without bound.
constexpr size_t kMaxGaps = 1024;

// a - b, saturated: the times come from callers and boards that are not
// trusted, and their difference must not overflow.
int64_t minus(int64_t a, int64_t b) {
  int64_t d = 0;
  if (!__builtin_sub_overflow(a, b, &d)) return d;
  return b < 0 ? INT64_MAX : INT64_MIN;
}

}  // namespace

void WatchedTime::observe(int64_t now_ns) {
  if (started_ && now_ns < now_ns_) gaps_.clear();
  if (started_ && minus(now_ns, now_ns_) > max_gap_ns_) gaps_.push_back(Gap{now_ns_, now_ns});
  started_ = true;
  now_ns_ = now_ns;
  while (!gaps_.empty() && (gaps_.size() > kMaxGaps || age_ns(gaps_.front().to_ns) > horizon_ns_)) {
    // Everything before this gap is already older than any limit, and
    // forgetting the gap only makes it older.
    gaps_.pop_front();
  }
}

int64_t WatchedTime::age_ns(int64_t then_ns) const {
  int64_t age = minus(now_ns_, then_ns);
  for (const Gap& gap : gaps_) {
    age = minus(age, std::max<int64_t>(0, minus(minus(gap.to_ns, std::max(then_ns, gap.from_ns)), max_gap_ns_)));
  }
  return std::max<int64_t>(0, age);
}

}  // namespace keel::health
