#include "daemon/rank_set.h"

#include "common/error.h"
#include "common/shared_cpus.h"
#include "daemon/rank_log.h"
#include "daemon/rank_spawner.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

namespace keel::daemon {
namespace {

// "exited 12 (peer_failure)", "killed by SIGKILL": the worker contract's
// exit codes (docs/architecture.md "Worker contract") by name.
std::string describe_exit(int code) {
  if (code > 128 && code < 128 + 65) {
    const char* name = sigabbrev_np(code - 128);
    return name != nullptr ? fmt::format("killed by SIG{}", name) : fmt::format("killed by signal {}", code - 128);
  }
  if (code == 127) return "exited 127 (could not be started; see its log)";
  for (auto known : common::kErrorCodes) {
    if (code == common::exit_code(known)) return fmt::format("exited {} ({})", code, common::error_code_name(known));
  }
  return fmt::format("exited {}", code);
}

}  // namespace

RankSet::RankSet(RankSetOptions options)
    : options_(std::move(options)),
      slice_{0, options_.ranks, {}},
      reports_(static_cast<size_t>(options_.ranks)),
      boards_(static_cast<size_t>(options_.ranks)) {
  for (int r = 0; r < options_.ranks; ++r) reports_[static_cast<size_t>(r)].rank = r;
  if (options_.snapshot_areas) {
    snapshot_areas_ = std::vector<common::UniqueFd>(static_cast<size_t>(options_.ranks));
    for (int r = 0; r < options_.ranks; ++r) {
      const std::string name = fmt::format("keel-snapshot-rank-{}", r);
      common::UniqueFd area(memfd_create(name.c_str(), MFD_CLOEXEC));
      if (area.get() < 0) {
        throw common::Error(common::ErrorCode::kInternal,
                            fmt::format("cannot make rank {}'s in-memory snapshot area: {}", r, std::strerror(errno)));
      }
      snapshot_areas_[static_cast<size_t>(r)] = std::move(area);
    }
    area_ranks_.assign(static_cast<size_t>(options_.ranks), -1);
  }
  if (options_.pin_cpus) {
    const auto available = allowed_cpus();
    cpus_ = cpu_shares(available, options_.ranks);
    shared_cpus_ = common::format_cpu_list(available);
    // One thread per CPU of a share; unpinned ranks divide keeld's CPUs.
    threads_per_rank_ = cpus_.front().empty()
                            ? std::max<size_t>(1, available.size() / static_cast<size_t>(options_.ranks))
                            : cpus_.front().size();
  }
}

RankSet::~RankSet() {
  signal(SIGKILL);
  remove_boards();
}

std::optional<RankSet::SpawnFailure> RankSet::spawn(int64_t generation, const RankSlice& slice) {
  kill_at_ns_.reset();
  slice_ = slice;
  const std::string world = std::to_string(slice.world);
  const std::string local_world = std::to_string(options_.ranks);
  for (auto& rank : reports_) {
    rank.pid = -1;
    rank.last.reset();
    rank.exit_code.reset();
    rank.heartbeat_ns = 0;
  }
  for (auto& rank : reports_) {
    const std::string board = health::board_name(getpid(), rank.rank);
    auto& slot = boards_[static_cast<size_t>(rank.rank)];
    RankLaunch launch;
    launch.argv = {options_.trainer.string(), "--config", options_.config_path.string()};
    std::vector<std::string> overrides = options_.overrides;
    overrides.insert(overrides.end(), slice.overrides.begin(), slice.overrides.end());
    for (const auto& o : overrides) {
      launch.argv.push_back("--set");
      launch.argv.push_back(o);
    }
    launch.env = {{"KEEL_RANK", std::to_string(slice.first_rank + rank.rank)},
                  {"KEEL_WORLD_SIZE", world},
                  {"KEEL_LOCAL_RANK", std::to_string(rank.rank)},
                  {"KEEL_LOCAL_WORLD_SIZE", local_world},
                  {"KEEL_GENERATION", std::to_string(generation)},
                  {"KEEL_STORE", options_.store_address},
                  {"KEEL_STORE_SECRET", options_.store_secret},
                  {"KEEL_BOARD", board},
                  {"KEEL_RUN_DIR", options_.run_dir.string()}};
    if (!options_.bind_address.empty()) launch.env["KEEL_BIND_ADDRESS"] = options_.bind_address;
    if (!cpus_.empty()) {
      launch.cpus = cpus_[static_cast<size_t>(rank.rank)];
      launch.env[common::kSharedCpusVariable] = shared_cpus_;
      for (const char* var : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}) {
        launch.env[var] = std::to_string(threads_per_rank_);
      }
    }
    if (!options_.gpus.empty()) launch.env["CUDA_VISIBLE_DEVICES"] = options_.gpus[static_cast<size_t>(rank.rank)];
    if (!snapshot_areas_.empty()) {
      launch.snapshot_fd = snapshot_areas_[static_cast<size_t>(rank.rank)].get();
      launch.env["KEEL_SNAPSHOT_FD"] = std::to_string(kSnapshotFd);
      if (options_.snapshot_buddy) launch.env["KEEL_SNAPSHOT_BUDDY"] = "1";
    }
    // Logs go by global rank, the number the events, verdicts and the other nodes use.
    const int global_rank = slice.first_rank + rank.rank;
    if (!area_ranks_.empty()) area_ranks_[static_cast<size_t>(rank.rank)] = global_rank;
    launch.log = rank_log_path(options_.run_dir, global_rank);
    try {
      slot.emplace(health::ProgressBoard::create(board));
      std::ofstream(launch.log, std::ios::app) << rank_log_header(generation, global_rank);
      rank.pid = spawn_rank(launch);
    } catch (const std::exception& e) {
      rank.exit_code = 127;
      return SpawnFailure{rank.rank, e.what()};
    }
  }
  return std::nullopt;
}

const RankReport* RankSet::reap(pid_t pid, int wait_status) {
  for (auto& rank : reports_) {
    if (rank.pid != pid || rank.exit_code) continue;
    rank.exit_code = WIFEXITED(wait_status) ? WEXITSTATUS(wait_status)
                                            : 128 + (WIFSIGNALED(wait_status) ? WTERMSIG(wait_status) : 0);
    if (const auto& board = boards_[static_cast<size_t>(rank.rank)]) {
      if (auto last = board->read()) rank.last = last;
    }
    return &rank;
  }
  return nullptr;
}

std::string RankSet::exit_cause(int rank, int code) const {
  std::string cause = fmt::format("rank {} {}", slice_.first_rank + rank, describe_exit(code));
  // Only a rank that exited by itself had its say.
  const std::string said = code > 0 && code < 128 ? last_error_sentence(rank_log_path(options_.run_dir, slice_.first_rank + rank))
                                                      : "";
  return said.empty() ? cause : cause + ": " + said;
}

void RankSet::signal(int signal) {
  for (const auto& rank : reports_) {
    if (rank.pid > 0 && !rank.exit_code) ::kill(rank.pid, signal);
  }
}

void RankSet::terminate(double grace_s, int64_t now_ns) {
  signal(SIGTERM);
  kill_at_ns_ = now_ns + static_cast<int64_t>(grace_s * 1e9);
}

bool RankSet::tick(int64_t now_ns) {
  if (!kill_at_ns_ || now_ns < *kill_at_ns_) return false;
  kill_at_ns_.reset();
  if (!alive()) return false;
  signal(SIGKILL);
  return true;
}

bool RankSet::alive() const {
  return std::any_of(reports_.begin(), reports_.end(), [](const RankReport& r) { return r.pid > 0 && !r.exit_code; });
}

void RankSet::read_boards() {
  for (auto& rank : reports_) {
    const auto& board = boards_[static_cast<size_t>(rank.rank)];
    if (!board) continue;
    if (auto snapshot = board->read()) rank.last = snapshot;
    rank.heartbeat_ns = board->heartbeat_ns();
  }
}

health::RankSamples RankSet::samples() const {
  health::RankSamples out;
  for (const auto& rank : reports_) {
    out.push_back({slice_.first_rank + rank.rank, rank.last, rank.heartbeat_ns, rank.pid > 0 && !rank.exit_code});
  }
  return out;
}

bool RankSet::request_checkpoint() {
  bool any = false;
  for (auto& board : boards_) {
    if (!board) continue;
    board->request_checkpoint();
    any = true;
  }
  return any;
}

bool RankSet::request_fault(int rank, const health::FaultRequest& request) {
  if (rank < 0 || rank >= options_.ranks) return false;
  auto& board = boards_[static_cast<size_t>(rank)];
  if (!board) return false;
  board->request_fault(request);
  return true;
}

std::vector<std::vector<checkpoint::SnapshotArea::Listed>> RankSet::snapshots() const {
  std::vector<std::vector<checkpoint::SnapshotArea::Listed>> out;
  for (const auto& fd : snapshot_areas_) out.push_back(checkpoint::SnapshotArea(fd.get(), 1).list());
  return out;
}

int RankSet::quarantine_snapshots_after(int64_t step) {
  int moved = 0;
  for (const auto& fd : snapshot_areas_) moved += checkpoint::SnapshotArea(fd.get(), 1).quarantine_after(step);
  return moved;
}

std::vector<int> RankSet::snapshot_area_fds() const {
  std::vector<int> out;
  for (const auto& fd : snapshot_areas_) out.push_back(fd.get());
  return out;
}

std::vector<int> RankSet::areas_lacking(const RankSlice& slice) const {
  std::vector<int> out;
  for (size_t local = 0; local < area_ranks_.size(); ++local) {
    if (area_ranks_[local] != slice.first_rank + static_cast<int64_t>(local)) out.push_back(static_cast<int>(local));
  }
  return out;
}

void RankSet::remove_boards() {
  for (auto& board : boards_) {
    if (board) health::ProgressBoard::remove(board->name());
    board.reset();
  }
}

void RankSet::remove_orphaned_boards() {
  // A keeld that was killed left its ranks' boards behind (its ranks died
  // with it); they are named after its pid.
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = entry.path().filename().string();
    int pid = 0, local_rank = 0;
    if (std::sscanf(name.c_str(), "keel.%d.%d", &pid, &local_rank) != 2 || pid <= 0) continue;
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue;
    health::ProgressBoard::remove("/" + name);
  }
}

}  // namespace keel::daemon
