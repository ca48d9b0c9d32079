#include "daemon/rank_spawner.h"

#include "common/error.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

extern char** environ;

namespace keel::daemon {

std::vector<std::vector<int>> cpu_shares(const std::vector<int>& available, int ranks) {
  std::vector<std::vector<int>> shares(static_cast<size_t>(ranks));
  if (available.empty() || ranks <= 0) return shares;
  const size_t n = available.size();
  const size_t r = static_cast<size_t>(ranks);
  if (n < r) return shares;
  const size_t each = n / r;
  for (size_t i = 0; i < r; ++i) {
    shares[i].assign(available.begin() + static_cast<ptrdiff_t>(i * each),
                     available.begin() + static_cast<ptrdiff_t>((i + 1) * each));
  }
  return shares;
}

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

pid_t spawn_rank(const RankLaunch& launch) {
  // Everything the child needs is built before fork: between fork and exec
  // a multithreaded parent's child may only make async-signal-safe calls.
  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const auto eq = entry.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = entry.substr(0, eq);
    // systemd's notify and watchdog settings address keeld, not its ranks.
    if (key == "NOTIFY_SOCKET" || key == "WATCHDOG_USEC" || key == "WATCHDOG_PID") continue;
    env[key] = entry.substr(eq + 1);
  }
  for (const auto& [key, value] : launch.env) env[key] = value;
  std::vector<std::string> env_strings;
  for (const auto& [key, value] : env) env_strings.push_back(key + "=" + value);
  std::vector<char*> envp, argv;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = launch.argv;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  for (int c : launch.cpus) CPU_SET(c, &cpus);

  const int log_fd = open(launch.log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log_fd < 0) {
    throw common::Error(common::ErrorCode::kInternal,
                        fmt::format("cannot open rank log {}: {}", launch.log.string(), std::strerror(errno)));
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    close(log_fd);
    throw common::Error(common::ErrorCode::kInternal, fmt::format("cannot fork a rank: {}", std::strerror(err)));
  }
  if (pid == 0) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    // keeld may have died between fork and prctl.
    if (getppid() != parent) _exit(127);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    signal(SIGPIPE, SIG_DFL);  // keeld ignores it; exec keeps ignored signals ignored
    if (!launch.cpus.empty()) sched_setaffinity(0, sizeof(cpus), &cpus);
    const int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, STDIN_FILENO);
    dup2(log_fd, STDOUT_FILENO);
    dup2(log_fd, STDERR_FILENO);
    if (launch.snapshot_fd >= 0) {
      // dup2 onto itself keeps close-on-exec, which the rank must not have.
      if (launch.snapshot_fd != kSnapshotFd) dup2(launch.snapshot_fd, kSnapshotFd);
      fcntl(kSnapshotFd, F_SETFD, 0);
    }
    close_range(launch.snapshot_fd >= 0 ? kSnapshotFd + 1 : 3, ~0U, CLOSE_RANGE_CLOEXEC);
    execve(argv[0], argv.data(), envp.data());
    const char* prefix = "keeld: cannot start the rank: exec failed: ";
    const char* why = strerror(errno);
    (void)!write(STDERR_FILENO, prefix, strlen(prefix));
    (void)!write(STDERR_FILENO, why, strlen(why));
    (void)!write(STDERR_FILENO, "\n", 1);
    _exit(127);
  }
  close(log_fd);
  return pid;
}

}  // namespace keel::daemon
