#include "health/replica_digests.h"

#include <algorithm>

namespace keel::health {

nlohmann::json DigestFinding::event_for(int rank) const {
  return {{"rank", rank},
          {"step", step},
          {"method", "replica_digest"},
          {"verdict", "persistent"},
          {"replicas", replicas},
          {"last_agreed_step", last_agreed_step}};
}

std::vector<DigestFinding> ReplicaDigests::observe(const RankSamples& samples, int64_t /*now_ns*/) {
  // Only step numbers order the evidence, never the time: a clock that
  // jumps changes nothing here.
  std::vector<Published> ranks;
  // (generation, set) -> the steps some rank published and not compared yet.
  std::map<std::pair<int64_t, uint64_t>, std::set<int64_t>> open;
  for (const RankSample& sample : samples) {
    // An exited rank's digests still vote: at the end of a run the ranks
    // exit one by one, and a poll between two exits must not compare the
    // last step without the replicas already gone.
    const BoardSnapshot* board = published_board(sample);
    if (board == nullptr) continue;
    Published& p = ranks.emplace_back();
    p.rank = sample.rank;
    p.running = sample.running;
    p.generation = board->generation;
    p.steps_done = board->steps_done;
    for (const ReplicaDigest& d : board->digests) {
      if (d.step < 0) continue;
      p.sets[d.replica_set].emplace(d.step, d.digest);
      const auto key = std::pair{p.generation, d.replica_set};
      const auto done = done_through_.find(key);
      if (done == done_through_.end() || d.step > done->second) open[key].insert(d.step);
    }
  }

  std::vector<DigestFinding> found;
  std::map<int, uint64_t> digests;
  for (const auto& [key, steps] : open) {
    const auto [generation, set] = key;
    for (int64_t step : steps) {
      const Outcome outcome = gather(ranks, generation, set, step, digests);
      if (outcome == Outcome::kWait) break;
      done_through_[key] = step;
      if (outcome == Outcome::kCompare && digests.size() >= 2) compare(set, step, digests, found);
    }
  }
  // Forget the sets no ring holds any more (a restarted generation's are
  // new keys), so garbage boards cannot grow this without bound.
  std::erase_if(done_through_, [&](const auto& entry) {
    const auto [generation, set] = entry.first;
    return std::none_of(ranks.begin(), ranks.end(),
                        [&](const Published& p) { return p.generation == generation && p.sets.contains(set); });
  });
  return found;
}

ReplicaDigests::Outcome ReplicaDigests::gather(const std::vector<Published>& ranks, int64_t generation, uint64_t set,
                                               int64_t step, std::map<int, uint64_t>& digests) {
  digests.clear();
  Outcome outcome = Outcome::kCompare;
  for (const Published& p : ranks) {
    if (p.generation != generation) continue;
    const auto own = p.sets.find(set);
    const bool member = own != p.sets.end();
    if (member) {
      const auto it = own->second.find(step);
      if (it != own->second.end()) {
        digests.emplace(p.rank, it->second);
        continue;
      }
    }
    // Without this step's digest: a member that has a newer one lost it;
    // any running rank that has not finished the step may still publish it
    // (its first digest, or a second set's); an exited one publishes
    // nothing more, so it holds nothing back.
    if (member && own->second.rbegin()->first > step) {
      outcome = Outcome::kSkip;
    } else if (!p.running) {
      continue;
    } else if (p.steps_done <= step) {
      return Outcome::kWait;
    } else if (member) {
      outcome = Outcome::kSkip;
    }
  }
  return outcome;
}

void ReplicaDigests::compare(uint64_t set, int64_t step, const std::map<int, uint64_t>& digests,
                             std::vector<DigestFinding>& found) {
  ++comparisons_;
  std::map<uint64_t, size_t> counts;
  for (const auto& [rank, digest] : digests) ++counts[digest];
  const auto [majority, votes] = *std::max_element(
      counts.begin(), counts.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  DigestFinding finding;
  finding.step = step;
  finding.replicas = digests.size();
  int64_t& last_agreed = last_agreed_.try_emplace(set, -1).first->second;

  if (2 * votes <= digests.size()) {
    finding.last_agreed_step = last_agreed;
    for (const auto& entry : digests) finding.disagreeing.push_back(entry.first);
    if (reported_split_.insert(set).second) found.push_back(std::move(finding));
    return;
  }
  reported_split_.erase(set);
  if (votes == digests.size()) last_agreed = std::max(last_agreed, step);
  finding.last_agreed_step = last_agreed;
  for (const auto& [rank, digest] : digests) {
    if (digest == majority) {
      reported_odd_.erase(rank);
    } else if (reported_odd_.insert(rank).second) {
      finding.odd_ranks.push_back(rank);
    }
  }
  if (!finding.odd_ranks.empty()) found.push_back(std::move(finding));
}

}  // namespace keel::health
