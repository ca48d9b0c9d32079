// When keeld starts a failed generation again, after how long, and when it
// gives up instead (docs/architecture.md "Daemon"). Plain arithmetic on the
// generations' outcomes, so that it is tested without ranks.
//
// A generation made progress when it committed a checkpoint: its successor
// starts from further on. Progress is counted in checkpoints, not steps,
// because a failure that recurs after the last checkpoint would otherwise
// loop forever. crash_loop_generations generations in a row without
// progress fail the job. The back-off before a restart is
// restart_backoff_s x 2^k, k the generations in a row without progress,
// capped at restart_backoff_max_s.
//
// A rank that exits 2 (bad config) or 3 (bad data) fails the job at once:
// the next generation would read the same config and data.
#pragma once

#include "common/config.h"

#include <cstdint>
#include <string>

namespace keel::daemon {

class RestartPolicy {
 public:
  explicit RestartPolicy(const common::DaemonConfig& daemon);

  struct Failure {
    std::string cause;             // the generation's first failure: "rank 1 killed by SIGKILL"
    int exit_code = -1;            // that rank's exit code (128 + signal when killed)
    bool progressed = false;       // the generation committed a checkpoint
    int64_t checkpoint_step = -1;  // the newest good checkpoint, for the reason; -1: none
  };
  struct Decision {
    bool give_up = false;
    std::string reason;  // when giving up: why, and what the operator does about it
    double delay_s = 0;  // otherwise: the back-off before the next generation
  };

  // A generation failed: restart it or give up.
  Decision after(const Failure& failure);
  // An operator's restart (keelctl restart) counts afresh.
  void forgive() { no_progress_ = 0; }

 private:
  int64_t crash_loop_generations_;
  double backoff_s_;
  double backoff_max_s_;
  int64_t no_progress_ = 0;  // generations in a row without a checkpoint
};

}  // namespace keel::daemon
