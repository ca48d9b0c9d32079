// The clock seam (docs/architecture.md "Errors, logging, config"): everything
// that times out (the detectors, the job's state machine) reads time
// through a Clock, so that a test drives it with a FakeClock and never
// sleeps.
//
// Times are nanoseconds on CLOCK_MONOTONIC, the clock the progress boards
// carry: std::chrono::steady_clock on Linux, comparable between the
// processes of one machine.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace keel::common {

class Clock {
 public:
  virtual ~Clock() = default;
  // Monotonic nanoseconds; never goes back for the real clock (a fake one
  // may, to test what a detector makes of a jump).
  virtual int64_t now_ns() const = 0;
  // Nanoseconds the calling thread has spent runnable but waiting for a
  // CPU (the scheduler's run queue; 0 where the kernel does not say). Time
  // a rank loses to a CPU it shares is the machine's, not the rank's: the
  // straggler monitor leaves it out of a rank's compute.
  virtual int64_t cpu_wait_ns() const = 0;
  // The process's real monotonic clock.
  static const Clock& steady();
};

// A clock that moves only when told to; thread-safe.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(int64_t start_ns = 1'000'000'000) : now_(start_ns) {}
  int64_t now_ns() const override { return now_.load(); }
  int64_t cpu_wait_ns() const override { return cpu_wait_.load(); }
  void advance_ns(int64_t ns) { now_.fetch_add(ns); }
  void advance_s(double s) { advance_ns(static_cast<int64_t>(s * 1e9)); }
  // Time passes with the thread waiting for a CPU.
  void wait_for_cpu_ns(int64_t ns) {
    advance_ns(ns);
    cpu_wait_.fetch_add(ns);
  }

 private:
  std::atomic<int64_t> now_;
  std::atomic<int64_t> cpu_wait_{0};
};

// Seconds of std::chrono::steady_clock since `start`: how long a piece of
// work took, for logs, metrics and benchmarks (timeouts read a Clock).
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
inline constexpr int64_t seconds_to_ns(double s) { return static_cast<int64_t>(s * 1e9); }
inline constexpr double ns_to_seconds(int64_t ns) { return static_cast<double>(ns) / 1e9; }

}  // namespace keel::common
