// Many nodes as one job (docs/architecture.md "Multi-node on etcd"), on one
// machine: a real three-member etcd cluster and three keelds, each a node
// with its own run directory, control socket and address (127.0.0.1-3, all
// loopback), sharing the checkpoint directory as nodes share a filesystem.
// Each keeld runs two CPU ranks of a DP3 x TP2 job: TP inside a node, DP
// across nodes.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>

#include "checkpoint/catalog.h"
#include "daemon/protocol.h"
#include "daemon/status_view.h"
#include "tests/daemon/cluster_job.h"
#include "tests/daemon/health_job.h"
#include "tests/daemon/keeld_job.h"
#include "tests/daemon/prometheus_scrape.h"
#include "tests/support/etcd_test_cluster.h"
#include "tests/support/network_namespace.h"

namespace keel::test {
namespace {

// Long enough that the etcd leader's loss lands before the end.
const std::vector<std::string> kLongRun = {"train.steps=300", "checkpoint.every_steps=10"};

// The settings that make a single keeld run the cluster's full layout.
std::vector<std::string> full_layout(const std::vector<std::string>& more) {
  std::vector<std::string> sets = {"parallel.dp=3", "train.batch_size=12"};
  sets.insert(sets.end(), more.begin(), more.end());
  return sets;
}

// The three-node job, with every node's keeld started.
struct ThreeNodes {
  TempDir etcd_dir;
  std::unique_ptr<EtcdCluster> etcd;
  std::unique_ptr<ClusterJob> job;
  std::vector<std::unique_ptr<ChildProcess>> keelds;

  // Starts etcd (false, the case skipped, where it cannot), starts every
  // node's keeld with `sets` and waits until node `watched` trains on three
  // nodes and the first checkpoint is committed: a node lost before that
  // rightly has the job start again from step 0.
  bool start(int watched, const std::vector<std::string>& sets) {
    etcd = start_etcd_or_skip(etcd_dir.path());
    if (!etcd) return false;
    job = std::make_unique<ClusterJob>(*etcd, 3, sets);
    keelds = start_all(*job);
    job->wait_for(watched, [&](const nlohmann::json& s) {
      return running_on(s, 3) && !checkpoint::committed(job->checkpoints()).empty();
    });
    return true;
  }

  // Stops the endless job on every node, as `systemctl stop` would.
  void stop() {
    for (auto& keeld : keelds) keeld->signal(SIGTERM);
    require_finished(keelds);
  }
};

// A node at random, and another.
std::pair<int, int> two_nodes() {
  std::mt19937 rng(std::random_device{}());
  const int chosen = std::uniform_int_distribution<int>(0, 2)(rng);
  return {chosen, (chosen + 1) % 3};
}

// The newest step of which a node's status says it holds copies of both
// of node `node`'s ranks; -1 until it does.
int64_t copied_step_of(const nlohmann::json& status, int node) {
  const auto& copies = status.at("snapshot_copies");
  std::map<int64_t, int> ranks_of_step;
  for (const auto& held : copies.is_object() ? copies.at("held") : nlohmann::json::array()) {
    if (held.at("rank").get<int>() / 2 == node) ranks_of_step[held.at("step").get<int64_t>()] += 1;
  }
  for (auto it = ranks_of_step.rbegin(); it != ranks_of_step.rend(); ++it) {
    if (it->second == 2) return it->first;
  }
  return -1;
}

// Waits until node 0, rank 0's, records where a generation resumed after
// the `before` it had recorded; returns that record.
nlohmann::json next_resume(const ClusterJob& job, size_t before) {
  REQUIRE(wait_until([&] { return job.events_of(0, "generation_resumed").size() > before; }, 180));
  return job.events_of(0, "generation_resumed").back();
}

// Every step's loss of the cluster's endless run within `tolerance`
// (relative; by default the resharding's) of the uninterrupted run: one
// keeld alone, the same endless job, stopped past the cluster's last step.
void check_losses_close(const ClusterJob& job, double tolerance = 1e-4) {
  const auto got = job.losses();
  REQUIRE(!got.empty());
  const int64_t last = got.rbegin()->first;
  KeeldJob alone(kKeeldJobConfig);
  auto keeld = alone.start(full_layout(kEndless));
  alone.wait_for([&](const nlohmann::json& s) { return s.at("step") > last + 1; }, 900);
  keeld->signal(SIGTERM);
  REQUIRE(keeld->wait(120).exit_code == 0);
  const auto expected = alone.losses();
  REQUIRE(static_cast<int64_t>(expected.size()) > last);
  CHECK(static_cast<int64_t>(got.size()) == last + 1);  // every step trained, none lost
  double worst = 0;
  for (const auto& [step, loss] : got) {
    const double want = std::stod(expected.at(static_cast<size_t>(step)));
    worst = std::max(worst, std::fabs(loss - want) / std::fabs(want));
  }
  MESSAGE("largest relative loss difference from the uninterrupted run over " << last + 1 << " steps: " << worst);
  CHECK(worst <= tolerance);
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE(
      "three keelds on etcd train one DP3 x TP2 job and end with the model of one keeld running the whole layout") {
    TempDir etcd_dir;
    auto etcd = start_etcd_or_skip(etcd_dir.path());
    if (!etcd) return;
    // The reference: one keeld, one node, the same layout and batches.
    KeeldJob alone(kKeeldJobConfig);
    alone.run(full_layout({"checkpoint.every_steps=4"}));

    ClusterJob job(*etcd, 3);
    auto keelds = start_all(job);
    require_finished(keelds);
    for (int node = 0; node < 3; ++node) {
      const auto joined = job.events_of(node, "generation_joined");
      REQUIRE(joined.size() == 1);
      CHECK(joined.front().at("nodes").size() == 3);
      CHECK(joined.front().at("node_rank") == node);
      // TP inside each node, DP across (cluster/placement.h).
      CHECK(joined.front().at("cross_node_axes") == nlohmann::json::array({"dp"}));
    }
    // Node 0 ran rank 0, which wrote the metrics and committed the checkpoints.
    require_identical(alone.checkpoint_tensors(40), checkpoint_tensors(job.checkpoints(), 40));
  }

  TEST_CASE(
      "bad input to a keeld of a running job on etcd with TLS and passwords is refused with a sentence and an exit "
      "code and the job trains on") {
    TempDir etcd_dir;
    // As an operator would run it: TLS with client certificates, and users.
    auto etcd = start_etcd_or_skip(etcd_dir.path(), 1, "", EtcdCluster::Transport::kTls);
    if (!etcd) return;
    etcd->enable_auth("keel", "keel-pw", "keel/cluster-test/");
    // Endless, stopped on purpose after the table: every row meets it running.
    ClusterJob job(*etcd, 3, {"train.steps=1000000", "checkpoint.every_steps=50"});
    const std::string good = "cluster.credential_file=" + job.write("good.credential", "keel:keel-pw\n").string();
    const std::string wrong = "cluster.credential_file=" + job.write("wrong.credential", "keel:hunter2\n").string();
    const auto stranger = keel::test::make_test_certificates(etcd_dir.path() / "stranger", {"127.0.0.1"});
    // min_nodes = 2 seals two nodes after the join timeout.
    std::vector<std::unique_ptr<ChildProcess>> keelds;
    for (int node = 0; node < 2; ++node) keelds.push_back(job.start(node, {good}));  // two of three nodes
    job.wait_for(0, [](const nlohmann::json& s) { return running_on(s, 2); });

    struct Row {
      const char* name;
      std::vector<std::string> sets;  // for node 2's keeld
      int exit_code;
      const char* says;
    };
    const Row rows[] = {
        {"etcd unreachable",
         {good, "cluster.etcd=etcd://127.0.0.1:1/keel/cluster-test"},
         12,
         "etcd cannot be reached at 127.0.0.1:1"},
        {"a wrong password", {wrong}, 2, "password"},
        {"no credential where etcd wants one", {}, 2, "keel/cluster-test"},
        {"the name of a live node",
         {good, "cluster.node_name=node-0"},
         2,
         "another live keeld holds node name 'node-0'"},
        {"a node with a different config",
         {good, "train.lr=0.1"},
         2,
         "train.lr is 0.1 here but 0.003 on the job's nodes"},
        {"a second job under the job's name",
         {good, "model.n_embd=64", "cluster.node_name=other-job"},
         2,
         "model.n_embd is 64 here but 32 on the job's nodes"},
        {"a layout whose TP groups would span nodes", {good, "daemon.ranks=1"}, 2, "the layout's tp groups span nodes"},
        {"plain HTTP where etcd speaks TLS",
         {good, "cluster.tls_ca_file=", "cluster.tls_cert_file=", "cluster.tls_key_file="},
         12,
         "if they are https, set cluster.tls_ca_file"},
        {"a CA that did not sign etcd's certificate",
         {good, "cluster.tls_ca_file=" + stranger.ca.string()},
         2,
         "its TLS certificate is not trusted"},
        {"a client certificate with a Common Name where etcd has users",
         {good, "cluster.tls_cert_file=" + etcd->certificates().named_client_cert.string(),
          "cluster.tls_key_file=" + etcd->certificates().named_client_key.string()},
         2,
         "etcd's JSON gateway takes only client certificates without a Common Name"},
        {"a credential file that is not there",
         {"cluster.credential_file=/nonexistent/etcd.credential"},
         2,
         "cluster.credential_file /nonexistent/etcd.credential cannot be read"},
    };
    for (const Row& row : rows) {
      CAPTURE(row.name);
      const auto result = job.start(2, row.sets)->wait(120);
      CAPTURE(result.output);
      CHECK(result.exit_code == row.exit_code);
      CHECK(result.output.find(row.says) != std::string::npos);
    }
    // keelctl status shows what each axis moved a step, DP crossing nodes.
    const auto status = job.status(0);
    CHECK(status.at("axis_bytes_per_step").value("dp", uint64_t{0}) > 0);
    CHECK(status.at("axis_bytes_per_step").value("tp", uint64_t{0}) > 0);
    CHECK(status.at("cluster").at("cross_node_axes") == nlohmann::json::array({"dp"}));
    // ...and every node of the job, heard from through etcd.
    const auto& members = status.at("cluster").at("members");
    REQUIRE(members.size() == 2);
    for (int node = 0; node < 2; ++node) {
      CAPTURE(members[node].dump());
      CHECK(members[node].at("node") == node_name(node));
      CHECK(members[node].at("address") == fmt::format("127.0.0.{}", node + 1));
      CHECK(members[node].at("first_rank") == 2 * node);
      CHECK(members[node].at("health") != "not heard from");
    }
    // keelctl inject names ranks globally: node 0 runs ranks 0 and 1 only.
    daemon::Request inject;
    inject.command = daemon::Command::kInject;
    inject.fault.kind = "slow";
    inject.fault.rank = 2;
    inject.fault.factor = 2.0;
    const auto refused = daemon::call_daemon(job.socket(0), inject, std::chrono::seconds(10));
    CAPTURE(refused.dump());
    CHECK(refused.at("ok") == false);
    CHECK(refused.dump().find("rank 2 runs on node 'node-1', not on this one") != std::string::npos);
    // keelctl health on a node shows every rank of the job, with its node.
    const auto health = job.ask(0, daemon::Command::kHealth);
    REQUIRE(health.at("ranks").size() == 4);
    CHECK(health.at("ranks")[2].at("rank") == 2);
    CHECK(health.at("ranks")[2].at("node") == node_name(1));
    CHECK(health.at("nodes") == nlohmann::json::array({node_name(0), node_name(1)}));
    // Nothing of the running job was lost: one generation, still training,
    // and stopped with its final checkpoint.
    const int64_t step = job.status(0).at("step");
    CHECK(job.status(0).at("state") == "running");
    for (auto& keeld : keelds) keeld->signal(SIGTERM);
    require_finished(keelds);
    for (int node = 0; node < 2; ++node) {
      CHECK(job.events_of(node, "generation_joined").size() == 1);
      CHECK(job.events_of(node, "rank_failed").empty());
    }
    // Every step trained once, from step 0 to past where the table ended.
    const auto losses = job.losses();
    CHECK(static_cast<int64_t>(losses.size()) >= step);
    CHECK(losses.rbegin()->first + 1 == static_cast<int64_t>(losses.size()));
    CHECK(job.events_of(0, "job_stopped").size() == 1);
  }

  TEST_CASE(
      "a node killed with its keeld leaves the job to train on two nodes and it grows back when the node returns with "
      "the loss of the uninterrupted run") {
    const auto [victim, survivor] = two_nodes();
    INFO("the node killed: " << victim);
    ThreeNodes run;
    if (!run.start(survivor, kEndless)) return;
    auto& job = *run.job;
    auto& keelds = run.keelds;
    // keeld and its ranks, as a node that loses power: the ranks die with
    // keeld (PR_SET_PDEATHSIG), and nobody revokes its lease.
    keelds[victim]->signal(SIGKILL);
    keelds[victim]->wait(60);
    const auto shrunk = job.wait_for(survivor, [](const nlohmann::json& s) { return running_on(s, 2); });
    CHECK(shrunk.at("cluster").at("world") == 4);
    // The node comes back under its name; the job takes it in at a checkpoint.
    keelds[victim] = job.start(victim);
    job.wait_for(survivor, [](const nlohmann::json& s) { return running_on(s, 3); });
    run.stop();
    // The generations of a survivor: three nodes, two, and three again.
    std::vector<size_t> sizes;
    for (const auto& e : job.events_of(survivor, "generation_joined")) sizes.push_back(e.at("nodes").size());
    CAPTURE(nlohmann::json(sizes).dump());
    REQUIRE(sizes.size() >= 3);
    CHECK(sizes.front() == 3);
    CHECK(std::find(sizes.begin(), sizes.end(), 2) != sizes.end());
    CHECK(sizes.back() == 3);
    // On two nodes the batch was the same, in two microbatches a rank.
    for (const auto& e : job.events_of(survivor, "generation_joined")) {
      if (e.at("nodes").size() == 2) CHECK(e.at("micro_batches") == 2);
    }
    // Resumed from a checkpoint, never from the start.
    const auto resumed = job.events_of(survivor, "generation_resumed");
    for (size_t g = 1; g < resumed.size(); ++g) CHECK(resumed[g].at("step") > 0);
    check_losses_close(job);
  }

  TEST_CASE("a keeld restarted at once on one node rejoins and the job goes on to the loss of the uninterrupted run") {
    const auto [restarted, other] = two_nodes();
    INFO("the node whose keeld restarts: " << restarted);
    ThreeNodes run;
    if (!run.start(other, kEndless)) return;
    auto& job = *run.job;
    auto& keelds = run.keelds;
    const size_t generations_before = job.events_of(other, "generation_joined").size();
    // As systemd's Restart= does: the old keeld is gone with its ranks,
    // and a new one starts under the same name while its lease still runs.
    keelds[restarted]->signal(SIGKILL);
    keelds[restarted]->wait(60);
    keelds[restarted] = job.start(restarted);
    // Back on three nodes in a later generation.
    job.wait_for(other, [&](const nlohmann::json& s) {
      return running_on(s, 3) && job.events_of(other, "generation_joined").size() > generations_before;
    });
    run.stop();
    const auto joined = job.events_of(other, "generation_joined");
    REQUIRE(joined.size() >= 2);
    CHECK(joined.back().at("nodes").size() == 3);
    // Resumed from a checkpoint, never from the start.
    const auto resumed = job.events_of(other, "generation_resumed");
    for (size_t g = 1; g < resumed.size(); ++g) CHECK(resumed[g].at("step") > 0);
    check_losses_close(job);
  }

  TEST_CASE(
      "a node lost and back takes its ranks' snapshots from its buddy's memory and the job resumes from memory to "
      "the loss of the uninterrupted run") {
    // The buddy of a node is the next one in the generation's order.
    const auto [lost, buddy] = two_nodes();
    INFO("the node lost: " << lost);
    std::vector<std::string> sets = kEndless;
    // Three nodes or none, so that the job waits for the lost one rather
    // than reshard to two from disk; a snapshot every step, and copies paced
    // so slowly that each takes several steps (CI's loaded cores did that to
    // a run whose copies took less than a step here); disk checkpoints far
    // enough apart for the copies to be newer than the last.
    constexpr int64_t kEvery = 20;
    sets.insert(sets.end(), {"cluster.min_nodes=3", "checkpoint.memory_every_steps=1", "daemon.metrics_port=0",
                             "checkpoint.memory_buddy_mb_per_s=0.2", fmt::format("checkpoint.every_steps={}", kEvery)});
    ThreeNodes run;
    if (!run.start(buddy, sets)) return;
    auto& job = *run.job;
    // The buddy holds copies of both of the lost node's ranks, newer than
    // the last checkpoint, and the ranks have taken more snapshots since
    // than an area keeps (memory_keep, 2), a few steps before the next
    // checkpoint.
    int64_t copied = -1;
    const auto holding = job.wait_for(buddy, [&](const nlohmann::json& s) {
      copied = copied_step_of(s, lost);
      const int64_t step = s.at("step"), last_checkpoint = step / kEvery * kEvery;
      return copied > last_checkpoint && s.at("snapshot_copies").at("sent").size() == 2 && step > copied + 2 &&
             step < last_checkpoint + kEvery - 4;
    });
    // keelctl status says so.
    std::ostringstream text;
    daemon::print_status(holding, text);
    INFO(text.str());
    CHECK(text.str().find(fmt::format("holds rank {} step", 2 * lost)) != std::string::npos);
    CHECK(text.str().find(fmt::format("to '{}'", node_name((buddy + 1) % 3))) != std::string::npos);
    // And /metrics, how far each copy trails its rank.
    const auto page = scrape(holding.at("metrics_port").get<uint16_t>());
    REQUIRE(page.count("keel_snapshot_copy_lag_steps") == 1);
    CHECK(page.at("keel_snapshot_copy_lag_steps").size() == 2);
    for (const auto& sample : page.at("keel_snapshot_copy_lag_steps")) CHECK(sample.value >= 0);
    const size_t resumes_before = job.events_of(0, "generation_resumed").size();
    // The node is gone with its keeld, its ranks and their snapshot areas,
    // and comes back under its name with nothing in memory.
    run.keelds[lost]->signal(SIGKILL);
    run.keelds[lost]->wait(60);
    run.keelds[lost] = job.start(lost);
    const auto resumed = next_resume(job, resumes_before);
    INFO(resumed.dump());
    CHECK(resumed.at("from") == "memory");
    CHECK(resumed.at("step").get<int64_t>() >= copied);
    const auto fetched = job.events_of(lost, "snapshots_fetched");
    REQUIRE(!fetched.empty());
    INFO(fetched.back().dump());
    CHECK(fetched.back().at("problems").empty());
    REQUIRE(fetched.back().at("filled").size() == 2);
    for (const auto& filled : fetched.back().at("filled")) CHECK(filled.at("from") == node_name(buddy));
    MESSAGE("the lost node's areas were filled from its buddy in " << fetched.back().at("seconds") << " s");
    // Trained on past the step it resumed from, on every node.
    const int64_t from = resumed.at("step").get<int64_t>();
    job.wait_for(buddy, [&](const nlohmann::json& s) { return running_on(s, 3) && s.at("step") > from + 5; });
    run.stop();
    check_losses_close(job, 0);
  }

  TEST_CASE(
      "a spare in a lost node's place and the node whose ranks it takes both fill their areas from the copies and "
      "the job resumes from memory to the loss of the uninterrupted run") {
    std::vector<std::string> sets = kEndless;
    sets.insert(sets.end(), {"cluster.min_nodes=3", "checkpoint.memory_every_steps=1"});
    ThreeNodes run;
    if (!run.start(0, sets)) return;
    auto& job = *run.job;
    // node-1 is lost for good and node-3 comes instead. The order becomes
    // node-0, node-2, node-3: node-2 runs the lost node's ranks 2 and 3,
    // whose copies it holds as its buddy, and node-3 runs node-2's ranks 4
    // and 5, whose copies node-0 holds.
    job.wait_for(2, [](const nlohmann::json& s) { return copied_step_of(s, 1) > 10; });
    job.wait_for(0, [](const nlohmann::json& s) { return copied_step_of(s, 2) > 10; });
    const size_t resumes_before = job.events_of(0, "generation_resumed").size();
    run.keelds[1]->signal(SIGKILL);
    run.keelds[1]->wait(60);
    run.keelds[1] = job.start(3);
    const auto resumed = next_resume(job, resumes_before);
    INFO(resumed.dump());
    CHECK(resumed.at("from") == "memory");
    // Nothing of the ranks' old numbering is left to look at.
    CHECK(resumed.value("why", "").empty());
    for (const auto& [node, from] : {std::pair{2, std::string("this node")}, {3, node_name(0)}}) {
      const auto fetched = job.events_of(node, "snapshots_fetched");
      REQUIRE(!fetched.empty());
      INFO(fetched.back().dump());
      CHECK(fetched.back().at("problems").empty());
      REQUIRE(fetched.back().at("filled").size() == 2);
      for (const auto& filled : fetched.back().at("filled")) CHECK(filled.at("from") == from);
    }
    const int64_t step = resumed.at("step").get<int64_t>();
    job.wait_for(0, [&](const nlohmann::json& s) { return running_on(s, 3) && s.at("step") > step + 5; });
    run.stop();
    check_losses_close(job, 0);
  }

  TEST_CASE(
      "a hang injected in a rank of one node is found with the other nodes' boards and named on every node and the job "
      "ends with the fault-free model") {
    TempDir etcd_dir;
    auto etcd = start_etcd_or_skip(etcd_dir.path());
    if (!etcd) return;
    KeeldJob alone(kKeeldJobConfig);
    alone.run(full_layout({"checkpoint.every_steps=4"}));
    // Rank 4 runs on node 2; its DP peers, ranks 0 and 2, on nodes 0 and 1.
    const int culprit = 4;
    std::vector<std::string> sets = kFastHealth;
    // The hung rank ignores SIGTERM; its node kills it at once whichever
    // node's verdict ended the generation, and is back within an 8 s join
    // timeout, which a wait for SIGTERM's 10 s grace would miss: the next
    // generation has all three nodes and the model stays DP3's.
    sets.insert(sets.end(), {fmt::format("faults.hang_rank={}", culprit), "faults.hang_step=12", "faults.hang_group=dp",
                             "cluster.join_timeout_s=8"});
    ClusterJob job(*etcd, 3, sets);
    auto keelds = start_all(job);
    require_finished(keelds);
    std::ifstream log(job.run_dir(2) / "logs" / fmt::format("rank-{:05d}.log", culprit));
    const std::string rank_log((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    CHECK(rank_log.find("hang_group = dp): this rank stops") != std::string::npos);  // the fault landed
    // Whichever node's detector got there first ended the generation; every
    // node's record of that end names the rank.
    int findings = 0;
    for (int node = 0; node < 3; ++node) {
      CAPTURE(node);
      const auto hangs = job.events_of(node, "hang_detected");
      for (const auto& hang : hangs) {
        INFO(hang.dump());
        CHECK(hang.at("culprit_ranks") == nlohmann::json::array({culprit}));
        CHECK(hang.at("culprit_nodes") == nlohmann::json::array({node_name(2)}));
        CHECK(hang.at("detect_s").get<double>() <= kCeilingS + 2);
        ++findings;
      }
      std::ifstream in(job.run_dir(node) / "events.jsonl");
      const std::string events((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      const bool named = events.find(fmt::format("rank {} never began", culprit)) != std::string::npos &&
                         events.find(fmt::format("[on node {}]", node_name(2))) != std::string::npos;
      CHECK_MESSAGE(named, "node " << node << " did not learn that rank " << culprit << " of node 2 hung:\n" << events);
      CHECK(job.events_of(node, "generation_joined").size() == 2);
    }
    CHECK(findings >= 1);
    require_identical(alone.checkpoint_tensors(40), checkpoint_tensors(job.checkpoints(), 40));
  }

  TEST_CASE("a node that comes back after the job finished on the others ends finished at once") {
    TempDir etcd_dir;
    auto etcd = start_etcd_or_skip(etcd_dir.path());
    if (!etcd) return;
    ClusterJob job(*etcd, 3);
    // Two of three nodes: min_nodes = 2 seals them after the join timeout.
    std::vector<std::unique_ptr<ChildProcess>> keelds;
    for (int node = 0; node < 2; ++node) keelds.push_back(job.start(node));
    require_finished(keelds);
    // The third node's keeld, as systemd starts it when the machine is back.
    const auto late = job.start(2)->wait(120);
    INFO(late.output);
    CHECK(late.exit_code == 0);
    const auto finished = job.events_of(2, "job_finished");
    REQUIRE(finished.size() == 1);
    CHECK(finished[0].at("elsewhere").get<std::string>().find("node-0, node-1") != std::string::npos);
    CHECK(finished[0].at("checkpoint_step") == 40);
    CHECK(job.events_of(2, "generation_started").empty());
  }

  TEST_CASE("the etcd leader killed mid-run costs the job no restart and it ends bit-identical") {
    KeeldJob alone(kKeeldJobConfig);
    alone.run(full_layout(kLongRun));
    ThreeNodes run;
    if (!run.start(0, kLongRun)) return;
    const int leader = run.etcd->leader();
    REQUIRE(leader >= 0);
    run.etcd->kill(leader);
    INFO("etcd member killed: " << leader);
    require_finished(run.keelds);
    for (int node = 0; node < 3; ++node) {
      CHECK(run.job->events_of(node, "generation_joined").size() == 1);
      CHECK(run.job->events_of(node, "rank_failed").empty());
    }
    require_identical(alone.checkpoint_tensors(300), checkpoint_tensors(run.job->checkpoints(), 300));
  }
}

}  // namespace keel::test
