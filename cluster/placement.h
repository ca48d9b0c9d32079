// Where the layout's groups fall on nodes (docs/architecture.md "Multi-node
// on etcd", "Placement"). Node n runs ranks n x daemon.ranks up to the next
// node's, and the mesh (trainer/parallel/mesh.h) puts TP innermost, then
// CP, DP and PP, so TP and CP groups stay inside a node when their product
// divides daemon.ranks. TP, CP and EP exchange activations in every layer,
// forward and backward: over NVLink inside a node that is about 18x as fast
// as over InfiniBand between nodes, so a layout whose groups of those axes
// span nodes is refused unless cluster.cross_node_axes allows it. DP and PP
// cross nodes as they must.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cluster/elastic_layout.h"
#include "common/config.h"

namespace keel::cluster {

struct Placement {
  // The layout on that many nodes (cluster/elastic_layout.h); nullopt: it
  // cannot run there, and `problem` says why.
  std::optional<NodeLayout> layout;
  // The axes ("tp", "cp", "dp", "pp", "ep") with a group that spans nodes.
  std::vector<std::string> crossing;
  // Why the layout is refused (a sentence naming the axis, a group and
  // what to change); empty when it is not.
  std::string problem;
};

// `config`'s layout on `nodes` nodes (cluster/elastic_layout.h gives its DP
// there); a node count the layout cannot run on has a problem saying so.
Placement place_on_nodes(const common::Config& config, int64_t nodes);

// The names in cluster.cross_node_axes; Error(kBadConfig) for one that is
// not "tp", "cp" or "ep".
std::vector<std::string> cross_node_axes(const common::Config& config);

}  // namespace keel::cluster
