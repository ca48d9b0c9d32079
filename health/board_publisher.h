// The rank's side of its progress board: every part of keel-trainer that
// has news (the training loop, each communicator, the checkpoint writer
// thread) tells the publisher, which keeps the rank's snapshot and
// publishes it whole. Thread-safe; without a board (a rank run by hand)
// every call is a no-op.
#pragma once

#include "health/progress_board.h"

#include <cstdint>
#include <mutex>
#include <optional>
#include <string_view>

namespace keel::health {

class BoardPublisher {
 public:
  BoardPublisher() = default;
  BoardPublisher(ProgressBoard board, int rank, int64_t generation);

  bool active() const { return board_.has_value(); }

  // The run's extent: where this generation starts and where it ends.
  void set_extent(int64_t first_step, int64_t total_steps);
  void set_phase(Phase phase);
  void begin_step();
  void finish_step(int64_t steps_done, float loss, float grad_norm, double tokens_per_s, double step_ms);
  void begin_collective(std::string_view group, int64_t seq, std::string_view op, uint64_t bytes);
  void end_collective(std::string_view group, int64_t seq, bool ok);
  void checkpoint_written(int64_t step, uint64_t bytes, double write_s);

  // True once for every `keelctl checkpoint now` keeld relayed since the
  // last true (several requests in between count as one).
  bool take_checkpoint_request();

 private:
  template <class Change> void update(Change&& change);

  std::mutex mutex_;
  std::optional<ProgressBoard> board_;
  BoardSnapshot current_;
};

}  // namespace keel::health
