#include "daemon/job.h"

#include "common/error.h"
#include "common/events.h"
#include "common/log.h"
#include "daemon/protocol.h"
#include "daemon/rank_log.h"
#include "daemon/rank_spawner.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <fstream>

namespace keel::daemon {
namespace {

using Clock = std::chrono::steady_clock;

std::chrono::nanoseconds seconds(double s) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(s));
}

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

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

Job::Job(boost::asio::io_context& io, JobOptions options, std::function<void(JobState, bool)> on_end)
    : io_(io),
      options_(std::move(options)),
      on_end_(std::move(on_end)),
      run_dir_(options_.config.job.run_dir),
      restart_policy_(options_.config.daemon),
      history_(run_dir_),
      kill_timer_(io),
      restart_timer_(io),
      started_at_(Clock::now()) {
  const int world = static_cast<int>(options_.config.parallel.world_size());
  ranks_.resize(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) ranks_[static_cast<size_t>(r)].rank = r;
  if (options_.config.daemon.pin_cpus) {
    const auto available = allowed_cpus();
    cpus_ = cpu_shares(available, world);
    // One thread per CPU of a share; unpinned ranks divide keeld's CPUs.
    threads_per_rank_ = cpus_.front().empty() ? std::max<size_t>(1, available.size() / static_cast<size_t>(world))
                                              : cpus_.front().size();
  }
}

Job::~Job() {
  kill_ranks(SIGKILL);
  remove_boards();
}

void Job::event(const std::string& kind, nlohmann::json fields) const {
  common::append_event(run_dir_, kind, generation_, -1, std::move(fields));
}

void Job::start() {
  std::filesystem::create_directories(run_dir_ / "logs");
  remove_orphaned_boards();
  history_.refresh();
  generation_ = history_.last_generation() + 1;
  // Until the ranks say which checkpoint they resumed from, the newest one
  // committed is the best guess.
  base_checkpoint_ = history_.newest_committed();
  const auto& c = options_.config.checkpoint;
  if (c.every_steps == 0 && c.every_seconds == 0) {
    common::logger("job")->warn(
        "checkpoint.every_steps and every_seconds are 0: a restart begins again from step 0; set one of them");
  }
  start_generation();
}

void Job::start_generation() {
  auto log = common::logger("job");
  state_ = JobState::kStarting;
  failure_.clear();
  failure_code_ = -1;
  final_save_failure_.clear();
  resumed_ = false;
  generation_started_at_ = Clock::now();
  last_progress_log_ = Clock::now();
  const int world = static_cast<int>(ranks_.size());
  const std::string& store = options_.store_address;
  for (auto& rank : ranks_) {
    rank.pid = -1;
    rank.last.reset();
    rank.exit_code.reset();
    const std::string board = health::board_name(getpid(), rank.rank);
    rank.board.emplace(health::ProgressBoard::create(board));
    RankLaunch launch;
    launch.argv = {options_.trainer.string(), "--config", options_.config_path.string()};
    for (const auto& o : options_.overrides) {
      launch.argv.push_back("--set");
      launch.argv.push_back(o);
    }
    launch.env = {{"KEEL_RANK", std::to_string(rank.rank)},
                  {"KEEL_WORLD_SIZE", std::to_string(world)},
                  {"KEEL_LOCAL_RANK", std::to_string(rank.rank)},
                  {"KEEL_LOCAL_WORLD_SIZE", std::to_string(world)},
                  {"KEEL_GENERATION", std::to_string(generation_)},
                  {"KEEL_STORE", store},
                  {"KEEL_STORE_SECRET", options_.store_secret},
                  {"KEEL_BOARD", board},
                  {"KEEL_RUN_DIR", run_dir_.string()}};
    if (!cpus_.empty()) {
      launch.cpus = cpus_[static_cast<size_t>(rank.rank)];
      for (const char* var : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}) {
        launch.env[var] = std::to_string(threads_per_rank_);
      }
    }
    launch.log = rank_log_path(run_dir_, rank.rank);
    std::ofstream(launch.log, std::ios::app) << rank_log_header(generation_, rank.rank);
    try {
      rank.pid = spawn_rank(launch);
    } catch (const std::exception& e) {
      log->error("generation {}: {}", generation_, e.what());
      rank.exit_code = 127;
      on_rank_exit(rank, 127);
      return;
    }
  }
  log->info("generation {}: started {} ranks of {}, resuming from the checkpoint the ranks choose (the newest that "
            "loads)",
            generation_, world, options_.config.job.name);
  nlohmann::json pids = nlohmann::json::array();
  for (const auto& rank : ranks_) pids.push_back(rank.pid);
  event("generation_started", {{"ranks", world}, {"pids", pids}});
}

bool Job::on_child_exit(pid_t pid, int wait_status) {
  for (auto& rank : ranks_) {
    if (rank.pid != pid || rank.exit_code) continue;
    const int code = WIFEXITED(wait_status) ? WEXITSTATUS(wait_status)
                                            : 128 + (WIFSIGNALED(wait_status) ? WTERMSIG(wait_status) : 0);
    rank.exit_code = code;
    if (rank.board) {
      if (auto last = rank.board->read()) rank.last = last;
    }
    on_rank_exit(rank, code);
    return true;
  }
  return false;
}

void Job::on_rank_exit(Rank& rank, int code) {
  auto log = common::logger("job");
  const bool expected = state_ == JobState::kStopping || state_ == JobState::kRestarting || code == 0;
  if (expected) {
    log->info("generation {}: rank {} (pid {}) {}", generation_, rank.rank, rank.pid, describe_exit(code));
    // Whatever the other ranks say (today some exit 14), one rank's 13
    // during a stop means the final checkpoint was not committed.
    if (state_ == JobState::kStopping && code == common::exit_code(common::ErrorCode::kCheckpointFailure) &&
        final_save_failure_.empty()) {
      final_save_failure_ = rank_failure(rank, code);
    }
  } else {
    // The first failure of a generation is its cause; the other ranks'
    // exits that follow (peer failures) are consequences.
    failure_ = rank_failure(rank, code);
    failure_code_ = code;
    const int64_t step = rank.last ? rank.last->steps_done : -1;
    log->error("generation {}: {} at step {}; stopping the generation", generation_, failure_, step);
    event("rank_failed", {{"rank", rank.rank}, {"pid", rank.pid}, {"exit_code", code}, {"step", step},
                          {"cause", failure_}});
    // A survivor that waits for the dead rank outside a collective (rank 0
    // collecting checkpoint reports) learns of it here, not after a timeout.
    if (options_.store != nullptr) {
      try {
        options_.store->set(common::rank_failed_key(generation_), failure_);
      } catch (const std::exception& e) {
        log->warn("could not tell the ranks through the store that {}: {}", failure_, e.what());
      }
    }
    state_ = JobState::kRestarting;
    stop_ranks(SIGTERM, options_.config.daemon.grace_s);
  }
  if (!ranks_alive()) generation_over();
}

std::string Job::rank_failure(const Rank& rank, int code) const {
  std::string cause = fmt::format("rank {} {}", rank.rank, describe_exit(code));
  // Only a rank that exited by itself had its say.
  const std::string said = code < 128 ? last_error_sentence(rank_log_path(run_dir_, rank.rank)) : "";
  return said.empty() ? cause : cause + ": " + said;
}

bool Job::ranks_alive() const {
  return std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.pid > 0 && !r.exit_code; });
}

void Job::stop_ranks(int signal, double grace_s) {
  kill_ranks(signal);
  kill_timer_.expires_after(seconds(grace_s));
  kill_timer_.async_wait([this, grace_s](const boost::system::error_code& ec) {
    if (ec || !ranks_alive()) return;
    common::logger("job")->warn("generation {}: ranks still running {:.0f} s after SIGTERM; sending SIGKILL",
                                generation_, grace_s);
    kill_ranks(SIGKILL);
  });
}

void Job::kill_ranks(int signal) {
  for (const auto& rank : ranks_) {
    if (rank.pid > 0 && !rank.exit_code) ::kill(rank.pid, signal);
  }
}

void Job::remove_orphaned_boards() {
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

void Job::remove_boards() {
  for (auto& rank : ranks_) {
    if (rank.board) health::ProgressBoard::remove(rank.board->name());
    rank.board.reset();
  }
}

void Job::note_resume() {
  const auto& head = ranks_.front().last;
  // The extent is the first thing TrainLoop::run publishes; before it,
  // first_step means nothing.
  if (resumed_ || !head || head->total_steps == 0) return;
  resumed_ = true;
  const int64_t step = head->first_step;
  base_checkpoint_ = step > 0 ? step : -1;
  common::logger("job")->info("generation {}: the ranks resumed from {}", generation_,
                              step > 0 ? fmt::format("the checkpoint of step {}", step)
                                       : std::string("the start: no checkpoint loads"));
  event("generation_resumed", {{"step", step}});
}

int64_t Job::checkpoint_step() const {
  return std::max(base_checkpoint_, history_.committed_in(generation_));
}

void Job::generation_over() {
  auto log = common::logger("job");
  kill_timer_.cancel();
  poll();  // the boards' last words and the ranks' last events, for status and the events below
  remove_boards();
  // A generation made progress when it committed a checkpoint of its own:
  // the newest directory's name says nothing when that one is corrupt.
  const bool progressed = history_.committed_in(generation_) >= 0;
  base_checkpoint_ = checkpoint_step();
  nlohmann::json codes = nlohmann::json::array();
  bool all_zero = true;
  for (const auto& rank : ranks_) {
    codes.push_back(rank.exit_code.value_or(-1));
    all_zero = all_zero && rank.exit_code == 0;
  }
  const int64_t checkpoint = base_checkpoint_;
  event("generation_ended", {{"exit_codes", codes}, {"checkpoint_step", checkpoint}});

  if (after_stop_) {
    const AfterStop after = *after_stop_;
    after_stop_.reset();
    const bool final_save_failed = !final_save_failure_.empty();
    if (final_save_failed) {
      // Rank 0's reason for abandoning the save is the most precise one.
      const std::string abandoned = history_.abandoned_in(generation_);
      const std::string cause = abandoned.empty() ? final_save_failure_ : abandoned;
      event("final_checkpoint_failed", {{"cause", cause}, {"checkpoint_step", checkpoint}});
      failure_ = fmt::format("the final checkpoint was not saved: {}. {}", cause,
                             checkpoint >= 0 ? fmt::format("The newest good checkpoint is step {}; starting keeld "
                                                           "again resumes from it",
                                                           checkpoint)
                                             : std::string("There is no good checkpoint; starting keeld again "
                                                           "begins at step 0"));
      log->error("generation {}: {}", generation_, failure_);
    }
    if (after == AfterStop::kRestart) {
      ++generation_;
      ++restarts_;
      restart_policy_.forgive();
      start_generation();
      return;
    }
    if (final_save_failed) {
      event("job_failed", {{"reason", failure_}});
      end(JobState::kFailed);
      return;
    }
    log->info("stopped; the newest checkpoint is step {}; starting keeld again resumes from it", checkpoint);
    event("job_stopped", {{"checkpoint_step", checkpoint}});
    end(JobState::kStopped);
    return;
  }
  if (all_zero) {
    log->info("job {} finished: {} steps; final checkpoint step {}", options_.config.job.name, steps_done(),
              checkpoint);
    event("job_finished", {{"step", steps_done()}, {"checkpoint_step", checkpoint}});
    end(JobState::kFinished);
    return;
  }
  if (failure_.empty()) failure_ = "the ranks exited without a cause";
  const auto decision = restart_policy_.after({failure_, failure_code_, progressed, checkpoint});
  if (decision.give_up) {
    failure_ = decision.reason;
    log->error("job {} failed: {}", options_.config.job.name, failure_);
    event("job_failed", {{"reason", failure_}});
    end(JobState::kFailed);
    return;
  }
  const double delay = decision.delay_s;
  log->warn("generation {} failed ({}); restarting in {:.1f} s from the newest checkpoint that loads (step {} as far "
            "as keeld knows)",
            generation_, failure_, delay, checkpoint);
  event("restart_scheduled", {{"cause", failure_}, {"delay_s", delay}, {"checkpoint_step", checkpoint}});
  state_ = JobState::kRestarting;
  restart_timer_.expires_after(seconds(delay));
  restart_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || state_ != JobState::kRestarting) return;
    ++generation_;
    ++restarts_;
    start_generation();
  });
}

void Job::end(JobState state) {
  state_ = state;
  if (state == JobState::kFailed || state == JobState::kFinished || state == JobState::kStopped) {
    on_end_(state, stop_requested_);
  }
}

void Job::poll() {
  for (auto& rank : ranks_) {
    if (!rank.board) continue;
    if (auto snapshot = rank.board->read()) rank.last = snapshot;
  }
  history_.refresh();
  note_resume();
  if (state_ == JobState::kStarting) {
    const bool all_up = std::all_of(ranks_.begin(), ranks_.end(), [](const Rank& r) {
      return r.last && r.last->phase != static_cast<uint32_t>(health::Phase::kInit);
    });
    if (all_up) {
      state_ = JobState::kRunning;
      common::logger("job")->info("generation {}: all {} ranks are training", generation_, ranks_.size());
    }
  }
  if (state_ == JobState::kRunning &&
      seconds_between(last_progress_log_, Clock::now()) >= options_.config.daemon.progress_every_s) {
    last_progress_log_ = Clock::now();
    const std::string line = progress_line(report());
    if (!line.empty()) common::logger("job")->info("{}", line);
  }
}

int64_t Job::steps_done() const {
  const auto& first = ranks_.front().last;
  return first ? first->steps_done : std::max<int64_t>(checkpoint_step(), 0);
}

nlohmann::json Job::checkpoint_now() {
  const auto& c = options_.config.checkpoint;
  if (c.every_steps == 0 && c.every_seconds == 0) {
    return error_reply("checkpoints are off for this job: set checkpoint.every_steps or every_seconds");
  }
  if (state_ != JobState::kRunning && state_ != JobState::kStarting) {
    return error_reply(fmt::format("no generation is training (the job is {})", job_state_name(state_)));
  }
  for (auto& rank : ranks_) {
    if (rank.board) rank.board->request_checkpoint();
  }
  event("checkpoint_requested", {{"step", steps_done()}});
  return {{"ok", true},
          {"message", fmt::format("the ranks will save after the step in progress (step {} is done); watch "
                                  "keelctl events for checkpoint_committed",
                                  steps_done())}};
}

nlohmann::json Job::stop(bool checkpoint, const std::string& by) {
  auto log = common::logger("job");
  switch (state_) {
    case JobState::kStopping:
      if (!checkpoint && stop_checkpoint_) {
        stop_checkpoint_ = false;
        kill_ranks(SIGKILL);
        return {{"ok", true}, {"message", "stopping now without waiting for the final checkpoint"}};
      }
      return error_reply("the job is already stopping");
    case JobState::kFinished:
    case JobState::kFailed:
    case JobState::kStopped:
      event("stop_requested", {{"by", by}, {"checkpoint", false}});
      stop_requested_ = true;
      end(JobState::kStopped);
      return {{"ok", true}, {"message", fmt::format("the job had {}; keeld exits", job_state_name(state_))}};
    case JobState::kRestarting:
      if (!ranks_alive()) {
        restart_timer_.cancel();
        event("stop_requested", {{"by", by}, {"checkpoint", false}});
        event("job_stopped", {{"checkpoint_step", checkpoint_step()}});
        stop_requested_ = true;
        end(JobState::kStopped);
        return {{"ok", true}, {"message", "the restart is cancelled; keeld exits"}};
      }
      break;  // the failed generation is being stopped: end instead of restarting
    case JobState::kStarting:
    case JobState::kRunning:
      break;
  }
  log->warn("stop requested by {}: {}", by,
            checkpoint ? "the ranks save a final checkpoint, then exit" : "killing the ranks without a checkpoint");
  event("stop_requested", {{"by", by}, {"checkpoint", checkpoint}});
  stop_requested_ = true;
  const bool tearing_down = state_ == JobState::kRestarting;
  state_ = JobState::kStopping;
  after_stop_ = AfterStop::kEnd;
  stop_checkpoint_ = checkpoint && !tearing_down;
  if (!tearing_down) {
    if (checkpoint) {
      stop_ranks(SIGTERM, options_.config.daemon.stop_timeout_s);
    } else {
      kill_ranks(SIGKILL);
    }
  }
  return {{"ok", true},
          {"message", checkpoint ? "stopping: the ranks save a final checkpoint, then keeld exits"
                                 : "stopping without a final checkpoint"}};
}

nlohmann::json Job::restart(const std::string& by) {
  event("restart_requested", {{"by", by}});
  switch (state_) {
    case JobState::kStarting:
    case JobState::kRunning:
      common::logger("job")->warn("restart requested by {}: the ranks save a checkpoint, then a new generation starts",
                                  by);
      state_ = JobState::kStopping;
      after_stop_ = AfterStop::kRestart;
      stop_checkpoint_ = true;
      stop_ranks(SIGTERM, options_.config.daemon.stop_timeout_s);
      return {{"ok", true}, {"message", "restarting: the ranks save a checkpoint, then a new generation starts"}};
    case JobState::kRestarting:
      if (ranks_alive()) return error_reply("a restart is already under way");
      restart_timer_.cancel();
      break;
    case JobState::kFinished:
    case JobState::kFailed:
      break;
    case JobState::kStopping:
    case JobState::kStopped:
      return error_reply("the job is stopping; start keeld again to resume it");
  }
  ++generation_;
  ++restarts_;
  restart_policy_.forgive();
  start_generation();
  return {{"ok", true}, {"message", fmt::format("generation {} is starting", generation_)}};
}

JobReport Job::report() const {
  JobReport r;
  r.job = options_.config.job.name;
  r.state = state_;
  r.generation = generation_;
  r.restarts = restarts_;
  r.step = steps_done();
  r.total_steps = options_.config.train.steps;
  r.checkpoint_step = checkpoint_step();
  r.reason = failure_;
  r.run_dir = run_dir_;
  r.uptime_s = seconds_between(started_at_, Clock::now());
  r.stale_after_s = options_.config.daemon.stale_after_s;
  for (const auto& rank : ranks_) r.ranks.push_back(rank);
  return r;
}

}  // namespace keel::daemon
