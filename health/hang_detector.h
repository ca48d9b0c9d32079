// The hang detector (docs/architecture.md "Health": hangs). Fed every poll
// of the boards, it learns how long each process group's collectives and
// each phase take, and says when a rank has waited in a collective longer
// than anything explains, naming who is missing.
//
// Budgets. During the first `hang_warmup_steps` steps (of rank 0's board)
// it only observes; every budget is hang_timeout_ceiling_s. After that a
// group's budget is hang_timeout_multiple x the 99th percentile of its
// observed collective durations, and a phase's budget the same of that
// phase's observed durations (phase_last_ms), both clamped to
// [hang_timeout_floor_s, hang_timeout_ceiling_s]; a phase never seen keeps
// the ceiling. Durations are learned per group *kind* (the axis, "dp" of
// "g3.dp.0"), so a restarted generation, whose group names change, keeps
// what was learned.
//
// Verdict. A collective (group G, sequence N) on which some member has been
// in flight longer than G's budget is a hang unless a member that has not
// begun N is still explained: its heartbeat is live and it has been in its
// current phase no longer than that phase's budget (a slow checkpoint,
// validation or data load is a phase, never a hang). The culprits are the
// members that never began N, plus every member whose heartbeat is older
// than heartbeat_timeout_s (frozen: SIGSTOP, a dead node); the waiting ranks
// are those in flight at N. When every member began N and none is frozen,
// nobody can be named from the boards: the finding has no culprit and says
// so. A finding is made once per (group, sequence number).
#pragma once

#include "common/config.h"
#include "health/rank_sample.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace keel::health {

struct HangFinding {
  std::vector<int> culprit_ranks;  // ascending
  std::vector<int> waiting_ranks;  // ascending: in flight at seq
  std::vector<int> frozen_ranks;   // ascending: heartbeat older than heartbeat_timeout_s (also culprits)
  std::string group;               // "g0.dp.0"
  int64_t seq = -1;
  std::string op;                  // of the waiting ranks' collective
  double detect_s = 0;             // from the oldest waiting rank's begin to the verdict
  double budget_s = 0;             // the group's budget that was exceeded
  std::string reason;              // one sentence for the log and keelctl diagnose

  // {"culprit_ranks", "group", "seq", "op", "waiting_ranks", "frozen_ranks",
  //  "detect_s", "budget_s", "reason"}: the fields of the hang_detected event.
  nlohmann::json to_json() const;
};

class HangDetector {
 public:
  explicit HangDetector(const common::HealthConfig& config);

  // Learns from `samples` and returns the hangs found at `now_ns` that were
  // not found before.
  std::vector<HangFinding> observe(const RankSamples& samples, int64_t now_ns);

  // The budget in force for group kind `kind` ("dp") and for `phase`.
  double group_budget_s(const std::string& kind) const;
  double phase_budget_s(Phase phase) const;
  bool warmed_up() const { return warmed_up_; }

  // {"warmed_up", "groups": {kind: budget_s}, "phases": {name: budget_s}}.
  nlohmann::json budgets_json() const;

 private:
  common::HealthConfig config_;
  bool warmed_up_ = false;
  // ... (the implementation's state)
};

}  // namespace keel::health
