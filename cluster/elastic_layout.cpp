#include "cluster/elastic_layout.h"

#include <fmt/format.h>

#include "common/layout_check.h"

namespace keel::cluster {

std::vector<std::string> NodeLayout::overrides() const {
  return {fmt::format("parallel.dp={}", dp), fmt::format("parallel.micro_batches={}", micro_batches)};
}

LayoutFit layout_on_nodes(const common::Config& config, int64_t nodes) {
  const auto& p = config.parallel;
  const int64_t per_node = config.node_ranks();
  const int64_t world = nodes * per_node;
  const int64_t model_ranks = p.tp * p.cp * p.pp;
  if (nodes < 1) return {std::nullopt, "a job needs at least one node"};
  if (world % model_ranks != 0) {
    return {std::nullopt, fmt::format("{} nodes of {} ranks are {} ranks, not a multiple of tp x cp x pp = {}", nodes,
                                      per_node, world, model_ranks)};
  }
  const int64_t dp = world / model_ranks;
  const int64_t batch = config.train.batch_size;
  // Sequences per microbatch and DP rank in the full layout: the memory a
  // rank was sized for.
  const int64_t sequences = batch / (p.dp * p.micro_batches);
  std::string last_problem = fmt::format("batch_size={} cannot be split over dp={}", batch, dp);
  for (int64_t m = std::max<int64_t>(1, (batch + dp * sequences - 1) / (dp * sequences)); dp * m <= batch; ++m) {
    if (batch % (dp * m) != 0) continue;
    common::Config candidate = config;
    candidate.parallel.dp = dp;
    candidate.parallel.micro_batches = m;
    const auto problems = common::layout_problems(candidate, world);
    if (problems.empty()) return {NodeLayout{dp, m}, ""};
    last_problem = problems.front();
  }
  return {std::nullopt, fmt::format("on {} nodes (dp={}): {}", nodes, dp, last_problem)};
}

}  // namespace keel::cluster
