#include "daemon/job_state.h"

#include "common/error.h"
#include "daemon/protocol.h"

#include <fmt/format.h>

#include <algorithm>
#include <csignal>

namespace keel::daemon {
namespace {

JobAction log_action(spdlog::level::level_enum level, std::string text) {
  JobAction a;
  a.kind = JobAction::Kind::kLog;
  a.level = level;
  a.text = std::move(text);
  return a;
}

JobAction signal_action(int signal) {
  JobAction a;
  a.kind = JobAction::Kind::kSignal;
  a.signal = signal;
  return a;
}

JobAction terminate_action(double grace_s) {
  JobAction a;
  a.kind = JobAction::Kind::kTerminate;
  a.grace_s = grace_s;
  return a;
}

JobAction tell_ranks_action(int64_t generation, std::string cause, std::vector<std::string> culprit_nodes = {}) {
  JobAction a;
  a.kind = JobAction::Kind::kTellRanks;
  a.generation = generation;
  a.text = std::move(cause);
  a.nodes = std::move(culprit_nodes);
  return a;
}

nlohmann::json ok_reply(const std::string& message) { return {{"ok", true}, {"message", message}}; }

}  // namespace

const char* job_state_name(JobState state) {
  switch (state) {
    case JobState::kStarting: return "starting";
    case JobState::kRunning: return "running";
    case JobState::kRestarting: return "restarting";
    case JobState::kStopping: return "stopping";
    case JobState::kFinished: return "finished";
    case JobState::kFailed: return "failed";
    case JobState::kStopped: return "stopped";
  }
  return "unknown";
}

JobMachine::JobMachine(std::string job_name, const common::DaemonConfig& daemon)
    : job_name_(std::move(job_name)),
      grace_s_(daemon.grace_s),
      stop_timeout_s_(daemon.stop_timeout_s),
      restart_backoff_s_(daemon.restart_backoff_s),
      restart_policy_(daemon) {}

JobAction JobMachine::record(const std::string& kind, nlohmann::json fields) const {
  JobAction a;
  a.kind = JobAction::Kind::kRecord;
  a.generation = generation_;
  a.text = kind;
  a.fields = std::move(fields);
  return a;
}

void JobMachine::end(JobState state, JobActions& actions) {
  state_ = state;
  JobAction a;
  a.kind = JobAction::Kind::kEnd;
  a.state = state;
  a.stop_requested = stop_requested_;
  actions.push_back(std::move(a));
}

Transition JobMachine::start(int64_t first_generation) {
  generation_ = first_generation;
  return start_generation();
}

Transition JobMachine::start_generation() {
  state_ = JobState::kStarting;
  failure_.clear();
  failure_code_ = -1;
  final_save_failure_.clear();
  restart_at_ns_.reset();
  generation_live_ = true;
  JobAction a;
  a.kind = JobAction::Kind::kStartGeneration;
  a.generation = generation_;
  return {{std::move(a)}, nullptr};
}

Transition JobMachine::ranks_up() {
  if (state_ != JobState::kStarting) return {};
  state_ = JobState::kRunning;
  return {{log_action(spdlog::level::info, fmt::format("generation {}: every rank is training", generation_))},
          nullptr};
}

Transition JobMachine::rank_exited(const RankExit& exit) {
  Transition t;
  const bool expected = state_ == JobState::kStopping || state_ == JobState::kRestarting || exit.code == 0;
  if (expected) {
    t.actions.push_back(
        log_action(spdlog::level::info, fmt::format("generation {}: {} (pid {})", generation_, exit.cause, exit.pid)));
    // Whatever the other ranks say (today some exit 14), one rank's 13
    // during a stop means the final checkpoint was not committed.
    if (state_ == JobState::kStopping && exit.code == common::exit_code(common::ErrorCode::kCheckpointFailure) &&
        final_save_failure_.empty()) {
      final_save_failure_ = exit.cause;
    }
    return t;
  }
  // The first failure of a generation is its cause; the other ranks'
  // exits that follow (peer failures) are consequences.
  failure_ = exit.cause;
  failure_code_ = exit.code;
  t.actions.push_back(log_action(
      spdlog::level::err,
      fmt::format("generation {}: {} at step {}; stopping the generation", generation_, failure_, exit.step)));
  t.actions.push_back(record("rank_failed", {{"rank", exit.rank},
                                             {"pid", exit.pid},
                                             {"exit_code", exit.code},
                                             {"step", exit.step},
                                             {"cause", failure_}}));
  // A survivor that waits for the dead rank outside a collective (rank 0
  // collecting checkpoint reports) learns of it here, not after a timeout.
  t.actions.push_back(tell_ranks_action(generation_, failure_));
  state_ = JobState::kRestarting;
  t.actions.push_back(terminate_action(grace_s_));
  return t;
}

Transition JobMachine::fail_live_generation(const std::string& cause, std::string said, JobActions records,
                                            JobAction stop, std::vector<std::string> culprit_nodes) {
  if (state_ != JobState::kStarting && state_ != JobState::kRunning) return {};
  Transition t;
  failure_ = cause;
  failure_code_ = -1;
  t.actions.push_back(log_action(spdlog::level::err, std::move(said)));
  t.actions.insert(t.actions.end(), records.begin(), records.end());
  t.actions.push_back(tell_ranks_action(generation_, cause, std::move(culprit_nodes)));
  state_ = JobState::kRestarting;
  t.actions.push_back(std::move(stop));
  return t;
}

Transition JobMachine::verdict(const std::string& cause, std::vector<std::string> culprit_nodes) {
  return fail_live_generation(cause, fmt::format("generation {}: {}; stopping the generation", generation_, cause), {},
                              signal_action(SIGKILL), std::move(culprit_nodes));
}

void JobMachine::joined(int64_t generation) {
  if (state_ == JobState::kStarting && generation_live_) generation_ = generation;
}

Transition JobMachine::join_failed(const std::string& cause, int64_t now_ns) {
  if (state_ != JobState::kStarting) return {};
  Transition t;
  failure_ = cause;
  failure_code_ = -1;
  generation_live_ = false;
  state_ = JobState::kRestarting;
  restart_at_ns_ = now_ns + static_cast<int64_t>(restart_backoff_s_ * 1e9);
  t.actions.push_back(log_action(spdlog::level::warn, fmt::format("no generation with this node: {}; joining again "
                                                                  "in {:.1f} s",
                                                                  cause, restart_backoff_s_)));
  t.actions.push_back(record("join_failed", {{"cause", cause}, {"delay_s", restart_backoff_s_}}));
  return t;
}

Transition JobMachine::ended_elsewhere(const std::string& cause, bool named_here) {
  return fail_live_generation(
      cause,
      fmt::format("generation {} ended on another node: {}; {} this node's ranks", generation_, cause,
                  named_here ? "the verdict names ranks of this node: killing" : "stopping"),
      {record("generation_ended_elsewhere", {{"cause", cause}})},
      named_here ? signal_action(SIGKILL) : terminate_action(grace_s_));
}

Transition JobMachine::finished_elsewhere(const std::string& where, int64_t checkpoint_step) {
  if (state_ != JobState::kStarting) return {};
  Transition t;
  generation_live_ = false;
  t.actions.push_back(log_action(spdlog::level::info,
                                 fmt::format("job {} finished {} while this node was away; final checkpoint step {}",
                                             job_name_, where, checkpoint_step)));
  t.actions.push_back(record("job_finished", {{"elsewhere", where}, {"checkpoint_step", checkpoint_step}}));
  end(JobState::kFinished, t.actions);
  return t;
}

Transition JobMachine::generation_over(const GenerationOutcome& outcome, int64_t now_ns) {
  Transition t;
  auto& actions = t.actions;
  generation_live_ = false;
  const int64_t checkpoint = outcome.checkpoint_step;
  actions.push_back(record("generation_ended", {{"exit_codes", outcome.exit_codes}, {"checkpoint_step", checkpoint}}));

  if (after_stop_) {
    const AfterStop after = *after_stop_;
    after_stop_.reset();
    const bool final_save_failed = !final_save_failure_.empty();
    if (final_save_failed) {
      // Rank 0's reason for abandoning the save is the most precise one.
      const std::string cause = outcome.abandoned_cause.empty() ? final_save_failure_ : outcome.abandoned_cause;
      actions.push_back(record("final_checkpoint_failed", {{"cause", cause}, {"checkpoint_step", checkpoint}}));
      failure_ = fmt::format("the final checkpoint was not saved: {}. {}", cause,
                             checkpoint >= 0 ? fmt::format("The newest good checkpoint is step {}; starting keeld "
                                                           "again resumes from it",
                                                           checkpoint)
                                             : std::string("There is no good checkpoint; starting keeld again "
                                                           "begins at step 0"));
      actions.push_back(log_action(spdlog::level::err, fmt::format("generation {}: {}", generation_, failure_)));
    }
    if (after == AfterStop::kRestart) {
      ++generation_;
      ++restarts_;
      restart_policy_.forgive();
      auto next = start_generation();
      actions.insert(actions.end(), next.actions.begin(), next.actions.end());
      return t;
    }
    if (final_save_failed) {
      actions.push_back(record("job_failed", {{"reason", failure_}}));
      end(JobState::kFailed, actions);
      return t;
    }
    actions.push_back(log_action(
        spdlog::level::info,
        fmt::format("stopped; the newest checkpoint is step {}; starting keeld again resumes from it", checkpoint)));
    actions.push_back(record("job_stopped", {{"checkpoint_step", checkpoint}}));
    end(JobState::kStopped, actions);
    return t;
  }
  const bool all_zero = std::all_of(outcome.exit_codes.begin(), outcome.exit_codes.end(), [](int c) { return c == 0; });
  if (all_zero && failure_.empty()) {
    actions.push_back(log_action(spdlog::level::info,
                                 fmt::format("job {} finished: {} steps; final checkpoint step {}", job_name_,
                                             outcome.steps_done, checkpoint)));
    actions.push_back(record("job_finished", {{"step", outcome.steps_done}, {"checkpoint_step", checkpoint}}));
    end(JobState::kFinished, actions);
    return t;
  }
  if (failure_.empty()) failure_ = "the ranks exited without a cause";
  const auto decision = restart_policy_.after({failure_, failure_code_, outcome.progressed, checkpoint});
  if (decision.give_up) {
    failure_ = decision.reason;
    actions.push_back(
        log_action(spdlog::level::err, fmt::format("job {} failed: {}", job_name_, failure_)));
    actions.push_back(record("job_failed", {{"reason", failure_}}));
    end(JobState::kFailed, actions);
    return t;
  }
  actions.push_back(log_action(spdlog::level::warn,
                               fmt::format("generation {} failed ({}); restarting in {:.1f} s from the ranks' "
                                           "newest in-memory snapshot or the newest checkpoint that loads (step {} "
                                           "as far as keeld knows)",
                                           generation_, failure_, decision.delay_s, checkpoint)));
  actions.push_back(
      record("restart_scheduled", {{"cause", failure_}, {"delay_s", decision.delay_s}, {"checkpoint_step", checkpoint}}));
  state_ = JobState::kRestarting;
  restart_at_ns_ = now_ns + static_cast<int64_t>(decision.delay_s * 1e9);
  return t;
}

Transition JobMachine::tick(int64_t now_ns) {
  if (state_ != JobState::kRestarting || generation_live_ || !restart_at_ns_ || now_ns < *restart_at_ns_) return {};
  ++generation_;
  ++restarts_;
  return start_generation();
}

Transition JobMachine::stop(bool checkpoint, const std::string& by, int64_t checkpoint_step) {
  Transition t;
  auto& actions = t.actions;
  switch (state_) {
    case JobState::kStopping:
      if (!checkpoint && stop_checkpoint_) {
        stop_checkpoint_ = false;
        actions.push_back(signal_action(SIGKILL));
        t.reply = ok_reply("stopping now without waiting for the final checkpoint");
        return t;
      }
      t.reply = error_reply("the job is already stopping");
      return t;
    case JobState::kFinished:
    case JobState::kFailed:
    case JobState::kStopped: {
      const JobState was = state_;
      actions.push_back(record("stop_requested", {{"by", by}, {"checkpoint", false}}));
      stop_requested_ = true;
      end(JobState::kStopped, actions);
      t.reply = ok_reply(fmt::format("the job had {}; keeld exits", job_state_name(was)));
      return t;
    }
    case JobState::kRestarting:
      if (!generation_live_) {
        restart_at_ns_.reset();
        actions.push_back(record("stop_requested", {{"by", by}, {"checkpoint", false}}));
        actions.push_back(record("job_stopped", {{"checkpoint_step", checkpoint_step}}));
        stop_requested_ = true;
        end(JobState::kStopped, actions);
        t.reply = ok_reply("the restart is cancelled; keeld exits");
        return t;
      }
      break;  // the failed generation is being stopped: end instead of restarting
    case JobState::kStarting:
    case JobState::kRunning:
      break;
  }
  actions.push_back(log_action(spdlog::level::warn,
                               fmt::format("stop requested by {}: {}", by,
                                           checkpoint ? "the ranks save a final checkpoint, then exit"
                                                      : "killing the ranks without a checkpoint")));
  actions.push_back(record("stop_requested", {{"by", by}, {"checkpoint", checkpoint}}));
  stop_requested_ = true;
  const bool tearing_down = state_ == JobState::kRestarting;
  state_ = JobState::kStopping;
  after_stop_ = AfterStop::kEnd;
  stop_checkpoint_ = checkpoint && !tearing_down;
  if (!tearing_down) actions.push_back(checkpoint ? terminate_action(stop_timeout_s_) : signal_action(SIGKILL));
  t.reply = ok_reply(checkpoint ? "stopping: the ranks save a final checkpoint, then keeld exits"
                                : "stopping without a final checkpoint");
  return t;
}

Transition JobMachine::restart(const std::string& by) {
  Transition t;
  t.actions.push_back(record("restart_requested", {{"by", by}}));
  switch (state_) {
    case JobState::kStarting:
    case JobState::kRunning:
      t.actions.push_back(log_action(
          spdlog::level::warn,
          fmt::format("restart requested by {}: the ranks save a checkpoint, then a new generation starts", by)));
      state_ = JobState::kStopping;
      after_stop_ = AfterStop::kRestart;
      stop_checkpoint_ = true;
      t.actions.push_back(terminate_action(stop_timeout_s_));
      t.reply = ok_reply("restarting: the ranks save a checkpoint, then a new generation starts");
      return t;
    case JobState::kRestarting:
      if (generation_live_) {
        t.reply = error_reply("a restart is already under way");
        return t;
      }
      restart_at_ns_.reset();
      break;
    case JobState::kFinished:
    case JobState::kFailed:
      break;
    case JobState::kStopping:
    case JobState::kStopped:
      t.reply = error_reply("the job is stopping; start keeld again to resume it");
      return t;
  }
  ++generation_;
  ++restarts_;
  restart_policy_.forgive();
  auto next = start_generation();
  t.actions.insert(t.actions.end(), next.actions.begin(), next.actions.end());
  t.reply = ok_reply(fmt::format("generation {} is starting", generation_));
  return t;
}

}  // namespace keel::daemon
