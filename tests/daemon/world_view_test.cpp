// The whole world's samples a keeld's detectors take on many nodes
// (daemon/world_view.h): its own ranks from their boards, the others' from
// their nodes' summaries with their ages kept, and every rank of a node it
// has no fresh summary of unknown, never absent.
#include "daemon/world_view.h"

#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <vector>

using keel::cluster::Membership;
using keel::daemon::RemoteSummaries;
using keel::daemon::world_samples;
using keel::health::NodeSummary;
using keel::health::RankSample;
using keel::health::RankSamples;

namespace {

constexpr int64_t kSecond = 1'000'000'000;
constexpr int64_t kStale = 7 * kSecond;

// Node "b" of nodes a, b, c, two ranks each, in generation 4.
Membership node_b() {
  Membership m;
  m.generation = 4;
  m.nodes = {"a", "b", "c"};
  m.node_rank = 1;
  m.ranks_per_node = 2;
  return m;
}

// Two ranks from `first` that published, their heartbeat at `beat`.
RankSamples ranks_from(int first, int64_t beat) {
  RankSamples out;
  for (int r = first; r < first + 2; ++r) {
    RankSample s;
    s.rank = r;
    s.heartbeat_ns = beat;
    s.board.emplace();
    s.board->rank = r;
    s.board->update_ns = beat;
    out.push_back(s);
  }
  return out;
}

std::shared_ptr<const NodeSummary> summary(int64_t generation, RankSamples ranks, int64_t as_of) {
  return std::make_shared<const NodeSummary>(NodeSummary{generation, std::move(ranks), as_of});
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("a keeld sees its own ranks and those of every node heard from lately in global rank order") {
    const int64_t now = 100 * kSecond;
    // Node a's summary came 2 s ago, its ranks beating 1 s before it.
    RemoteSummaries remote = {{"a", summary(4, ranks_from(0, now - 3 * kSecond), now - 2 * kSecond)},
                              {"c", summary(4, ranks_from(4, now - kSecond), now - kSecond)}};
    const auto world = world_samples(ranks_from(2, now), node_b(), remote, now, kStale);
    REQUIRE(world.size() == 6);
    for (int r = 0; r < 6; ++r) {
      CAPTURE(r);
      CHECK(world[static_cast<size_t>(r)].rank == r);
      CHECK(world[static_cast<size_t>(r)].known);
      REQUIRE(world[static_cast<size_t>(r)].board.has_value());
    }
    // Ages as the node saw them when it published: 1 s for a, 0 for c.
    CHECK(world[0].heartbeat_ns == now - kSecond);
    CHECK(world[0].board->update_ns == now - kSecond);
    CHECK(world[4].heartbeat_ns == now);
    CHECK(world[2].heartbeat_ns == now);
  }

  TEST_CASE("the ranks of a node not heard from lately or not of this generation are unknown") {
    const int64_t now = 100 * kSecond;
    struct Row {
      const char* name;
      RemoteSummaries remote;  // of node c; a is always fresh
    };
    RankSamples wrong_numbers = ranks_from(4, now);
    wrong_numbers[1].rank = 7;
    RankSamples one_rank = ranks_from(4, now);
    one_rank.pop_back();
    const std::vector<Row> rows = {
        {"never heard from", {}},
        {"heard from too long ago", {{"c", summary(4, ranks_from(4, now - 8 * kSecond), now - kStale - 1)}}},
        {"of the generation before", {{"c", summary(3, ranks_from(4, now), now)}}},
        {"of other ranks", {{"c", summary(4, wrong_numbers, now)}}},
        {"of fewer ranks", {{"c", summary(4, one_rank, now)}}},
        {"an empty entry", {{"c", nullptr}}},
    };
    for (const Row& row : rows) {
      CAPTURE(row.name);
      RemoteSummaries remote = row.remote;
      remote["a"] = summary(4, ranks_from(0, now), now);
      const auto world = world_samples(ranks_from(2, now), node_b(), remote, now, kStale);
      REQUIRE(world.size() == 6);
      for (int r = 0; r < 4; ++r) CHECK(world[static_cast<size_t>(r)].known);
      for (int r = 4; r < 6; ++r) {
        CAPTURE(r);
        CHECK(world[static_cast<size_t>(r)].rank == r);
        CHECK_FALSE(world[static_cast<size_t>(r)].known);
        CHECK_FALSE(world[static_cast<size_t>(r)].board.has_value());
      }
    }
  }
}

