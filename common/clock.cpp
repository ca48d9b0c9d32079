#include "common/clock.h"

#include <fstream>

namespace keel::common {
namespace {

class SteadyClock final : public Clock {
 public:
  int64_t now_ns() const override {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  // /proc/thread-self/schedstat: time on a CPU, time waiting on a run
  // queue, timeslices (Linux's Documentation/scheduler/sched-stats.rst).
  int64_t cpu_wait_ns() const override {
    std::ifstream in("/proc/thread-self/schedstat");
    int64_t on_cpu = 0, waiting = 0;
    return in >> on_cpu >> waiting ? waiting : 0;
  }
};

}  // namespace

const Clock& Clock::steady() {
  static const SteadyClock clock;
  return clock;
}

}  // namespace keel::common
