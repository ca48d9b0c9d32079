// Time as a detector watched it (docs/architecture.md "Health": hangs):
// ages measured so that a clock jump never fires a timeout by itself.
//
// keeld observes the boards every 200 ms. A gap between two observations
// longer than `max_gap_ns` is not believed: the clock jumped forward (a
// paused virtual machine, a fake clock) or keeld itself stalled, and the
// ranks had no chance to show progress in between. Such a gap counts as
// max_gap_ns towards the age of anything that happened before it, and the
// part of it after an event as at most that much too; a clock that goes
// back credits nothing and forgets the gaps of the abandoned future. So
// after a jump of an hour nothing looks an hour old: with max_gap_ns well
// below every limit an age is compared with, every timeout still needs
// most of its length in watched time, in which a live rank beats its
// heartbeat and finishes its collective, and a stuck one is found as if
// the jump had not happened.
#pragma once

#include <cstdint>
#include <deque>

namespace keel::health {

class WatchedTime {
 public:
  // `horizon_ns`: the longest age that is ever compared with a limit; the
  // gaps older than that (in watched time) are forgotten.
  WatchedTime(int64_t max_gap_ns, int64_t horizon_ns) : max_gap_ns_(max_gap_ns), horizon_ns_(horizon_ns) {}

  // An observation at `now_ns`; ages are measured from the newest one.
  void observe(int64_t now_ns);
  // How long before now `then_ns` was, in watched time: 0 for a time after
  // now, which only a jump back or an untrusted board gives.
  int64_t age_ns(int64_t then_ns) const;
  double age_s(int64_t then_ns) const { return static_cast<double>(age_ns(then_ns)) / 1e9; }

 private:
  struct Gap {
    int64_t from_ns;  // the observation before the gap
    int64_t to_ns;    // the observation after it
  };
  int64_t max_gap_ns_;
  int64_t horizon_ns_;
  bool started_ = false;
  int64_t now_ns_ = 0;
  std::deque<Gap> gaps_;  // the long ones, oldest first
};

}  // namespace keel::health
