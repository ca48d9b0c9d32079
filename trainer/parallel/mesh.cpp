#include "trainer/parallel/mesh.h"

#include "common/error.h"

#include <fmt/format.h>

#include <cstdint>
#include <utility>

namespace keel::trainer {

using common::Error;
using common::ErrorCode;

namespace {

// An axis as data: how big its groups are, where a rank sits in its group,
// and who sits at another position of that group. all_groups() and the
// mesh's own groups are derived from this table alone.
struct AxisRule {
  const char* name;
  int (*size)(const Layout&);
  int (*position)(const Layout&, const Coords&);
  Coords (*member)(const Layout&, Coords, int position);
};

// An axis that is one coordinate of the grid.
template <int Coords::*kCoord, int Layout::*kDegree>
constexpr AxisRule grid_axis(const char* name) {
  return {name, [](const Layout& l) { return l.*kDegree; }, [](const Layout&, const Coords& c) { return c.*kCoord; },
          [](const Layout&, Coords c, int position) {
            c.*kCoord = position;
            return c;
          }};
}

// The (dp, cp) pair flattened into the slot EP groups are cut from.
int slot_of(const Layout& l, const Coords& c) { return c.dp * l.cp + c.cp; }
Coords at_slot(const Layout& l, Coords c, int slot) {
  c.dp = slot / l.cp;
  c.cp = slot % l.cp;
  return c;
}

// Indexed by Axis.
constexpr std::array<AxisRule, kAxisCount> kRules = {{
    grid_axis<&Coords::tp, &Layout::tp>("tp"),
    grid_axis<&Coords::cp, &Layout::cp>("cp"),
    grid_axis<&Coords::dp, &Layout::dp>("dp"),
    grid_axis<&Coords::pp, &Layout::pp>("pp"),
    {"ep", [](const Layout& l) { return l.ep; }, [](const Layout& l, const Coords& c) { return slot_of(l, c) % l.ep; },
     [](const Layout& l, Coords c, int position) { return at_slot(l, c, slot_of(l, c) / l.ep * l.ep + position); }},
    {"expert_dp", [](const Layout& l) { return l.dp * l.cp / l.ep; },
     [](const Layout& l, const Coords& c) { return slot_of(l, c) / l.ep; },
     [](const Layout& l, Coords c, int position) { return at_slot(l, c, position * l.ep + slot_of(l, c) % l.ep); }},
    {"dp_cp", [](const Layout& l) { return l.dp * l.cp; }, slot_of, at_slot},
}};

const AxisRule& rule(Axis axis) { return kRules[static_cast<size_t>(axis)]; }

}  // namespace

Layout Layout::from(const common::ParallelConfig& parallel) {
  return {.dp = static_cast<int>(parallel.dp),
          .tp = static_cast<int>(parallel.tp),
          .pp = static_cast<int>(parallel.pp),
          .cp = static_cast<int>(parallel.cp),
          .ep = static_cast<int>(parallel.ep),
          .zero = static_cast<int>(parallel.zero),
          .micro_batches = static_cast<int>(parallel.micro_batches)};
}

const char* axis_name(Axis axis) { return rule(axis).name; }

Mesh::Mesh(Layout layout, int rank) : layout_(layout), rank_(rank) {
  const Layout& l = layout_;
  if (l.dp < 1 || l.tp < 1 || l.pp < 1 || l.cp < 1 || l.ep < 1 || (l.dp * l.cp) % l.ep != 0) {
    throw Error(ErrorCode::kInternal,
                fmt::format("mesh built from an unvalidated layout dp={} tp={} pp={} cp={} ep={}: run validate_layout "
                            "first",
                            l.dp, l.tp, l.pp, l.cp, l.ep));
  }
  if (rank < 0 || rank >= l.world_size()) {
    throw Error(ErrorCode::kInternal, fmt::format("rank {} lies outside a world of {} ranks", rank, l.world_size()));
  }
  coords_ = coords_of(l, rank);
  for (Axis axis : kAxes) {
    for (Group& group : all_groups(axis)) {
      if (group.index_in_group >= 0) groups_[static_cast<size_t>(axis)] = std::move(group);
    }
  }
}

std::vector<Group> Mesh::all_groups(Axis axis) const {
  const AxisRule& r = rule(axis);
  const int size = group_size(layout_, axis);
  std::vector<Group> groups;
  // Ranks within a group ascend with position, so position 0 is the lowest
  // rank and walking the world in rank order meets groups in name order.
  for (int leader = 0; leader < layout_.world_size(); ++leader) {
    const Coords c = coords_of(layout_, leader);
    if (r.position(layout_, c) != 0) continue;
    Group group{fmt::format("{}.{}", r.name, groups.size()), {}, -1};
    for (int position = 0; position < size; ++position) {
      const int member = rank_of(layout_, r.member(layout_, c, position));
      if (member == rank_) group.index_in_group = position;
      group.ranks.push_back(member);
    }
    groups.push_back(std::move(group));
  }
  return groups;
}

int Mesh::group_size(const Layout& layout, Axis axis) { return rule(axis).size(layout); }

Coords Mesh::coords_of(const Layout& l, int rank) {
  Coords c;
  c.tp = rank % l.tp;
  rank /= l.tp;
  c.cp = rank % l.cp;
  rank /= l.cp;
  c.dp = rank % l.dp;
  c.pp = rank / l.dp;
  return c;
}

int Mesh::rank_of(const Layout& l, Coords c) { return ((c.pp * l.dp + c.dp) * l.cp + c.cp) * l.tp + c.tp; }

}  // namespace keel::trainer
