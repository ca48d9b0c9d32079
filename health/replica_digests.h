// Replica digest comparison (docs/architecture.md "Health": SDC method a).
// Every sdc_digest_every steps each rank publishes on its board an XXH3 of
// the bytes every rank of its replica set must hold identically (DP replicas
// of its parameters; the set is an opaque id the rank computes from its
// coordinates and the layout), before it finishes the next step. Once every
// running rank of a set has published the digest of the same step, a strict
// majority of equal digests names each rank that differs. Without a strict
// majority (two replicas that disagree, or a tie) nobody is named: the
// finding says which ranks disagree and that the rerun and the known-answer
// test decide. A rank that differs once differs from then on (its state is
// corrupted): it is reported once, at the first step it was seen to differ,
// and again only after it agreed in between (its state was restored). A
// disagreement without a majority is reported once per set the same way.
//
// Membership is read from the digests themselves: a rank belongs to the
// sets its ring holds digests of (in its board's generation). A rank that
// has finished the step without a digest of that set is no member; one that
// has not finished it yet is waited for. When a member's ring lost the
// step's digest (overwritten before it was read) that step is not compared:
// a corrupted rank still differs at the next one. Only ranks whose board is
// theirs (published_board, rank_sample.h) count, so a torn or garbage board
// neither joins a set it names by chance nor blocks the others for long. A
// rank that has exited still votes with the digests it published, but is
// never waited for.
#pragma once

#include "health/rank_sample.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

namespace keel::health {

struct DigestFinding {
  int64_t step = -1;             // the steps done when the digests were taken
  std::vector<int> odd_ranks;    // named by a majority; empty when there is none
  std::vector<int> disagreeing;  // every rank of the set when there is no majority
  size_t replicas = 0;           // ranks in the set
  // The newest step at which every rank of the set agreed (-1: never): the
  // state is known good there, so a rollback goes to a checkpoint at or
  // before it.
  int64_t last_agreed_step = -1;
  // The fields of the sdc_detected event for one odd rank:
  // {"rank", "step", "method": "replica_digest", "verdict": "persistent", "replicas",
  //  "last_agreed_step"}.
  nlohmann::json event_for(int rank) const;
};

class ReplicaDigests {
 public:
  std::vector<DigestFinding> observe(const RankSamples& samples, int64_t now_ns);
  // Digest comparisons made so far (every set and step compared once).
  uint64_t comparisons() const { return comparisons_; }

 private:
  // One rank's digests in its board's generation: set -> step -> digest.
  struct Published {
    int rank = -1;
    int64_t generation = 0;
    int64_t steps_done = 0;
    bool running = true;
    std::map<uint64_t, std::map<int64_t, uint64_t>> sets;
  };
  enum class Outcome { kWait, kSkip, kCompare };
  // Whether (generation, set, step) can be compared now, and by whom.
  static Outcome gather(const std::vector<Published>& ranks, int64_t generation, uint64_t set, int64_t step,
                        std::map<int, uint64_t>& digests);
  void compare(uint64_t set, int64_t step, const std::map<int, uint64_t>& digests, std::vector<DigestFinding>& found);

  uint64_t comparisons_ = 0;
  // (generation, set) -> the newest step compared or skipped.
  std::map<std::pair<int64_t, uint64_t>, int64_t> done_through_;
  std::map<uint64_t, int64_t> last_agreed_;  // set -> last_agreed_step
  std::set<int> reported_odd_;               // differing since they were reported
  std::set<uint64_t> reported_split_;        // sets without a majority since they were reported
};

}  // namespace keel::health
