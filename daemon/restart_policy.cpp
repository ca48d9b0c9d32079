#include "daemon/restart_policy.h"

#include "common/error.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace keel::daemon {

RestartPolicy::RestartPolicy(const common::DaemonConfig& daemon)
    : crash_loop_generations_(daemon.crash_loop_generations),
      backoff_s_(daemon.restart_backoff_s),
      backoff_max_s_(daemon.restart_backoff_max_s) {}

RestartPolicy::Decision RestartPolicy::after(const Failure& failure) {
  no_progress_ = failure.progressed ? 0 : no_progress_ + 1;
  Decision decision;
  if (failure.exit_code == common::exit_code(common::ErrorCode::kBadConfig) ||
      failure.exit_code == common::exit_code(common::ErrorCode::kDataError)) {
    decision.give_up = true;
    decision.reason = fmt::format("{}; restarting cannot help: fix the config or the data, then keelctl restart",
                                  failure.cause);
  } else if (no_progress_ >= crash_loop_generations_) {
    decision.give_up = true;
    decision.reason = fmt::format(
        "crash loop: {} generations in a row ended without a checkpoint newer than step {}; last failure: {}. Fix the "
        "cause (see run_dir/logs and events), then keelctl restart",
        no_progress_, failure.checkpoint_step, failure.cause);
  } else {
    decision.delay_s = std::min(backoff_max_s_, backoff_s_ * std::pow(2.0, static_cast<double>(no_progress_)));
  }
  return decision;
}

}  // namespace keel::daemon
