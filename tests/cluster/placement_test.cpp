// Where a layout's groups fall on nodes: TP, CP and EP kept inside a node
// unless allowed across, DP and PP across as they must.
#include "cluster/placement.h"
#include "tests/cluster/cluster_config.h"

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "common/error.h"

namespace keel::cluster {
using test::cluster_config;

TEST_SUITE("unit") {
  TEST_CASE("a layout keeps tp cp and ep inside nodes and crosses them with dp and pp or is refused with a sentence") {
    struct Row {
      const char* name;
      std::vector<std::string> sets;
      int64_t nodes;
      std::vector<std::string> crossing;
      const char* problem;  // part of the refusal; empty: accepted
    };
    const Row rows[] = {
        {"tp inside each node and dp across",
         {"parallel.dp=3", "parallel.tp=2", "daemon.ranks=2", "train.batch_size=12"},
         3,
         {"dp"},
         ""},
        {"on fewer nodes the same",
         {"parallel.dp=3", "parallel.tp=2", "daemon.ranks=2", "train.batch_size=12"},
         2,
         {"dp"},
         ""},
        {"tp and cp inside a node, pp across",
         {"parallel.pp=2", "parallel.tp=2", "parallel.cp=2", "parallel.micro_batches=2", "daemon.ranks=4"},
         2,
         {"pp"},
         ""},
        {"one node: nothing crosses", {"parallel.dp=2", "parallel.tp=2", "daemon.ranks=4"}, 1, {}, ""},
        {"a tp group over two nodes",
         {"parallel.dp=2", "parallel.tp=2", "daemon.ranks=1"},
         4,
         {"tp", "dp"},
         "the layout's tp groups span nodes: with daemon.ranks = 1, group tp.0 holds ranks 0,1 on nodes 0 to 1"},
        {"a tp group over two nodes allowed",
         {"parallel.dp=2", "parallel.tp=2", "daemon.ranks=1", "cluster.cross_node_axes=tp"},
         4,
         {"tp", "dp"},
         ""},
        {"a cp group over two nodes",
         {"parallel.dp=2", "parallel.cp=2", "daemon.ranks=1"},
         4,
         {"cp", "dp"},
         "the layout's cp groups span nodes"},
        {"an ep group over two nodes",
         {"parallel.dp=4", "parallel.ep=4", "model.n_expert=4", "daemon.ranks=2"},
         2,
         {"ep", "dp"},
         "the layout's ep groups span nodes"},
        {"a node count the layout cannot run on",
         {"parallel.dp=2", "parallel.tp=2", "daemon.ranks=1"},
         3,
         {},
         "not a multiple of tp x cp x pp = 2"},
    };
    for (const Row& row : rows) {
      const std::string name = row.name;
      CAPTURE(name);
      const Placement placement = place_on_nodes(cluster_config(row.sets), row.nodes);
      CAPTURE(placement.problem);
      CHECK(placement.crossing == row.crossing);
      if (std::string(row.problem).empty()) {
        CHECK(placement.problem.empty());
      } else {
        CHECK(placement.problem.find(row.problem) != std::string::npos);
      }
    }
  }

  TEST_CASE("cross_node_axes names only axes that could stay inside a node") {
    CHECK(cross_node_axes(cluster_config({"daemon.ranks=1", "cluster.cross_node_axes=tp, ep"})) ==
          std::vector<std::string>{"tp", "ep"});
    try {
      cross_node_axes(cluster_config({"daemon.ranks=1", "cluster.cross_node_axes=dp"}));
      FAIL("dp was accepted");
    } catch (const common::Error& e) {
      CHECK(e.code() == common::ErrorCode::kBadConfig);
      CHECK(std::string(e.what()).find("names 'dp'") != std::string::npos);
    }
  }
}

}  // namespace keel::cluster
