// Replica digest comparison (docs/architecture.md "Health": SDC method a).
// Every sdc_digest_every steps each rank publishes on its board an XXH3 of
// the bytes every rank of its replica set must hold identically (DP replicas
// of its parameters; the set is an opaque id the rank computes from its
// coordinates and the layout). Once every running rank of a set has
// published the digest of the same step, a strict majority of equal digests
// names each rank that differs. Without a strict majority (two replicas
// that disagree, or a tie) nobody is named: the finding says which ranks
// disagree and that the rerun and the known-answer test decide. A rank that
// differs once differs from then on (its state is corrupted): it is
// reported once, at the first step it was seen to differ.
#pragma once

#include "health/rank_sample.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace keel::health {

struct DigestFinding {
  int64_t step = -1;             // the steps done when the digests were taken
  std::vector<int> odd_ranks;    // named by a majority; empty when there is none
  std::vector<int> disagreeing;  // every rank of the set when there is no majority
  size_t replicas = 0;           // ranks in the set
  // The fields of the sdc_detected event for one odd rank:
  // {"rank", "step", "method": "replica_digest", "verdict": "persistent", "replicas"}.
  nlohmann::json event_for(int rank) const;
};

class ReplicaDigests {
 public:
  std::vector<DigestFinding> observe(const RankSamples& samples, int64_t now_ns);
  // Digest comparisons made so far (every set and step compared once).
  uint64_t comparisons() const { return comparisons_; }

 private:
  uint64_t comparisons_ = 0;
  // ... (the implementation's state)
};

}  // namespace keel::health
