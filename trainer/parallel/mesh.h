// The process mesh (docs/architecture.md "Parallel layout and communication"): which rank sits where on the PP x DP x CP
// x TP grid and every process group it belongs to. Whether a layout fits
// the model, the batch and the world is common/layout_check.h.
//
// rank = ((pp * DP + dp) * CP + cp) * TP + tp. TP is innermost because its
// collectives run on every layer, forward and backward, and must stay on
// one node's fast links; PP is outermost because it only exchanges
// activations at stage boundaries and tolerates the slowest links.
//
// EP is carved out of the DP x CP ranks of one (pp, tp) slice: number those
// dp * cp ranks by (dp, cp) as slot = dp * CP + cp; an EP group is ep
// consecutive slots, and an expert-DP group joins the slots at the same
// position of every EP group (it all-reduces the gradients of the experts
// that EP position holds).
#pragma once

#include "common/config.h"

#include <array>
#include <cstddef>
#include <string>
#include <vector>

namespace keel::trainer {

struct Layout {
  int dp = 1;
  int tp = 1;
  int pp = 1;
  int cp = 1;
  int ep = 1;
  int zero = 0;
  int micro_batches = 1;

  // Narrows the config's 64-bit fields; call it after
  // common::validate_layout (common/layout_check.h), which bounds every degree.
  static Layout from(const common::ParallelConfig& parallel);

  int world_size() const { return pp * dp * cp * tp; }
};

struct Coords {
  int pp = 0;
  int dp = 0;
  int cp = 0;
  int tp = 0;

  bool operator==(const Coords&) const = default;
};

// kDpCp is the group ZeRO shards over and gradients are reduced in: with
// cp > 1 every CP rank sees different tokens of the same samples, so it
// plays the part of a DP rank.
enum class Axis : int { kTp, kCp, kDp, kPp, kEp, kExpertDp, kDpCp };
inline constexpr std::size_t kAxisCount = 7;
inline constexpr std::array<Axis, kAxisCount> kAxes = {Axis::kTp, Axis::kCp,       Axis::kDp,  Axis::kPp,
                                                       Axis::kEp, Axis::kExpertDp, Axis::kDpCp};

// The axes that are coordinates of the grid: their groups tile the world,
// so a sum over each of them in turn is a sum over every rank.
inline constexpr std::array<Axis, 4> kGridAxes = {Axis::kTp, Axis::kCp, Axis::kDp, Axis::kPp};

// "tp", "cp", "dp", "pp", "ep", "expert_dp", "dp_cp".
const char* axis_name(Axis axis);

struct Group {
  // "<axis>.<index>", the index counting the axis's groups in order of their
  // lowest rank, so that every rank derives the same communicator key
  // prefix for the same group without talking to the others.
  std::string name;
  // Ascending; a member's position here is its rank within the group.
  std::vector<int> ranks;
  // Where the mesh's own rank sits in `ranks`; -1 when it is not a member.
  int index_in_group = -1;
};

class Mesh {
 public:
  // Throws Error(kInternal) when `layout` has a degree below 1 or an ep that
  // does not divide dp * cp, or `rank` lies outside the world: callers run
  // validate_layout first, so either means a bug.
  Mesh(Layout layout, int rank);

  const Layout& layout() const { return layout_; }
  int rank() const { return rank_; }
  Coords coords() const { return coords_; }

  // This rank's group along `axis`.
  const Group& group(Axis axis) const { return groups_[static_cast<std::size_t>(axis)]; }

  // Every group along `axis` in the world; together they hold each rank
  // exactly once, and all have the same size.
  std::vector<Group> all_groups(Axis axis) const;

  // How many ranks each group along `axis` has.
  static int group_size(const Layout& layout, Axis axis);
  // Requires 0 <= rank < layout.world_size().
  static Coords coords_of(const Layout& layout, int rank);
  static int rank_of(const Layout& layout, Coords coords);

 private:
  Layout layout_;
  int rank_;
  Coords coords_;
  std::array<Group, kAxisCount> groups_;
};

}  // namespace keel::trainer
