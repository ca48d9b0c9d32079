// Ranks as a multi-node job runs them (docs/architecture.md "Multi-node on
// etcd: the design being built"): their Store is a real three-member etcd
// cluster, so Gloo's rendezvous, the checkpoint reports and the commit go
// through the quorum, and their transport binds the node's address rather
// than 127.0.0.1. The run is the one the embedded store gives, bit for bit.
#include <doctest/doctest.h>

#include <chrono>
#include <filesystem>

#include "store/store.h"
#include "tests/support/etcd_test_cluster.h"
#include "tests/support/temp_dir.h"
#include "tests/trainer/trainer_runs.h"

TEST_SUITE("integration") {
  TEST_CASE(
      "DP2 x TP2 ranks that rendezvous and commit checkpoints through etcd train bit for bit as on the embedded "
      "store") {
    keel::test::TempDir etcd_dir;
    auto etcd_cluster = keel::test::start_etcd_or_skip(etcd_dir.path());
    if (!etcd_cluster) return;
    keel::test::EtcdCluster& cluster = *etcd_cluster;
    keel::test::TrainerRuns f;
    const keel::test::Layout layout{.dp = 2, .tp = 2, .zero = 1};
    const std::vector<std::string> sets = {"checkpoint.every_steps=5"};
    const auto embedded = f.run(layout, "embedded", sets);
    const auto on_etcd = f.run(
        layout, "etcd", sets, {}, 0,
        {{"KEEL_STORE", cluster.address("keel/job-x")}, {"KEEL_STORE_SECRET", ""}, {"KEEL_BIND_ADDRESS", "127.0.0.2"}});
    REQUIRE(on_etcd.exact.size() == 20);
    CHECK(on_etcd.exact == embedded.exact);
    // The ranks did use etcd: their rendezvous and the resume choice are
    // there, under the job's prefix (reports go once committed).
    auto store = keel::store::connect_store(cluster.address("keel/job-x"), "", std::chrono::seconds(10));
    auto& etcd = dynamic_cast<keel::store::ClusterStore&>(*store);
    // Each rank's Gloo address (a sockaddr) names 127.0.0.2, never 127.0.0.1.
    const std::string node_address("\x7f\x00\x00\x02", 4);
    const std::string loopback("\x7f\x00\x00\x01", 4);
    int addresses = 0;
    for (const auto& entry : etcd.list("").entries) {
      if (!entry.key.starts_with("gloo/")) continue;
      if (entry.value.find(node_address) != std::string::npos) ++addresses;
      CHECK(entry.value.find(loopback) == std::string::npos);
    }
    CHECK(addresses > 0);
    CHECK(etcd.get("ckpt/g0/resume").has_value());
    // checkpoint.keep = 3 newest.
    for (int step : {10, 15, 20}) {
      CAPTURE(step);
      char name[32];
      std::snprintf(name, sizeof(name), "step_%08d", step);
      CHECK(std::filesystem::exists(f.dir() / "etcd" / "checkpoints" / name / "index.h5"));
    }
  }
}
