// Where a rank's communication threads run (docs/architecture.md "Rank
// spawning"). keeld pins each rank to its own share of the node's CPUs, so
// that the ranks' compute does not migrate or meet on a core, and names
// the CPUs all of them share in KEEL_SHARED_CPUS. The threads that move a
// rank's bytes (Gloo's socket loop, the thread of its overlapped
// collectives) are started on those: their work comes in bursts while a
// peer waits in a collective, and the scheduler runs them on that idle
// core. Pinned beside the training thread instead, Gloo's loop woke some
// 30 times a step in a DP2 job on the 2-core VM, preempted the training
// thread 18 times, took a third of its core and ran its compute 30%
// slower for tens of steps at a time, whichever rank was later to its
// collectives (and so received while computing) staying later: 7 of 12
// fault-free 300-step jobs flagged a rank as a straggler, against 0 of 10
// with the threads shared, and the job ran 9.3-10.4k tokens/s against
// 13.9-14.3k (health/straggler_monitor.h).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <sched.h>

namespace keel::common {

inline constexpr const char* kSharedCpusVariable = "KEEL_SHARED_CPUS";

// "0,2-5" as taskset and /proc's Cpus_allowed_list write them, ascending;
// nothing for a list that does not parse (a CPU past CPU_SETSIZE, a range
// backwards, anything but digits, '-' and ',').
std::optional<std::vector<int>> parse_cpu_list(std::string_view list);
std::string format_cpu_list(const std::vector<int>& cpus);

// While one lives, the calling thread may run on the shared CPUs, so that
// the threads it starts inherit them; its own affinity comes back when it
// ends. Without KEEL_SHARED_CPUS (a rank not started by a pinning keeld)
// nothing changes; a value that does not parse, or that the kernel
// refuses, is logged once and changes nothing either: the threads stay
// pinned, which is slower, not wrong.
class SharedCpuScope {
 public:
  SharedCpuScope();
  ~SharedCpuScope();
  SharedCpuScope(const SharedCpuScope&) = delete;
  SharedCpuScope& operator=(const SharedCpuScope&) = delete;

 private:
  std::optional<cpu_set_t> own_;  // the thread's affinity before, while widened
};

}  // namespace keel::common
