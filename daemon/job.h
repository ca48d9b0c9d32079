// The job keeld runs (docs/architecture.md "Daemon"): one generation of
// local ranks at a time, supervised from keeld's event loop. This is the
// glue between parts that each do one thing: the state machine
// (daemon/job_state.h) decides, the rank set (daemon/rank_set.h) runs the
// processes, the health monitor (daemon/health_monitor.h) runs the
// detectors on every poll of the boards, the health policy
// (daemon/health_policy.h) says what to do about their verdicts, and the
// views (daemon/job_views.h) render a JobReport.
//
// The ranks pick the checkpoint they resume from themselves (the newest
// that loads), and keeld reports their choice (rank 0's board names the
// step) rather than guessing from directory names, which a corrupt
// checkpoint would make wrong.
//
// Every transition is an event in run_dir/events.jsonl. Nothing here
// blocks: ranks are seen through their exit statuses (fed in by keeld's
// SIGCHLD handler) and their progress boards (read on poll()), and every
// timeout (the grace before SIGKILL, the back-off before a restart) is a
// time on the Clock that poll() compares.
#pragma once

#include "cluster/rendezvous.h"
#include "common/clock.h"
#include "common/config.h"
#include "store/store.h"
#include "daemon/cluster_link.h"
#include "daemon/health_exchange.h"
#include "daemon/fault_request.h"
#include "daemon/health_monitor.h"
#include "daemon/job_state.h"
#include "daemon/job_views.h"
#include "daemon/rank_set.h"
#include "daemon/run_history.h"
#include "daemon/snapshot_buddy.h"

#include <nlohmann/json.hpp>
#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace keel::daemon {

struct HealthResponse;

// The keel-trainer a job runs: daemon.trainer, or the one installed beside
// the running program (keeld, keelctl). Error(kBadConfig) naming both ways
// when it is not an executable file.
std::filesystem::path job_trainer(const common::Config& config);

struct JobOptions {
  common::Config config;
  std::filesystem::path config_path;       // passed to the ranks, with the overrides
  std::vector<std::string> overrides;
  std::filesystem::path trainer;           // keel-trainer
  std::string store_address;               // KEEL_STORE for the ranks
  std::string store_secret;                // KEEL_STORE_SECRET for the ranks
  // keeld's own client of that Store (nullptr: none): a rank's failure is
  // written there so the survivors stop waiting for it (store::rank_failed_key).
  store::Store* store = nullptr;
  // Each rank's GPU (gpu_assignment.h) when train.device = "cuda".
  std::vector<std::string> gpus;
  // On many nodes (config.multi_node()): the rendezvous, which numbers the
  // generations and places this node's ranks in each; a failure here is
  // told through it (with the ranks' rank_failed record), so `store` is
  // not used. nullptr: one node.
  ClusterLink* cluster = nullptr;
  // On many nodes: the other nodes' boards, for detectors that see the
  // whole world (daemon/world_view.h). nullptr: this node's ranks only.
  HealthExchange* health_exchange = nullptr;
  // On many nodes with in-memory snapshots: the buddy copy, which the job
  // points at the next node each generation and fills this node's areas
  // from before its ranks start. nullptr: none.
  SnapshotBuddy* buddy = nullptr;
};

class Job {
 public:
  // `on_end` is called once the job has ended for good (finished, failed or
  // stopped), with the state it ended in and whether a stop was asked for
  // (a stop whose final checkpoint was not saved ends failed). A job that
  // finished or failed can still be restarted by restart().
  Job(JobOptions options, std::function<void(JobState, bool stop_requested)> on_end,
      const common::Clock& clock = common::Clock::steady());
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  // Starts the first generation: one past the newest generation in
  // events.jsonl, so a restarted keeld continues the run's history.
  void start();

  // A child of keeld exited (raw waitpid status). False when it was not a rank.
  bool on_child_exit(pid_t pid, int wait_status);
  // Reads the boards and acts on the time; called from keeld's timer a few
  // times a second.
  void poll();

  // Control requests; each returns the reply for keelctl.
  nlohmann::json checkpoint_now();
  nlohmann::json stop(bool checkpoint, const std::string& by);
  nlohmann::json restart(const std::string& by);
  // keelctl health: every rank's verdict with its reason, the detections so far, and the
  // records that are no alarms (loss spikes, skipped steps).
  nlohmann::json health() const;
  // keelctl diagnose: the last hang verdict and every rank's collectives at
  // that moment (the flight dump's records); without a verdict yet, the
  // ranks' collectives now.
  nlohmann::json diagnose() const;
  // keelctl stragglers: StragglerMonitor::report().
  nlohmann::json stragglers() const;
  // keelctl inject: writes the fault to the rank's board (the rank takes it
  // at its next step boundary) and records fault_injected.
  nlohmann::json inject(const FaultSpec& fault, const std::string& by);

  // On many nodes, from the ClusterLink's callbacks on keeld's loop: a
  // generation's membership came (this node's ranks start), or no
  // membership could be had (the generation fails as if a rank had), or
  // something ends the generation or asks it to grow.
  void on_joined(const cluster::Membership& membership);
  void on_join_failed(const std::string& why);
  void on_cluster_event(int64_t generation, const cluster::GenerationEvent& event);

  JobState state() const { return machine_.state(); }
  // The job's figures, for the views (daemon/job_views.h).
  JobReport report() const;

 private:
  // Carries out what the state machine decided.
  void apply(const JobActions& actions);
  void start_generation(int64_t generation);
  void spawn_generation(int64_t generation, const RankSlice& slice);
  // On many nodes: fetches the copies of the ranks whose areas lack their
  // state, then spawns (on_snapshots_fetched). False when there is nothing
  // to fetch: the caller spawns at once.
  bool fetch_snapshots(const cluster::Membership& membership, const RankSlice& slice);
  void on_snapshots_fetched(int64_t generation, const RankSlice& slice, const FetchedCopies& got);
  // Points the buddy copy at the node after this one in `membership`.
  void send_snapshots_on(const cluster::Membership& membership, const RankSlice& slice);
  // Once no rank runs: the generation's outcome goes to the state machine.
  void end_generation_if_over();
  // Takes in the boards and the events appended since the last look.
  void observe();
  // What the detectors take: every rank of the generation, on every node.
  health::RankSamples health_samples() const;
  // Every node of the generation joined, for keelctl status.
  std::vector<NodeReport> node_reports(int64_t now_ns) const;
  // Offers this node's boards to the other nodes' detectors.
  void publish_health() const;
  // Records the detectors' verdicts and does what the health policy says.
  void act_on(const Verdicts& verdicts);
  // On many nodes: each culprit's node in its event, and the culprits'
  // nodes in the cause every node records. Returns those nodes.
  std::vector<std::string> name_nodes(HealthResponse& response) const;
  // Every rank's group table and recent collectives as last read
  // (flight_dump.h): the flight dump and `keelctl diagnose`.
  std::vector<nlohmann::json> collective_records() const;
  // Moves aside the checkpoints a corrupted generation may have written
  // (after keep_through_step_), once its ranks are gone.
  void quarantine_suspect_checkpoints();
  // Once rank 0's board names the step this generation resumed from:
  // records it (generation_resumed), once per generation.
  void note_resume();
  // The newest checkpoint known good: the one the ranks resumed from, or a
  // newer one they committed since (events.jsonl); -1 when there is none.
  int64_t checkpoint_step() const;
  // The newest checkpoint committed in the checkpoint directory; -1: none.
  int64_t newest_in_catalog() const;
  // Steps done by the job as a whole, from rank 0's board.
  int64_t steps_done() const;
  void event(const std::string& kind, nlohmann::json fields = nlohmann::json::object()) const;

  JobOptions options_;
  std::function<void(JobState, bool)> on_end_;
  const common::Clock& clock_;
  std::filesystem::path run_dir_;
  JobMachine machine_;
  RankSet ranks_;
  RunHistory history_;
  HealthMonitor health_;
  // An SDC verdict's last step known good, until the generation is over.
  std::optional<int64_t> keep_through_step_;
  nlohmann::json diagnosis_;  // the last hang verdict's diagnose reply; null: none yet
  // The newest checkpoint known good before this generation's own commits:
  // the history's newest at start, then each generation's resume step.
  int64_t base_checkpoint_ = -1;
  bool resumed_ = false;  // this generation's resume step is known
  // On many nodes: the membership last joined, and whether a join is under way.
  std::optional<cluster::Membership> membership_;
  bool joining_ = false;
  // The generation whose ranks wait for their snapshots' copies (a join
  // goes on until they come), and what ended it meanwhile.
  std::optional<int64_t> fetching_for_;
  std::optional<cluster::GenerationEvent> ended_while_fetching_;
  std::string ended_cause_;  // why the last generation ended, for the rendezvous
  int64_t cause_recorded_for_ = -1;  // the last generation whose earlier cause (kEndedBefore) was recorded
  std::vector<std::string> cross_node_axes_;  // the membership's (cluster/placement.h)
  int64_t started_at_ns_ = 0;
  int64_t last_progress_log_ns_ = 0;
};

}  // namespace keel::daemon
