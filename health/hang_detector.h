// The hang detector (docs/architecture.md "Health": hangs). Fed every poll
// of the boards, it learns how long each process group's collectives and
// each phase take, and says when a rank has waited in a collective longer
// than anything explains, naming who is missing.
//
// Budgets. During the first `hang_warmup_steps` steps of a generation (of
// rank 0's board: steps_done - first_step) it learns nothing and every
// budget is hang_timeout_ceiling_s. After that a group's budget is
// hang_timeout_multiple x the 99th percentile of its observed collective
// durations (each member's done_ns - begin_ns of the collective it ended
// last), and a phase's budget the same of that phase's observed durations
// (phase_last_ms), both clamped to [hang_timeout_floor_s,
// hang_timeout_ceiling_s] (health/duration_budget.h); a group kind or phase
// seen fewer than 5 times keeps the ceiling. Durations are measured in
// watched time (below), so a clock jump is not learned as a slow
// collective or phase. They are learned per group *kind* (the axis, "dp"
// of "g3.dp.0"), so a restarted generation, whose group names change,
// keeps what was learned.
//
// Verdict. The members of group G are the ranks whose boards list G; G's
// size says how many there are, and a slot no board claims belongs to one
// of the ranks that list no group of G's kind (never published, or not yet
// joined). A collective (G, sequence N) on which some member has been in
// flight longer than G's budget is a hang unless a member that has not
// begun N is still explained:
//   * its heartbeat is live (heartbeat_timeout_s) and it has been in its
//     current phase no longer than that phase's budget (a slow checkpoint,
//     validation or data load is a phase, never a hang), or
//   * it waits in another collective that is not (yet) a hang itself, or
//   * its board is not trusted (below) and the others have waited no
//     longer than the ceiling.
// The culprits are the members that have not begun N and are not
// explained: those that never published their board, exited, are frozen
// (heartbeat older than heartbeat_timeout_s: SIGSTOP, a dead node) or
// stayed in one phase past its budget; a member that waits in another hung
// collective is not a culprit itself, the culprits of that collective are
// (so a hang in dp that blocks a tp peer names the same rank in both); a
// member whose board is not trusted is never named. Every frozen member is
// a culprit too, also one that began N. The waiting ranks are those in
// flight at N and not frozen. When no rank can be named (every member
// began N and none is frozen, or the missing one's board is not trusted)
// the finding has no culprit and says why, once the collective has
// stalled longer than the budget and than heartbeat_timeout_s since its
// last member began it (a member stopped inside it shows as frozen by
// then). A finding is made once per (group, sequence number).
//
// Untrusted input (health/rank_sample.h). A board is trusted only when
// every field the detector reads is sane: version, the rank it belongs to,
// phase, phase durations, times no later than now (and a heartbeat no
// later either), group names and ops NUL-terminated and printable, sizes
// and indices within the job, sequence numbers and states consistent. The
// rank of any other board is unknown: never named, never counted as
// waiting, and it may fill any slot of a group. A group whose members
// disagree on its size gets no verdict. Ages are measured in watched time
// (health/watched_time.h): a clock that jumps forward fires no timeout by
// itself; after one that goes back, boards written before the jump lie in
// the future and are not trusted until the clock catches up.
//
// Detection time. When the culprit was stuck before the others began
// waiting (a hang injected in a collective, a frozen rank, a rank that
// never published), detect_s is at most the longer of the group's budget
// and the culprit's phase budget plus keeld's poll interval: at most the
// ceiling plus a poll. A culprit that entered its phase after they began
// is found when it outstays that phase's budget.
#pragma once

#include "common/config.h"
#include "health/duration_budget.h"
#include "health/rank_sample.h"
#include "health/watched_time.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace keel::health {

struct HangFinding {
  std::vector<int> culprit_ranks;  // ascending
  std::vector<int> waiting_ranks;  // ascending: in flight at seq, not frozen
  std::vector<int> frozen_ranks;   // ascending: heartbeat older than heartbeat_timeout_s (also culprits)
  std::string group;               // "g0.dp.0"
  int64_t seq = -1;
  std::string op;                  // of the waiting ranks' collective
  double detect_s = 0;             // from the oldest waiting rank's begin to the verdict, in watched time
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
  // What the last trusted board of one rank showed, so that only what
  // advanced since is learned.
  struct Seen {
    bool known = false;
    int64_t generation = -1;
    int32_t pid = 0;
    uint32_t phase = 0;
    int64_t phase_start_ns = 0;
    int64_t update_ns = 0;
    uint32_t phase_count[kPhaseCount] = {};
    std::map<std::string, int64_t> seq_done;  // per group name
    bool trusted = true;                      // its board was, at the last observation
  };
  void check_warmup(const RankSamples& samples, const std::vector<bool>& trusted);
  void learn(const RankSamples& samples, const std::vector<bool>& trusted);

  common::HealthConfig config_;
  BudgetRule rule_;
  bool warmed_up_ = false;
  int64_t generation_ = -1;  // rank 0's, whose steps count the warm-up
  WatchedTime time_;
  std::map<std::string, DurationBudget> groups_;  // per group kind
  std::vector<DurationBudget> phases_;            // per Phase
  std::vector<Seen> seen_;                        // per rank
  std::set<std::pair<std::string, int64_t>> found_;  // (group, seq) of every finding made
};

}  // namespace keel::health
