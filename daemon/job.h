// The job keeld runs (docs/architecture.md "Daemon"): one generation of local ranks at a
// time, supervised from keeld's event loop.
//
//   starting ──▶ running ──▶ finished          every rank exited 0
//       │           │
//       │           ├──▶ restarting ──▶ starting (generation + 1, after back-off)
//       │           │        └────────▶ failed (crash loop, or a rank refused the config or data)
//       └───────────┴──▶ stopping ──▶ (stopped: keeld exits 0)
//                              ├────▶ failed (a rank exited 13: the final checkpoint was not saved)
//                              └────▶ starting (keelctl restart)
//
// A rank that exits non-zero (or is killed) fails its generation: keeld
// records the cause, stops the other ranks (SIGTERM, grace, SIGKILL) and
// starts the next generation from the newest checkpoint that loads: the
// ranks pick it themselves, and keeld reports their choice (rank 0's board
// names the step they resumed from) rather than guessing from directory
// names, which a corrupt checkpoint would make wrong. RestartPolicy
// (daemon/restart_policy.h) decides the back-off, and when retrying cannot
// help and the job fails.
//
// Every transition is an event in run_dir/events.jsonl. Nothing here
// blocks: ranks are seen through their exit statuses (fed in by keeld's
// SIGCHLD handler) and their progress boards (read on poll()).
#pragma once

#include "common/config.h"
#include "common/store.h"
#include "daemon/job_views.h"
#include "daemon/restart_policy.h"
#include "daemon/run_history.h"
#include "health/progress_board.h"

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include <nlohmann/json.hpp>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace keel::daemon {

struct JobOptions {
  common::Config config;
  std::filesystem::path config_path;       // passed to the ranks, with the overrides
  std::vector<std::string> overrides;
  std::filesystem::path trainer;           // keel-trainer
  std::string store_address;               // KEEL_STORE for the ranks
  std::string store_secret;                // KEEL_STORE_SECRET for the ranks
  // keeld's own client of that Store (nullptr: none): a rank's failure is
  // written there so the survivors stop waiting for it (common::rank_failed_key).
  common::Store* store = nullptr;
};

class Job {
 public:
  // `on_end` is called once the job has ended for good (finished, failed or
  // stopped), with the state it ended in and whether a stop was asked for
  // (a stop whose final checkpoint was not saved ends failed). A job that
  // finished or failed can still be restarted by restart().
  Job(boost::asio::io_context& io, JobOptions options, std::function<void(JobState, bool stop_requested)> on_end);
  ~Job();
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  // Starts the first generation: one past the newest generation in
  // events.jsonl, so a restarted keeld continues the run's history.
  void start();

  // A child of keeld exited (raw waitpid status). False when it was not a rank.
  bool on_child_exit(pid_t pid, int wait_status);
  // Reads the boards; called from keeld's timer a few times a second.
  void poll();

  // Control requests; each returns the reply for keelctl.
  nlohmann::json checkpoint_now();
  nlohmann::json stop(bool checkpoint, const std::string& by);
  nlohmann::json restart(const std::string& by);

  JobState state() const { return state_; }
  // The job's figures, for the views (daemon/job_views.h).
  JobReport report() const;

 private:
  struct Rank : RankReport {
    std::optional<health::ProgressBoard> board;
  };
  enum class AfterStop { kEnd, kRestart };

  void start_generation();
  void on_rank_exit(Rank& rank, int code);
  // "rank 1 exited 3 (data_error): <the rank's own sentence, from its log>".
  std::string rank_failure(const Rank& rank, int code) const;
  void generation_over();
  void stop_ranks(int signal, double grace_s);
  void kill_ranks(int signal);
  bool ranks_alive() const;
  void end(JobState state);
  void remove_boards();
  void remove_orphaned_boards();
  // Once rank 0's board names the step this generation resumed from:
  // records it (generation_resumed), once per generation.
  void note_resume();
  // The newest checkpoint known good: the one the ranks resumed from, or a
  // newer one they committed since (events.jsonl); -1 when there is none.
  int64_t checkpoint_step() const;
  void event(const std::string& kind, nlohmann::json fields = nlohmann::json::object()) const;
  // Steps done by the job as a whole, from rank 0's board.
  int64_t steps_done() const;

  boost::asio::io_context& io_;
  JobOptions options_;
  std::function<void(JobState, bool)> on_end_;
  std::filesystem::path run_dir_;
  JobState state_ = JobState::kStarting;
  int64_t generation_ = 0;
  int64_t restarts_ = 0;
  RestartPolicy restart_policy_;
  RunHistory history_;
  // The newest checkpoint known good before this generation's own commits:
  // the history's newest at start, then each generation's resume step.
  int64_t base_checkpoint_ = -1;
  bool resumed_ = false;                  // this generation's resume step is known
  std::vector<Rank> ranks_;
  std::vector<std::vector<int>> cpus_;   // per rank; empty: pin_cpus is off
  size_t threads_per_rank_ = 1;
  std::string failure_;                   // why the generation (or the job) failed
  int failure_code_ = -1;                 // the exit code of the failure's rank
  std::string final_save_failure_;        // the first rank that exited 13 during a stop; empty: none did
  bool stop_requested_ = false;
  std::optional<AfterStop> after_stop_;
  bool stop_checkpoint_ = true;
  boost::asio::steady_timer kill_timer_;
  boost::asio::steady_timer restart_timer_;
  std::chrono::steady_clock::time_point started_at_;
  std::chrono::steady_clock::time_point generation_started_at_;
  std::chrono::steady_clock::time_point last_progress_log_;
};

}  // namespace keel::daemon
