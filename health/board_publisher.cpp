#include "health/board_publisher.h"

#include "common/error.h"
#include "common/thread_name.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

namespace keel::health {
namespace {

template <size_t N> void copy_name(char (&to)[N], std::string_view from) {
  const size_t n = std::min(from.size(), N - 1);
  std::memcpy(to, from.data(), n);
  std::memset(to + n, 0, N - n);
}

float to_ms(int64_t ns) { return static_cast<float>(static_cast<double>(ns) / 1e6); }

}  // namespace

BoardPublisher::BoardPublisher(ProgressBoard board, int rank, int64_t generation, const common::Clock& clock,
                               int64_t heartbeat_period_ns)
    : clock_(&clock), board_(std::move(board)) {
  current_.rank = rank;
  current_.pid = static_cast<int32_t>(getpid());
  current_.generation = generation;
  current_.checkpoint_requests_seen = board_->checkpoint_requests();
  faults_seen_ = board_->fault_request().count;
  current_.phase_start_ns = clock_->now_ns();
  update([](BoardSnapshot&) {});
  board_->beat(clock_->now_ns());
  heartbeat_ =
      common::named_thread("keel-heartbeat", [this, heartbeat_period_ns] { beat_until_stopped(heartbeat_period_ns); });
}

BoardPublisher::~BoardPublisher() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  stop_beating_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
}

void BoardPublisher::beat_until_stopped(int64_t period_ns) {
  std::unique_lock lock(mutex_);
  while (!stop_beating_.wait_for(lock, std::chrono::nanoseconds(period_ns), [this] { return stopping_; })) {
    board_->beat(clock_->now_ns());
  }
}

template <class Change> void BoardPublisher::update(Change&& change) {
  std::lock_guard lock(mutex_);
  if (!board_) return;
  change(current_);
  current_.update_ns = clock_->now_ns();
  board_->publish(current_);
}

int BoardPublisher::add_group(std::string_view name, int index, int size) {
  std::lock_guard lock(mutex_);
  if (name.empty() || name.size() >= kGroupNameBytes) {
    throw common::Error(common::ErrorCode::kInternal,
                        fmt::format("process group name '{}' is {} characters; the progress board holds names of 1 "
                                    "to {}",
                                    name, name.size(), kGroupNameBytes - 1));
  }
  if (groups_ == static_cast<int>(kMaxGroups)) {
    throw common::Error(common::ErrorCode::kInternal,
                        fmt::format("process group '{}' is this rank's group number {}; the progress board holds {}",
                                    name, groups_ + 1, kMaxGroups));
  }
  const int id = groups_++;
  GroupRecord& g = current_.groups[id];
  copy_name(g.name, name);
  g.index = index;
  g.size = size;
  if (board_) {
    current_.update_ns = clock_->now_ns();
    board_->publish(current_);
  }
  return id;
}

void BoardPublisher::set_blas_core(std::string_view core, std::string_view chosen_by) {
  update([&](BoardSnapshot& s) {
    core.copy(s.blas_core, sizeof s.blas_core - 1);
    chosen_by.copy(s.blas_chosen_by, sizeof s.blas_chosen_by - 1);
  });
}

void BoardPublisher::time_stalls(bool on) {
  update([&](BoardSnapshot&) { time_stalls_ = on; });
}

void BoardPublisher::set_extent(int64_t first_step, int64_t total_steps) {
  update([&](BoardSnapshot& s) {
    s.first_step = first_step;
    s.steps_done = first_step;
    s.total_steps = total_steps;
  });
}

void BoardPublisher::set_phase(Phase phase) {
  // Read before the lock, on the thread that changes phase: the training thread.
  const WaitMark mark = begin_wait();
  update([&](BoardSnapshot& s) {
    const int64_t now = mark.at_ns;
    const uint32_t ended = s.phase;
    if (ended < kPhaseCount) {
      s.phase_last_ms[ended] = to_ms(now - s.phase_start_ns);
      s.phase_count[ended] += 1;
      if (ended == static_cast<uint32_t>(Phase::kData) && step_ >= 0) set_aside(data_start_, mark, data_ns_);
    }
    if (phase == Phase::kData) data_start_ = mark;
    s.phase = static_cast<uint32_t>(phase);
    s.phase_start_ns = now;
  });
}

void BoardPublisher::begin_step(int64_t step) {
  const WaitMark mark = begin_wait();
  update([&](BoardSnapshot& s) {
    s.step_start_ns = mark.at_ns;
    step_start_ = mark;
    set_aside_ = {};
    step_ = step;
    wait_ns_ = 0;
    data_ns_ = 0;
    std::fill(std::begin(step_bytes_), std::end(step_bytes_), 0);
  });
}

void BoardPublisher::record_step_timing() {
  const WaitMark now = begin_wait();
  update([&](BoardSnapshot& s) {
    if (step_ < 0) return;
    const int64_t total = now.at_ns - step_start_.at_ns;
    StepTiming& t = s.steps[static_cast<size_t>(step_) % kRecentSteps];
    t.step = step_;
    t.total_ms = to_ms(total);
    t.wait_ms = to_ms(wait_ns_);
    t.data_ms = to_ms(data_ns_);
    // Waiting for a CPU inside a collective or the batch is that time
    // already. Only the training thread's own times are read: all of the
    // kernels' when they run on that one thread (train.threads = 1).
    const int64_t cpu_wait =
        std::max<int64_t>(0, now.times.cpu_wait_ns - step_start_.times.cpu_wait_ns - set_aside_.cpu_wait_ns);
    const int64_t on_cpu = now.times.on_cpu_ns - step_start_.times.on_cpu_ns - set_aside_.on_cpu_ns;
    // Its other threads' CPU time in compute: on a rank pinned to a core,
    // they ran while this one waited.
    const int64_t others_on_cpu = now.times.process_on_cpu_ns - step_start_.times.process_on_cpu_ns -
                                  set_aside_.process_on_cpu_ns - on_cpu;
    t.cpu_wait_ms = to_ms(cpu_wait);
    t.own_cpu_wait_ms = to_ms(std::clamp<int64_t>(others_on_cpu, 0, cpu_wait));
    t.compute_ms = to_ms(std::max<int64_t>(0, total - wait_ns_ - data_ns_ - cpu_wait));
    const int64_t stalled = total - wait_ns_ - data_ns_ - cpu_wait - on_cpu;
    t.stalled_ms = time_stalls_ ? to_ms(std::clamp<int64_t>(stalled, 0, total)) : 0;
    for (int g = 0; g < groups_; ++g) s.groups[g].step_bytes = step_bytes_[g];
    step_ = -1;
  });
}

void BoardPublisher::finish_step(int64_t steps_done, float loss, float grad_norm, double tokens_per_s,
                                 double step_ms) {
  update([&](BoardSnapshot& s) {
    s.steps_done = steps_done;
    s.loss = loss;
    s.grad_norm = grad_norm;
    s.tokens_per_s = tokens_per_s;
    s.step_ms = step_ms;
  });
}

void BoardPublisher::begin_collective(int group, int64_t seq, std::string_view op, uint64_t bytes) {
  update([&](BoardSnapshot& s) {
    if (group < 0 || group >= groups_) return;
    GroupRecord& g = s.groups[group];
    copy_name(g.op, op);
    g.seq_begun = seq;
    g.bytes = bytes;
    step_bytes_[group] += bytes;
    g.begin_ns = clock_->now_ns();
    g.state = static_cast<uint32_t>(CollectiveState::kInFlight);
    RecentCollective& r = s.recent[s.recent_count % kRecentCollectives];
    s.recent_count += 1;
    r = RecentCollective{group, g.state, seq, {}, bytes, g.begin_ns, 0};
    copy_name(r.op, op);
  });
}

void BoardPublisher::end_collective(int group, int64_t seq, bool ok) {
  update([&](BoardSnapshot& s) {
    if (group < 0 || group >= groups_) return;
    GroupRecord& g = s.groups[group];
    const int64_t now = clock_->now_ns();
    if (seq > g.seq_done) {
      g.seq_done = seq;
      g.done_ns = now;
    }
    if (g.seq_begun == seq) {
      g.state = static_cast<uint32_t>(ok ? CollectiveState::kDone : CollectiveState::kFailed);
    }
    for (auto& r : s.recent) {
      if (r.group != group || r.seq != seq) continue;
      r.state = static_cast<uint32_t>(ok ? CollectiveState::kDone : CollectiveState::kFailed);
      r.end_ns = now;
    }
  });
}

BoardPublisher::WaitMark BoardPublisher::begin_wait() const { return {clock_->now_ns(), clock_->thread_times()}; }

void BoardPublisher::end_wait(const WaitMark& mark) {
  // Read before the lock, on the thread that waited: the thread times are
  // that thread's own.
  const WaitMark now = begin_wait();
  update([&](BoardSnapshot&) {
    if (step_ >= 0) set_aside(mark, now, wait_ns_);
  });
}

void BoardPublisher::set_aside(const WaitMark& from, const WaitMark& to, int64_t& wall_ns) {
  wall_ns += to.at_ns - from.at_ns;
  set_aside_.on_cpu_ns += std::max<int64_t>(0, to.times.on_cpu_ns - from.times.on_cpu_ns);
  set_aside_.cpu_wait_ns += std::max<int64_t>(0, to.times.cpu_wait_ns - from.times.cpu_wait_ns);
  set_aside_.process_on_cpu_ns += std::max<int64_t>(0, to.times.process_on_cpu_ns - from.times.process_on_cpu_ns);
}

void BoardPublisher::checkpoint_written(int64_t step, uint64_t bytes, double write_s) {
  update([&](BoardSnapshot& s) {
    s.checkpoint_step = step;
    s.checkpoint_bytes = bytes;
    s.checkpoint_write_s = write_s;
  });
}

void BoardPublisher::snapshot_taken(int64_t step, uint64_t bytes, double stall_s) {
  update([&](BoardSnapshot& s) {
    s.snapshot_step = step;
    s.snapshot_bytes = bytes;
    s.snapshot_stall_s = stall_s;
  });
}

void BoardPublisher::publish_digest(int64_t steps_done, uint64_t replica_set, uint64_t digest) {
  update([&](BoardSnapshot& s) {
    s.digests[s.digest_count % kDigestSlots] = ReplicaDigest{steps_done, replica_set, digest};
    s.digest_count += 1;
  });
}

void BoardPublisher::report_sdc(int64_t step, int rank, SdcMethod method, SdcVerdict verdict) {
  update([&](BoardSnapshot& s) {
    s.sdc.count += 1;
    s.sdc.step = step;
    s.sdc.rank = rank;
    s.sdc.method = static_cast<uint32_t>(method);
    s.sdc.verdict = static_cast<uint32_t>(verdict);
  });
}

std::optional<FaultRequest> BoardPublisher::take_fault_request() {
  std::lock_guard lock(mutex_);
  if (!board_) return std::nullopt;
  const FaultRequest request = board_->fault_request();
  if (request.count == faults_seen_) return std::nullopt;
  faults_seen_ = request.count;
  return request;
}

bool BoardPublisher::take_checkpoint_request() {
  std::lock_guard lock(mutex_);
  if (!board_) return false;
  const uint64_t requests = board_->checkpoint_requests();
  if (requests == current_.checkpoint_requests_seen) return false;
  current_.checkpoint_requests_seen = requests;
  current_.update_ns = clock_->now_ns();
  board_->publish(current_);
  return true;
}

}  // namespace keel::health
