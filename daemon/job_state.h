// The job's state machine (docs/architecture.md "Daemon"), as pure
// transitions: each input (a rank exited, the generation is over, an
// operator asked for a stop, a detector's verdict, time passed) moves the
// state and returns the actions the job must carry out. No processes, no
// files, no clock: the caller passes the time in, so a unit test drives
// every transition with plain values.
//
//   starting ──▶ running ──▶ finished          every rank exited 0
//       │           │
//       │           ├──▶ restarting ──▶ starting (generation + 1, after back-off)
//       │           │        └────────▶ failed (crash loop, or a rank refused the config or data)
//       └───────────┴──▶ stopping ──▶ stopped (keeld exits 0)
//                              ├────▶ failed (a rank exited 13: the final checkpoint was not saved)
//                              └────▶ starting (keelctl restart)
//
// A rank that exits non-zero (or is killed) fails its generation: its
// sentence is the cause, the other ranks get SIGTERM and SIGKILL after
// grace_s. A detector's verdict (a hang, a corrupted rank) fails the
// generation the same way, except that the ranks are killed at once: a
// hung generation cannot save, and a corrupted one must not. RestartPolicy
// (daemon/restart_policy.h) decides the back-off, and when retrying cannot
// help and the job fails.
#pragma once

#include "common/config.h"
#include "daemon/restart_policy.h"

#include <nlohmann/json.hpp>
#include <spdlog/common.h>
#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace keel::daemon {

enum class JobState { kStarting, kRunning, kRestarting, kStopping, kFinished, kFailed, kStopped };
const char* job_state_name(JobState state);

// One thing the job must do. Actions are carried out in order; a
// kStartGeneration is always the last of its list.
struct JobAction {
  enum class Kind {
    kStartGeneration,  // spawn every rank of `generation`, each with a fresh board
    kSignal,           // send `signal` to every live rank
    kTerminate,        // SIGTERM every live rank, SIGKILL those still alive `grace_s` later
    kTellRanks,        // write `text` as `generation`'s rank_failed record in the Store, with `nodes` on many nodes
    kRecord,           // append event `text` of `generation` with `fields` to events.jsonl
    kLog,              // log `text` at `level`
    kEnd,              // the job has ended for good in `state`; `stop_requested`: someone asked for it
  };
  Kind kind = Kind::kLog;
  int64_t generation = 0;
  int signal = 0;
  double grace_s = 0;
  std::string text;
  // kTellRanks on many nodes: the nodes whose ranks a verdict named
  // (cluster::GenerationFailure::culprit_nodes).
  std::vector<std::string> nodes;
  nlohmann::json fields = nlohmann::json::object();
  spdlog::level::level_enum level = spdlog::level::info;
  JobState state = JobState::kStarting;
  bool stop_requested = false;
};
using JobActions = std::vector<JobAction>;

// A rank's process ended, as the job saw it.
struct RankExit {
  int rank = 0;
  pid_t pid = -1;
  int code = 0;          // exit status, 128 + signal when killed
  int64_t step = -1;     // steps done by its last board; -1: it never published
  std::string cause;     // "rank 1 exited 3 (data_error): <its own sentence>"
};

// What a generation left behind once none of its ranks runs any more.
struct GenerationOutcome {
  std::vector<int> exit_codes;    // per rank; -1 for one never started
  bool progressed = false;        // it committed a checkpoint of its own
  int64_t checkpoint_step = -1;   // the newest good checkpoint now; -1: none
  std::string abandoned_cause;    // why rank 0 abandoned its last save, if it did
  int64_t steps_done = 0;         // the job's steps, from rank 0's board
};

// A transition's actions and, for an operator's request, the reply.
struct Transition {
  JobActions actions;
  nlohmann::json reply;  // null unless the input was a request
};

class JobMachine {
 public:
  JobMachine(std::string job_name, const common::DaemonConfig& daemon);

  JobState state() const { return state_; }
  int64_t generation() const { return generation_; }
  int64_t restarts() const { return restarts_; }
  // Why the generation or the job failed; empty otherwise.
  const std::string& reason() const { return failure_; }
  // Whether the ranks of the current generation may still be running.
  bool generation_live() const { return generation_live_; }

  // The first generation.
  Transition start(int64_t first_generation);
  // Every rank of the generation has published past init.
  Transition ranks_up();
  // A rank's process ended. When it was the last one running, the caller
  // then reports generation_over().
  Transition rank_exited(const RankExit& exit);
  // No rank of the generation runs any more.
  Transition generation_over(const GenerationOutcome& outcome, int64_t now_ns);
  // A detector found the running generation broken: `cause` fails it and
  // the ranks are killed at once. On many nodes `culprit_nodes` run the
  // ranks it names. Ignored unless the generation is starting or running
  // (it is already being stopped otherwise).
  Transition verdict(const std::string& cause, std::vector<std::string> culprit_nodes = {});
  // On many nodes: the generation being started got its number from the
  // rendezvous, which numbers the job's generations for every node.
  void joined(int64_t generation);
  // On many nodes: another node ended the generation (its rank failed, or
  // it left the job). `cause` fails this node's part of it; the ranks get
  // SIGTERM and grace_s to finish what they can (a commit under way on
  // rank 0), then SIGKILL. When it was a verdict that named ranks of this
  // node (`named_here`), they are killed at once, as the verdict's own node
  // kills them: a hung rank ignores SIGTERM, and waiting out its grace would
  // keep this node from the next generation's rendezvous. Ignored unless
  // the generation is starting or running.
  Transition ended_elsewhere(const std::string& cause, bool named_here = false);
  // On many nodes: the rendezvous sealed no generation with this node
  // (too few nodes came, or etcd is out of reach). No rank ran, so nothing
  // crashed: the next join follows after restart_backoff_s, and however
  // often it fails it never counts toward a crash loop. Ignored unless the
  // generation is starting.
  Transition join_failed(const std::string& cause, int64_t now_ns);
  // On many nodes: the job finished on the other nodes while this one was
  // away (`where` says on which, for the record). It ends finished, with
  // the newest checkpoint `checkpoint_step`. Ignored unless the generation
  // is starting.
  Transition finished_elsewhere(const std::string& where, int64_t checkpoint_step);
  // Time passed: starts the next generation once its back-off is over.
  Transition tick(int64_t now_ns);
  // keelctl stop, SIGTERM, SIGINT. `checkpoint_step`: the newest good
  // checkpoint, for the event when nothing is left to stop.
  Transition stop(bool checkpoint, const std::string& by, int64_t checkpoint_step);
  // keelctl restart.
  Transition restart(const std::string& by);

 private:
  Transition start_generation();
  // Fails the starting or running generation for `cause`, which no rank's
  // exit gave: logs `said`, appends `records`, tells the ranks and ends
  // them with `stop`. Nothing otherwise.
  Transition fail_live_generation(const std::string& cause, std::string said, JobActions records, JobAction stop,
                                  std::vector<std::string> culprit_nodes = {});
  void end(JobState state, JobActions& actions);
  JobAction record(const std::string& kind, nlohmann::json fields = nlohmann::json::object()) const;

  std::string job_name_;
  double grace_s_;
  double stop_timeout_s_;
  double restart_backoff_s_;
  RestartPolicy restart_policy_;
  JobState state_ = JobState::kStarting;
  int64_t generation_ = 0;
  int64_t restarts_ = 0;
  bool generation_live_ = false;
  std::string failure_;             // why the generation (or the job) failed
  int failure_code_ = -1;           // the exit code of the failure's rank; -1: a verdict
  std::string final_save_failure_;  // the first rank that exited 13 during a stop; empty: none did
  bool stop_requested_ = false;
  enum class AfterStop { kEnd, kRestart };
  std::optional<AfterStop> after_stop_;
  bool stop_checkpoint_ = true;
  std::optional<int64_t> restart_at_ns_;  // when the next generation starts
};

}  // namespace keel::daemon
