// The rank's side of its progress board: every part of keel-trainer that
// has news (the training loop, each communicator, the checkpoint writer
// thread, the SDC checks) tells the publisher, which keeps the rank's
// snapshot and publishes it whole. It also keeps the board's heartbeat
// beating from a thread of its own, and accounts each step's time to
// compute, collective wait and data (docs/architecture.md "Health").
// Thread-safe; without a board (a rank run by hand) every call but
// add_group is a no-op.
#pragma once

#include "common/clock.h"
#include "health/progress_board.h"

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>

namespace keel::health {

class BoardPublisher {
 public:
  BoardPublisher() = default;
  // Publishes the first snapshot and starts beating the heartbeat every
  // `heartbeat_period_ns` on `clock`.
  BoardPublisher(ProgressBoard board, int rank, int64_t generation, const common::Clock& clock = common::Clock::steady(),
                 int64_t heartbeat_period_ns = 100'000'000);
  ~BoardPublisher();
  BoardPublisher(const BoardPublisher&) = delete;
  BoardPublisher& operator=(const BoardPublisher&) = delete;

  bool active() const { return board_.has_value(); }

  // Registers a process group this rank belongs to (at `index` of `size`
  // ranks) and returns its id for begin/end_collective. Error(kInternal)
  // when the name does not fit kGroupNameBytes or the table is full: a
  // group is never shown under a truncated name. Works without a board too,
  // so a communicator's calls take one path either way.
  int add_group(std::string_view name, int index, int size);

  // The OpenBLAS core the rank runs and whose choice it is; a name longer
  // than the field is cut (core names are short).
  void set_blas_core(std::string_view core, std::string_view chosen_by);
  // Whether the training thread does the step's compute itself (a CPU
  // rank), so that time in compute it neither ran nor waited for a CPU is
  // a stall (StepTiming::stalled_ms). A rank that computes on a device
  // waits for it by design and reports no stalls. On unless told.
  void time_stalls(bool on);
  // The run's extent: where this generation starts and where it ends.
  void set_extent(int64_t first_step, int64_t total_steps);
  // Ends the current phase (its duration feeds the phase's budget) and
  // starts `phase`.
  void set_phase(Phase phase);
  // Starts timing `step` (0-based): collective wait and data time count
  // towards it until record_step_timing().
  void begin_step(int64_t step);
  // Closes the step's timing: total since begin_step, split into wait,
  // data and the rest (compute), and each group's payload begun since
  // (GroupRecord::step_bytes).
  void record_step_timing();
  void finish_step(int64_t steps_done, float loss, float grad_norm, double tokens_per_s, double step_ms);
  // A collective of `group` runs from begin to end (on whatever thread
  // runs it): what keeld's hang detector watches.
  void begin_collective(int group, int64_t seq, std::string_view op, uint64_t bytes);
  void end_collective(int group, int64_t seq, bool ok);
  // The calling thread is blocked on collectives from begin_wait() to
  // end_wait(): that is the step's collective wait, and its run-queue wait
  // in between is not waiting for a CPU. A collective that runs while the
  // training thread computes (overlapped) is not wait.
  struct WaitMark {
    int64_t at_ns = 0;
    common::Clock::ThreadTimes times;
  };
  WaitMark begin_wait() const;
  void end_wait(const WaitMark& mark);
  void checkpoint_written(int64_t step, uint64_t bytes, double write_s);
  void snapshot_taken(int64_t step, uint64_t bytes, double stall_s);
  // The replica digest of the state after `steps_done` steps.
  void publish_digest(int64_t steps_done, uint64_t replica_set, uint64_t digest);
  // A finding of the rank's own checks (rerun, known-answer test).
  void report_sdc(int64_t step, int rank, SdcMethod method, SdcVerdict verdict);

  // A fault keeld relayed (`keelctl inject`) and not taken before, once.
  std::optional<FaultRequest> take_fault_request();

  // True once for every `keelctl checkpoint now` keeld relayed since the
  // last true (several requests in between count as one).
  bool take_checkpoint_request();

 private:
  template <class Change> void update(Change&& change);
  // Adds the time from `from` to `to` to `wall_ns` (collective wait or data)
  // and its thread times to set_aside_; under the lock.
  void set_aside(const WaitMark& from, const WaitMark& to, int64_t& wall_ns);
  void beat_until_stopped(int64_t period_ns);

  const common::Clock* clock_ = &common::Clock::steady();
  std::mutex mutex_;
  std::optional<ProgressBoard> board_;
  BoardSnapshot current_;
  int groups_ = 0;
  uint64_t faults_seen_ = 0;
  // The step being timed.
  int64_t step_ = -1;
  int64_t wait_ns_ = 0;
  int64_t data_ns_ = 0;
  // The training thread's times at the step's start and at the data
  // phase's, and what of them the step spent blocked on collectives or
  // building its batch, which is neither its compute nor a stall of it.
  WaitMark step_start_, data_start_;
  bool time_stalls_ = true;
  common::Clock::ThreadTimes set_aside_;
  uint64_t step_bytes_[kMaxGroups] = {};  // per group, begun since the step began
  std::condition_variable stop_beating_;
  bool stopping_ = false;
  std::thread heartbeat_;
};

}  // namespace keel::health
