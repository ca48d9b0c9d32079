// What keeld shows of its job (docs/architecture.md "Daemon"): the status
// reply keelctl prints, the one-line STATUS= systemd shows, the progress
// line of keeld's log, the Prometheus page and the event log. Each is
// rendered from a JobReport, a plain copy of the job's figures taken at
// `now_ns`: the views are pure functions of it, they neither read a clock
// nor know how the job runs its ranks.
#pragma once

#include "daemon/health_monitor.h"
#include "daemon/job_state.h"
#include "daemon/run_history.h"
#include "daemon/snapshot_buddy.h"
#include "health/progress_board.h"

#include <nlohmann/json.hpp>
#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace keel::daemon {

struct RankReport {
  int rank = 0;
  pid_t pid = -1;                             // -1: not started
  std::optional<int> exit_code;               // 128 + signal when killed
  std::optional<health::BoardSnapshot> last;  // the newest board read
  int64_t heartbeat_ns = 0;                   // the board's heartbeat; 0: never beaten
  RankHealth verdict;                         // the detectors' verdict on it (daemon/health_monitor.h)
  double straggler_score = 0;                 // its newest straggler window score
};

// This node's place in a job of many nodes (docs/architecture.md
// "Multi-node on etcd").
// One node of the generation, as this node knows it.
struct NodeReport {
  std::string name;
  std::string address;  // its [cluster] address; "" where unknown
  int first_rank = 0;
  int ranks = 0;
  // Its worst rank's verdict, "rank 4 hung", or "ok"; "not heard from"
  // while no summary of this generation's boards came from it.
  std::string health;
  std::optional<double> heard_s;  // age of what this node last heard of it; nullopt: nothing (0 for itself)
};

struct ClusterReport {
  std::string node;                // this node's name
  int node_rank = -1;              // in the generation last joined; -1: none yet
  std::vector<NodeReport> members; // that generation's nodes, node rank order, with what is known of each
  int world = 0;                   // its ranks, every node's
  int first_rank = 0;              // this node's first global rank
  std::vector<std::string> cross_node_axes;  // the axes whose groups span nodes (cluster/placement.h)
  std::optional<double> etcd_unreachable_s;  // how long keeld's renewals have failed to reach etcd; nullopt: they reach it
};

// The in-memory snapshots of one step on this node (docs/architecture.md
// "In-memory snapshots"): how many of its ranks hold one, and their bytes.
struct SnapshotRow {
  int64_t step = 0;
  int ranks = 0;
  uint64_t bytes = 0;
};

// The buddy copy on this node (daemon/snapshot_buddy.h): the copies it
// holds of the node before it, and what the node after it accepted.
struct BuddyReport {
  std::vector<HeldCopy> held;
  std::vector<SentCopy> sent;
  std::optional<CopyFailure> failing;  // a copy step not held yet
};

struct JobReport {
  int64_t now_ns = 0;            // when the report was taken (common/clock.h): ages are counted to it
  std::string job;
  JobState state = JobState::kStarting;
  int64_t generation = 0;
  int64_t restarts = 0;
  int64_t step = 0;              // steps done, counted from the run's start
  int64_t total_steps = 0;
  int64_t checkpoint_step = -1;  // the newest good checkpoint (daemon/job.h); -1: none
  std::string reason;            // why the generation or the job failed; empty otherwise
  std::filesystem::path run_dir;
  std::filesystem::path checkpoint_dir;
  double uptime_s = 0;
  double stale_after_s = 0;      // a board older than this makes its rank "stale"
  DetectionCounts detections;    // the detectors' findings so far
  // Records, no alarms: the run's reproducible loss spikes and the steps
  // whose update was skipped (health.spike_policy), from events.jsonl.
  StepTally loss_spikes;
  StepTally skipped_steps;
  std::vector<RankReport> ranks; // rank 0 first (this node's first)
  std::vector<SnapshotRow> snapshots;  // newest first; empty when snapshots are off
  std::optional<BuddyReport> buddy;    // nullopt: no buddy copy (one node, or snapshots off)
  std::optional<ClusterReport> cluster;  // nullopt: one node
};

// The reply to keelctl status (without the socket and metrics fields, which
// belong to keeld rather than the job).
nlohmann::json status_json(const JobReport& report);
// systemd's STATUS=: job, state, step, loss, health (the reason once failed).
std::string status_line(const JobReport& report);
// keeld's periodic log line: step, loss, tokens/s, ETA; empty before rank 0
// has published.
std::string progress_line(const JobReport& report);
// The Prometheus text exposition of the job's figures.
std::string metrics_text(const JobReport& report);

// The reply to keelctl events: the newest `limit` events of the run
// directory's events.jsonl, oldest first; lines that do not parse are left out.
nlohmann::json newest_events(const std::filesystem::path& run_dir, int64_t limit);

}  // namespace keel::daemon
