#include "health/board_publisher.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace keel::health {
namespace {

template <size_t N> void copy_name(char (&to)[N], std::string_view from) {
  const size_t n = std::min(from.size(), N - 1);
  std::memcpy(to, from.data(), n);
  std::memset(to + n, 0, N - n);
}

}  // namespace

BoardPublisher::BoardPublisher(ProgressBoard board, int rank, int64_t generation) : board_(std::move(board)) {
  current_.rank = rank;
  current_.pid = static_cast<int32_t>(getpid());
  current_.generation = generation;
  current_.checkpoint_requests_seen = board_->checkpoint_requests();
  update([](BoardSnapshot&) {});
}

template <class Change> void BoardPublisher::update(Change&& change) {
  std::lock_guard lock(mutex_);
  if (!board_) return;
  change(current_);
  current_.update_ns = monotonic_ns();
  board_->publish(current_);
}

void BoardPublisher::set_extent(int64_t first_step, int64_t total_steps) {
  update([&](BoardSnapshot& s) {
    s.first_step = first_step;
    s.steps_done = first_step;
    s.total_steps = total_steps;
  });
}

void BoardPublisher::set_phase(Phase phase) {
  update([&](BoardSnapshot& s) { s.phase = static_cast<uint32_t>(phase); });
}

void BoardPublisher::begin_step() {
  update([&](BoardSnapshot& s) { s.step_start_ns = monotonic_ns(); });
}

void BoardPublisher::finish_step(int64_t steps_done, float loss, float grad_norm, double tokens_per_s,
                                 double step_ms) {
  update([&](BoardSnapshot& s) {
    s.recent_step_ms[(steps_done - 1) % static_cast<int64_t>(kRecentSteps)] = step_ms;
    s.steps_done = steps_done;
    s.loss = loss;
    s.grad_norm = grad_norm;
    s.tokens_per_s = tokens_per_s;
    s.step_ms = step_ms;
  });
}

void BoardPublisher::begin_collective(std::string_view group, int64_t seq, std::string_view op, uint64_t bytes) {
  update([&](BoardSnapshot& s) {
    copy_name(s.collective.group, group);
    copy_name(s.collective.op, op);
    s.collective.seq = seq;
    s.collective.bytes = bytes;
    s.collective.start_ns = monotonic_ns();
    s.collective.end_ns = 0;
    s.collective.state = static_cast<uint32_t>(CollectiveState::kInFlight);
  });
}

void BoardPublisher::end_collective(std::string_view group, int64_t seq, bool ok) {
  update([&](BoardSnapshot& s) {
    // Another thread's collective may have begun since; the board shows the newest.
    if (s.collective.seq != seq || group != s.collective.group) return;
    s.collective.end_ns = monotonic_ns();
    s.collective.state = static_cast<uint32_t>(ok ? CollectiveState::kDone : CollectiveState::kFailed);
  });
}

void BoardPublisher::checkpoint_written(int64_t step, uint64_t bytes, double write_s) {
  update([&](BoardSnapshot& s) {
    s.checkpoint_step = step;
    s.checkpoint_bytes = bytes;
    s.checkpoint_write_s = write_s;
  });
}

bool BoardPublisher::take_checkpoint_request() {
  std::lock_guard lock(mutex_);
  if (!board_) return false;
  const uint64_t requests = board_->checkpoint_requests();
  if (requests == current_.checkpoint_requests_seen) return false;
  current_.checkpoint_requests_seen = requests;
  current_.update_ns = monotonic_ns();
  board_->publish(current_);
  return true;
}

}  // namespace keel::health
