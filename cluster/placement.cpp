#include "cluster/placement.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <sstream>

#include "common/error.h"
#include "trainer/parallel/mesh.h"

namespace keel::cluster {
namespace {

using trainer::Axis;

// The axes a placement reports, in the order the mesh nests them.
constexpr Axis kReported[] = {Axis::kTp, Axis::kCp, Axis::kEp, Axis::kDp, Axis::kPp};

bool fast_link_axis(Axis axis) { return axis == Axis::kTp || axis == Axis::kCp || axis == Axis::kEp; }

}  // namespace

std::vector<std::string> cross_node_axes(const common::Config& config) {
  std::vector<std::string> axes;
  std::stringstream list(config.cluster.cross_node_axes);
  for (std::string axis; std::getline(list, axis, ',');) {
    axis.erase(std::remove(axis.begin(), axis.end(), ' '), axis.end());
    if (axis.empty()) continue;
    if (axis != "tp" && axis != "cp" && axis != "ep") {
      throw common::Error(common::ErrorCode::kBadConfig,
                          fmt::format("cluster.cross_node_axes names '{}': it lists axes among tp, cp and ep that may "
                                      "span nodes (dp and pp always may)",
                                      axis));
    }
    axes.push_back(axis);
  }
  return axes;
}

Placement place_on_nodes(const common::Config& config, int64_t nodes) {
  Placement placement;
  const LayoutFit fit = layout_on_nodes(config, nodes);
  if (!fit.layout) {
    placement.problem = fit.why_not;
    return placement;
  }
  placement.layout = fit.layout;
  common::Config on_nodes = config;
  on_nodes.parallel.dp = fit.layout->dp;
  on_nodes.parallel.micro_batches = fit.layout->micro_batches;
  const int64_t per_node = config.node_ranks();
  const trainer::Mesh mesh(trainer::Layout::from(on_nodes.parallel), 0);
  const auto allowed = cross_node_axes(config);
  for (Axis axis : kReported) {
    const std::string name = trainer::axis_name(axis);
    for (const auto& group : mesh.all_groups(axis)) {
      const int64_t first_node = group.ranks.front() / per_node;
      const int64_t last_node = group.ranks.back() / per_node;  // ranks ascend
      if (first_node == last_node) continue;
      placement.crossing.push_back(name);
      if (fast_link_axis(axis) && placement.problem.empty() &&
          std::find(allowed.begin(), allowed.end(), name) == allowed.end()) {
        placement.problem = fmt::format(
            "the layout's {} groups span nodes: with daemon.ranks = {}, group {} holds ranks {} on nodes {} to {}. "
            "{} collectives run in every layer and belong on a node's fast links (NVLink is about 18x InfiniBand): "
            "make tp x cp (and the EP group's ranks) divide daemon.ranks, or allow it with cluster.cross_node_axes "
            "= \"{}\"",
            name, per_node, group.name, fmt::join(group.ranks, ","), first_node, last_node, name, name);
      }
      break;
    }
  }
  return placement;
}

}  // namespace keel::cluster
