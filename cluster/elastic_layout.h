// The layout a generation runs on the nodes it has (docs/architecture.md
// "Multi-node on etcd", "Elastic"). TP, CP, PP and EP stay as configured:
// they live inside nodes, or hold the model's stages. DP is what changes,
// dp = nodes x ranks per node / (tp x cp x pp), and the global batch stays
// the same through more gradient-accumulation microbatches, so that a run
// that lost a node trains on the same batches as the one that did not.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/config.h"

namespace keel::cluster {

struct NodeLayout {
  int64_t dp = 1;
  int64_t micro_batches = 1;
  // What keeld passes its ranks: --set parallel.dp=... and micro_batches.
  std::vector<std::string> overrides() const;
};

struct LayoutFit {
  std::optional<NodeLayout> layout;  // nullopt: the job cannot run on that many nodes
  std::string why_not;               // a sentence, when it cannot
};

// `config`'s layout on `nodes` nodes of daemon.ranks ranks each. The
// microbatches are the fewest that keep each one no larger than the full
// layout's and pass the layout check (common/layout_check.h); on
// config.max_nodes() nodes that is the configured layout itself.
LayoutFit layout_on_nodes(const common::Config& config, int64_t nodes);

}  // namespace keel::cluster
