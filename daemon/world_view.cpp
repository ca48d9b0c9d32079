#include "daemon/world_view.h"

namespace keel::daemon {
namespace {

// The ranks of node `node_rank`, unknown.
void add_unknown(health::RankSamples& out, int first_rank, int ranks) {
  for (int r = first_rank; r < first_rank + ranks; ++r) {
    health::RankSample s;
    s.rank = r;
    s.known = false;
    out.push_back(s);
  }
}

// Whether `summary` holds, in order, the ranks of a node whose first is `first_rank`.
bool of_ranks(const health::NodeSummary& summary, int first_rank, int ranks) {
  if (static_cast<int>(summary.ranks.size()) != ranks) return false;
  for (int i = 0; i < ranks; ++i) {
    if (summary.ranks[static_cast<size_t>(i)].rank != first_rank + i) return false;
  }
  return true;
}

}  // namespace

health::RankSamples world_samples(const health::RankSamples& own, const cluster::Membership& membership,
                                  const RemoteSummaries& remote, int64_t now_ns, int64_t stale_after_ns) {
  const int per_node = membership.ranks_per_node;
  health::RankSamples out;
  out.reserve(static_cast<size_t>(membership.world_size()));
  for (int n = 0; n < static_cast<int>(membership.nodes.size()); ++n) {
    const int first = n * per_node;
    if (n == membership.node_rank) {
      out.insert(out.end(), own.begin(), own.end());
      add_unknown(out, first + static_cast<int>(own.size()), per_node - static_cast<int>(own.size()));
      continue;
    }
    const auto heard = remote.find(membership.nodes[static_cast<size_t>(n)]);
    const health::NodeSummary* summary = heard == remote.end() ? nullptr : heard->second.get();
    if (summary == nullptr || summary->generation != membership.generation ||
        now_ns - summary->as_of_ns > stale_after_ns || !of_ranks(*summary, first, per_node)) {
      add_unknown(out, first, per_node);
      continue;
    }
    for (health::RankSample s : summary->ranks) {
      health::shift_times(s, now_ns - summary->as_of_ns);
      out.push_back(std::move(s));
    }
  }
  return out;
}

}  // namespace keel::daemon
