// keeld's health monitor (docs/architecture.md "Daemon"): owns the
// detectors of health/ (hangs, stragglers, replica digests), feeds them the
// ranks' samples on every poll, turns each rank's own SDC report (rerun,
// known-answer test) into a finding, and keeps what an operator asks about:
// per rank healthy, straggler, suspect or hung with the reason, and how many
// of each kind were found. It decides nothing; the job acts on the verdicts
// (daemon/health_policy.h). Like the detectors it is fed samples and a time
// and does no I/O, so unit tests drive it with synthetic boards.
#pragma once

#include "common/config.h"
#include "health/hang_detector.h"
#include "health/rank_sample.h"
#include "health/replica_digests.h"
#include "health/straggler_monitor.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace keel::daemon {

// In rising order of severity: a rank shows the worst that holds.
enum class RankCondition { kHealthy, kStraggler, kSuspect, kHung };
const char* rank_condition_name(RankCondition condition);

struct RankHealth {
  RankCondition condition = RankCondition::kHealthy;
  std::string reason;  // one sentence; empty when healthy
};

// Findings so far, per kind (keel_detections_total).
struct DetectionCounts {
  uint64_t hang = 0;
  uint64_t sdc = 0;
  uint64_t straggler = 0;
};

// One SDC finding, whichever method made it.
struct SdcFinding {
  int rank = -1;                 // the rank at fault; -1: none could be named
  int64_t step = -1;             // steps done when it was found
  std::string method;            // "replica_digest" | "rerun" | "kat"
  std::string verdict;           // "transient" | "persistent"
  size_t replicas = 0;           // replica_digest: ranks in the set; 0 otherwise
  std::vector<int> disagreeing;  // replica_digest without a majority: every rank of the set
  // replica_digest: the newest step the set agreed on (-1: none), the
  // newest state known good; nothing for the other methods.
  std::optional<int64_t> last_good_step;

  // The sdc_detected event's fields: {"rank", "step", "method", "verdict"},
  // plus "replicas" and "last_good_step" for a digest, and "ranks" (the
  // disagreeing set) when nobody could be named.
  nlohmann::json event_fields() const;
};

struct Verdicts {
  std::vector<health::HangFinding> hangs;
  std::vector<SdcFinding> sdc;
  std::vector<health::StragglerFinding> stragglers;
  bool empty() const { return hangs.empty() && sdc.empty() && stragglers.empty(); }
};

class HealthMonitor {
 public:
  HealthMonitor(const common::HealthConfig& config, int world);

  // Feeds every detector and returns what was found now.
  Verdicts observe(const health::RankSamples& samples, int64_t now_ns);
  // The SDC findings in a generation's last boards, once every rank has
  // exited: digests and reports published between keeld's last poll and
  // the ranks' exit are evidence of what they computed, though no rank
  // runs any more (and so nothing can hang or straggle).
  Verdicts last_words(health::RankSamples samples, int64_t now_ns);
  // A new generation started, global rank r on node `placement[r]` ("" on
  // one node): its ranks hang no more, their memory was loaded again
  // (replica digests compare afresh) and their boards count SDC reports
  // from zero. What was learned of collective timings stays. Which ranks are
  // suspect and the straggler evidence stay while every rank number runs on
  // the node it ran on; when the placement changed (the job shrank or grew,
  // or another node took a place), a number means other hardware and
  // nothing learned of an old number applies.
  void new_generation(const std::vector<std::string>& placement);

  RankHealth rank(int rank) const;
  DetectionCounts counts() const { return counts_; }
  double straggler_score(int rank) const { return stragglers_.score(rank); }
  // The reply to `keelctl stragglers`, without "ok".
  nlohmann::json straggler_report() const { return stragglers_.report(); }
  // The reply to `keelctl health`, without "ok":
  // {"ranks": [{"rank", "health", "reason"}], "detections": {"hang", "sdc", "straggler"},
  //  "hang_budgets": HangDetector::budgets_json(), "sync_tax"}.
  nlohmann::json health_json() const;

 private:
  struct Flags {
    std::string hung, suspect, straggler;  // the reason of each that holds; empty: it does not
  };
  void take_sdc(const SdcFinding& finding, Verdicts& verdicts);
  void find_sdc(const health::RankSamples& samples, int64_t now_ns, Verdicts& verdicts);
  bool valid_rank(int rank) const { return rank >= 0 && rank < static_cast<int>(flags_.size()); }

  common::HealthConfig config_;
  health::HangDetector hangs_;
  health::StragglerMonitor stragglers_;
  std::optional<health::ReplicaDigests> digests_;  // one per generation
  std::vector<Flags> flags_;                       // per rank
  std::vector<uint64_t> sdc_reports_seen_;         // per rank: the board's SDC count taken in
  // (rank, step, method) of this generation's SDC findings: every rank may
  // report the same one.
  std::set<std::tuple<int, int64_t, std::string>> sdc_seen_;
  std::vector<std::string> placement_;  // of the current generation
  DetectionCounts counts_;
};

}  // namespace keel::daemon
