// Starting one rank as a real process (docs/architecture.md "Worker contract"): keeld's half of the
// worker contract, plus what keeps ranks from hurting each other and
// outliving keeld.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace keel::daemon {

struct RankLaunch {
  std::vector<std::string> argv;            // argv[0] is the program's path
  std::map<std::string, std::string> env;   // added to (and overriding) keeld's environment
  std::vector<int> cpus;                    // CPU affinity; empty = keeld's own
  std::filesystem::path log;                // stdout and stderr are appended here
  int snapshot_fd = -1;                     // the rank's snapshot area, passed as descriptor 3; -1: none
};

// The descriptor a rank finds its snapshot area on (KEEL_SNAPSHOT_FD).
inline constexpr int kSnapshotFd = 3;

// Forks and execs the rank. The child gets its own process group (a
// terminal's Ctrl-C reaches keeld alone, which then stops the ranks in
// order), dies with SIGKILL if keeld dies (PR_SET_PDEATHSIG), runs on
// `cpus`, and inherits no descriptor of keeld's but its log and its
// snapshot area (as kSnapshotFd). Throws
// Error(kInternal) when the log cannot be opened or fork fails; a failed
// exec shows as the child exiting 127 with the reason in its log.
pid_t spawn_rank(const RankLaunch& launch);

// How keeld shares its CPUs among `ranks` local ranks: contiguous, equal
// shares of the CPUs it may use, in order. With fewer CPUs than ranks every
// share is empty (no pinning): two ranks pinned to one CPU could only take
// turns there even while another CPU idles, whereas the scheduler moves a
// runnable rank to whichever CPU is free.
std::vector<std::vector<int>> cpu_shares(const std::vector<int>& available, int ranks);

// The CPUs this process may run on, ascending.
std::vector<int> allowed_cpus();

}  // namespace keel::daemon
