#include "common/clock.h"

namespace keel::common {
namespace {

class SteadyClock final : public Clock {
 public:
  int64_t now_ns() const override {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
};

}  // namespace

const Clock& Clock::steady() {
  static const SteadyClock clock;
  return clock;
}

}  // namespace keel::common
