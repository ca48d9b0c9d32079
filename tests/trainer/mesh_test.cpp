#include "common/config.h"
#include "common/error.h"
#include "trainer/parallel/mesh.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace {

using keel::common::Error;
using keel::common::ErrorCode;
using namespace keel::trainer;

// Shapes that exercise every axis alone, in pairs and all together,
// including degrees that are not powers of two.
const std::vector<Layout> kLayouts = {
    {},
    {.dp = 2, .tp = 2, .pp = 2, .cp = 2},
    {.dp = 2, .tp = 2, .pp = 2, .cp = 2, .ep = 4},
    {.dp = 3, .tp = 2, .pp = 1, .cp = 1, .ep = 3},
    {.dp = 1, .tp = 4, .pp = 3, .cp = 1},
    {.dp = 4, .tp = 1, .pp = 1, .cp = 3, .ep = 6},
    {.dp = 2, .tp = 3, .pp = 2, .cp = 5, .ep = 2},
};

std::string describe(const Layout& l) {
  return "dp=" + std::to_string(l.dp) + " tp=" + std::to_string(l.tp) + " pp=" + std::to_string(l.pp) +
         " cp=" + std::to_string(l.cp) + " ep=" + std::to_string(l.ep);
}

int expected_group_size(const Layout& l, Axis axis) {
  switch (axis) {
    case Axis::kTp: return l.tp;
    case Axis::kCp: return l.cp;
    case Axis::kDp: return l.dp;
    case Axis::kPp: return l.pp;
    case Axis::kEp: return l.ep;
    case Axis::kExpertDp: return l.dp * l.cp / l.ep;
    case Axis::kDpCp: return l.dp * l.cp;
  }
  return 0;
}

std::vector<std::vector<int>> ranks_of(const std::vector<Group>& groups) {
  std::vector<std::vector<int>> out;
  for (const auto& g : groups) out.push_back(g.ranks);
  return out;
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("rank and coordinates round trip for every rank of several layouts") {
    for (const Layout& l : kLayouts) {
      CAPTURE(describe(l));
      std::set<std::vector<int>> seen;
      for (int rank = 0; rank < l.world_size(); ++rank) {
        const Coords c = Mesh::coords_of(l, rank);
        CHECK(Mesh::rank_of(l, c) == rank);
        CHECK(Mesh(l, rank).coords() == c);
        CHECK((c.pp >= 0 && c.pp < l.pp && c.dp >= 0 && c.dp < l.dp && c.cp >= 0 && c.cp < l.cp && c.tp >= 0 &&
               c.tp < l.tp));
        seen.insert({c.pp, c.dp, c.cp, c.tp});
      }
      CHECK(static_cast<int>(seen.size()) == l.world_size());
    }
  }

  TEST_CASE("ranks are numbered with tp innermost then cp then dp then pp") {
    const Layout l{.dp = 2, .tp = 2, .pp = 2, .cp = 2};
    CHECK(Mesh::rank_of(l, {.pp = 0, .dp = 0, .cp = 0, .tp = 1}) == 1);
    CHECK(Mesh::rank_of(l, {.pp = 0, .dp = 0, .cp = 1, .tp = 0}) == 2);
    CHECK(Mesh::rank_of(l, {.pp = 0, .dp = 1, .cp = 0, .tp = 0}) == 4);
    CHECK(Mesh::rank_of(l, {.pp = 1, .dp = 0, .cp = 0, .tp = 0}) == 8);
    CHECK(Mesh::rank_of(l, {.pp = 1, .dp = 0, .cp = 1, .tp = 1}) == 11);
    CHECK(Mesh::coords_of(l, 13) == Coords{.pp = 1, .dp = 1, .cp = 0, .tp = 1});
  }

  TEST_CASE("tp groups are consecutive ranks") {
    for (const Layout& l : kLayouts) {
      CAPTURE(describe(l));
      const auto groups = Mesh(l, 0).all_groups(Axis::kTp);
      REQUIRE(static_cast<int>(groups.size()) == l.world_size() / l.tp);
      for (size_t g = 0; g < groups.size(); ++g) {
        for (int i = 0; i < l.tp; ++i) CHECK(groups[g].ranks[i] == static_cast<int>(g) * l.tp + i);
      }
    }
  }

  TEST_CASE("every axis partitions the world into named groups of equal size") {
    for (const Layout& l : kLayouts) {
      for (Axis axis : kAxes) {
        CAPTURE(describe(l));
        CAPTURE(axis_name(axis));
        const auto groups = Mesh(l, 0).all_groups(axis);
        const int size = expected_group_size(l, axis);
        REQUIRE(static_cast<int>(groups.size()) * size == l.world_size());
        std::vector<int> times_seen(l.world_size(), 0);
        for (size_t g = 0; g < groups.size(); ++g) {
          CHECK(groups[g].name == std::string(axis_name(axis)) + "." + std::to_string(g));
          CHECK(static_cast<int>(groups[g].ranks.size()) == size);
          CHECK(std::is_sorted(groups[g].ranks.begin(), groups[g].ranks.end()));
          if (g > 0) CHECK(groups[g - 1].ranks[0] < groups[g].ranks[0]);
          for (int r : groups[g].ranks) ++times_seen[r];
        }
        CHECK(std::all_of(times_seen.begin(), times_seen.end(), [](int n) { return n == 1; }));
      }
    }
  }

  TEST_CASE("grid axis groups vary only their own coordinate") {
    const Layout l{.dp = 2, .tp = 3, .pp = 2, .cp = 5, .ep = 2};
    const std::map<Axis, int Coords::*> coordinate = {
        {Axis::kTp, &Coords::tp}, {Axis::kCp, &Coords::cp}, {Axis::kDp, &Coords::dp}, {Axis::kPp, &Coords::pp}};
    for (const auto& [axis_key, member] : coordinate) {
      const Axis axis = axis_key;  // clang 14 cannot capture a structured binding in CAPTURE's lambda
      CAPTURE(axis_name(axis));
      for (const Group& g : Mesh(l, 0).all_groups(axis)) {
        const Coords first = Mesh::coords_of(l, g.ranks[0]);
        for (size_t i = 0; i < g.ranks.size(); ++i) {
          Coords expected = first;
          expected.*member = static_cast<int>(i);
          CHECK(Mesh::coords_of(l, g.ranks[i]) == expected);
        }
      }
    }
  }

  TEST_CASE("each rank's own group is the one all_groups lists for it") {
    for (const Layout& l : kLayouts) {
      for (int rank = 0; rank < l.world_size(); ++rank) {
        const Mesh mesh(l, rank);
        for (Axis axis : kAxes) {
          CAPTURE(describe(l));
          CAPTURE(rank);
          CAPTURE(axis_name(axis));
          const Group& own = mesh.group(axis);
          int memberships = 0;
          for (const Group& g : mesh.all_groups(axis)) {
            const auto at = std::find(g.ranks.begin(), g.ranks.end(), rank);
            if (at == g.ranks.end()) {
              CHECK(g.index_in_group == -1);
              continue;
            }
            ++memberships;
            CHECK(g.name == own.name);
            CHECK(g.ranks == own.ranks);
            CHECK(g.index_in_group == at - g.ranks.begin());
            CHECK(own.index_in_group == g.index_in_group);
          }
          CHECK(memberships == 1);
        }
      }
    }
  }

  TEST_CASE("ep groups are consecutive dp ranks and expert-dp groups join equal ep positions") {
    const Mesh flat({.dp = 4, .ep = 2}, 3);
    CHECK(ranks_of(flat.all_groups(Axis::kEp)) == std::vector<std::vector<int>>{{0, 1}, {2, 3}});
    CHECK(ranks_of(flat.all_groups(Axis::kExpertDp)) == std::vector<std::vector<int>>{{0, 2}, {1, 3}});
    CHECK(flat.group(Axis::kEp).name == "ep.1");
    CHECK(flat.group(Axis::kEp).index_in_group == 1);
    CHECK(flat.group(Axis::kExpertDp).name == "expert_dp.1");
    CHECK(flat.group(Axis::kExpertDp).index_in_group == 1);

    // With tp=2 the dp ranks of one TP slice are two apart, and the slices
    // never mix.
    const Mesh sliced({.dp = 4, .tp = 2, .ep = 2}, 5);
    CHECK(ranks_of(sliced.all_groups(Axis::kEp)) == std::vector<std::vector<int>>{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
    CHECK(ranks_of(sliced.all_groups(Axis::kExpertDp)) ==
          std::vector<std::vector<int>>{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
    CHECK(sliced.group(Axis::kEp).ranks == std::vector<int>{5, 7});
    CHECK(sliced.group(Axis::kExpertDp).ranks == std::vector<int>{1, 5});
    CHECK(sliced.group(Axis::kExpertDp).index_in_group == 1);
  }

  TEST_CASE("ep groups run through cp ranks before the next dp rank") {
    const Layout l{.dp = 2, .cp = 3, .ep = 2};
    const Mesh mesh(l, 0);
    CHECK(ranks_of(mesh.all_groups(Axis::kEp)) == std::vector<std::vector<int>>{{0, 1}, {2, 3}, {4, 5}});
    CHECK(ranks_of(mesh.all_groups(Axis::kExpertDp)) == std::vector<std::vector<int>>{{0, 2, 4}, {1, 3, 5}});
    for (const Layout& each : kLayouts) {
      for (int rank = 0; rank < each.world_size(); ++rank) {
        CAPTURE(describe(each));
        CAPTURE(rank);
        const Mesh m(each, rank);
        const int slot = m.coords().dp * each.cp + m.coords().cp;
        CHECK(m.group(Axis::kDpCp).index_in_group == slot);
        CHECK(m.group(Axis::kEp).index_in_group == slot % each.ep);
        CHECK(m.group(Axis::kExpertDp).index_in_group == slot / each.ep);
      }
    }
  }

  TEST_CASE("dp_cp groups join the data and context ranks of one stage and tensor slice") {
    const Mesh mesh({.dp = 2, .tp = 2, .pp = 2, .cp = 2}, 11);
    CHECK(ranks_of(mesh.all_groups(Axis::kDpCp)) ==
          std::vector<std::vector<int>>{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}});
    CHECK(mesh.group(Axis::kDpCp).name == "dp_cp.3");
    CHECK(mesh.group(Axis::kDpCp).index_in_group == 1);
    // Without CP the ZeRO group is exactly the DP group.
    const Mesh no_cp({.dp = 4, .tp = 2}, 3);
    CHECK(no_cp.group(Axis::kDpCp).ranks == no_cp.group(Axis::kDp).ranks);
  }

  TEST_CASE("a single rank is alone in every group") {
    const Mesh mesh({}, 0);
    for (Axis axis : kAxes) {
      CAPTURE(axis_name(axis));
      CHECK(mesh.group(axis).name == std::string(axis_name(axis)) + ".0");
      CHECK(mesh.group(axis).ranks == std::vector<int>{0});
      CHECK(mesh.group(axis).index_in_group == 0);
    }
  }

  TEST_CASE("a mesh refuses a rank outside the world or an unvalidated layout") {
    for (int rank : {-1, 4}) {
      try {
        Mesh({.dp = 2, .tp = 2}, rank);
        FAIL("expected an Error for rank " << rank);
      } catch (const Error& e) {
        CHECK(e.code() == ErrorCode::kInternal);
      }
    }
    CHECK_THROWS_AS(Mesh({.dp = 0}, 0), Error);
    CHECK_THROWS_AS(Mesh({.dp = 3, .ep = 2}, 0), Error);
  }

  TEST_CASE("a layout copies every field of the parallel config") {
    keel::common::ParallelConfig p;
    p.dp = 2;
    p.tp = 3;
    p.pp = 4;
    p.cp = 5;
    p.ep = 6;
    p.zero = 2;
    p.micro_batches = 7;
    const Layout l = Layout::from(p);
    CHECK(l.dp == 2);
    CHECK(l.tp == 3);
    CHECK(l.pp == 4);
    CHECK(l.cp == 5);
    CHECK(l.ep == 6);
    CHECK(l.zero == 2);
    CHECK(l.micro_batches == 7);
    CHECK(l.world_size() == 2 * 3 * 4 * 5);
  }
}
