// The layout a generation gets on the nodes it has: DP shrinks, the model's
// axes stay, and the global batch is kept through more microbatches.
#include "cluster/elastic_layout.h"
#include "tests/cluster/cluster_config.h"

#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace keel::cluster {
using test::cluster_config;

TEST_SUITE("unit") {
  TEST_CASE("a job keeps its global batch on fewer nodes through more microbatches") {
    struct Row {
      const char* name;
      std::vector<std::string> sets;
      int64_t nodes;
      int64_t dp;             // expected; 0: refused
      int64_t micro_batches;  // expected
      const char* why_not;    // part of the refusal
    };
    const Row rows[] = {
        {"the full layout is the configured one",
         {"parallel.dp=3", "parallel.tp=2", "daemon.ranks=2", "train.batch_size=12"},
         3,
         3,
         1,
         ""},
        {"one node fewer: two microbatches of no more sequences",
         {"parallel.dp=3", "parallel.tp=2", "daemon.ranks=2", "train.batch_size=12"},
         2,
         2,
         2,
         ""},
        {"a configured accumulation is scaled",
         {"parallel.dp=4", "daemon.ranks=2", "parallel.micro_batches=2", "train.batch_size=16"},
         1,
         2,
         4,
         ""},
        {"the most microbatches: one sequence each",
         {"parallel.dp=4", "daemon.ranks=1", "train.batch_size=4"},
         1,
         1,
         4,
         ""},
        {"a batch the smaller DP cannot split is refused",
         {"parallel.dp=3", "daemon.ranks=1", "train.batch_size=3"},
         2,
         0,
         0,
         "batch_size=3 cannot be split over dp=2"},
        {"nodes that cannot hold whole model replicas are refused",
         {"parallel.dp=2", "parallel.tp=2", "daemon.ranks=1", "train.batch_size=8"},
         3,
         0,
         0,
         "3 nodes of 1 ranks are 3 ranks, not a multiple of tp x cp x pp = 2"},
        {"a layout the mesh refuses on the smaller DP is refused with its sentence",
         {"parallel.dp=4", "parallel.ep=4", "model.n_expert=4", "daemon.ranks=2", "train.batch_size=8"},
         1,
         0,
         0,
         "on 1 nodes (dp=2)"},
        {"no nodes", {"parallel.dp=2", "daemon.ranks=1"}, 0, 0, 0, "at least one node"},
    };
    for (const Row& row : rows) {
      CAPTURE(row.name);
      const LayoutFit fit = layout_on_nodes(cluster_config(row.sets), row.nodes);
      CAPTURE(fit.why_not);
      if (row.dp == 0) {
        CHECK(!fit.layout);
        CHECK(fit.why_not.find(row.why_not) != std::string::npos);
        continue;
      }
      REQUIRE(fit.layout);
      CHECK(fit.layout->dp == row.dp);
      CHECK(fit.layout->micro_batches == row.micro_batches);
    }
  }

  TEST_CASE("the ranks are told the layout as overrides of the config") {
    const NodeLayout layout{2, 3};
    CHECK(layout.overrides() == std::vector<std::string>{"parallel.dp=2", "parallel.micro_batches=3"});
  }
}

}  // namespace keel::cluster
