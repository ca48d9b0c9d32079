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
  // Where the calling thread's time went so far, by the scheduler's count
  // (0 where the kernel does not say). Time a rank loses to a CPU it
  // shares is the machine's, not the rank's: the straggler monitor leaves
  // it out of a rank's compute. What is neither (now_ns less both) the
  // thread spent off any run queue: blocked in the kernel or stopped.
  struct ThreadTimes {
    int64_t on_cpu_ns = 0;    // running
    int64_t cpu_wait_ns = 0;  // runnable but waiting for a CPU (the run queue)
    int64_t process_on_cpu_ns = 0;  // every thread of the process, running
  };
  virtual ThreadTimes thread_times() const = 0;
  // The process's real monotonic clock.
  static const Clock& steady();
};

// A clock that moves only when told to; thread-safe. Time it is advanced
// by is spent running, unless said otherwise.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(int64_t start_ns = 1'000'000'000) : now_(start_ns) {}
  int64_t now_ns() const override { return now_.load(); }
  ThreadTimes thread_times() const override {
    const int64_t on_cpu = now_.load() - off_cpu_.load() - cpu_wait_.load();
    return {on_cpu, cpu_wait_.load(), on_cpu + others_on_cpu_.load()};
  }
  void advance_ns(int64_t ns) { now_.fetch_add(ns); }
  void advance_s(double s) { advance_ns(static_cast<int64_t>(s * 1e9)); }
  // Time passes with the thread waiting for a CPU.
  void wait_for_cpu_ns(int64_t ns) {
    advance_ns(ns);
    cpu_wait_.fetch_add(ns);
  }
  // Time passes with the thread waiting for a CPU that another thread of
  // its process takes.
  void lose_cpu_to_own_thread_ns(int64_t ns) {
    wait_for_cpu_ns(ns);
    others_on_cpu_.fetch_add(ns);
  }
  // Time passes with the thread off any run queue (blocked or stopped).
  void stop_ns(int64_t ns) {
    advance_ns(ns);
    off_cpu_.fetch_add(ns);
  }

 private:
  std::atomic<int64_t> now_;
  std::atomic<int64_t> cpu_wait_{0};
  std::atomic<int64_t> off_cpu_{0};
  std::atomic<int64_t> others_on_cpu_{0};
};

// Seconds of std::chrono::steady_clock since `start`: how long a piece of
// work took, for logs, metrics and benchmarks (timeouts read a Clock).
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
inline constexpr int64_t seconds_to_ns(double s) { return static_cast<int64_t>(s * 1e9); }
inline constexpr double ns_to_seconds(int64_t ns) { return static_cast<double>(ns) / 1e9; }

}  // namespace keel::common
