// Many nodes as one job on one machine (docs/architecture.md "Multi-node on
// etcd"), as tests/daemon/keeld_cluster_test.cpp and the timing tests run
// it: keelds that are nodes of one job on a real etcd, each with its own
// run directory, control socket and address, sharing the checkpoint
// directory as nodes share a filesystem.
#pragma once

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "daemon/protocol.h"
#include "tests/daemon/keeld_job.h"
#include "tests/support/etcd_test_cluster.h"

namespace keel::test {

// keeld_job.h's job as three nodes of two ranks: DP3 x TP2 on max_nodes =
// 3, which trains on 2 while one is away.
inline const std::vector<std::string> kCluster = {"parallel.dp=3",         "train.batch_size=12", "checkpoint.every_steps=4",
                                           "checkpoint.keep=3",     "daemon.ranks=2",      "daemon.metrics_port=-1",
                                           "daemon.pin_cpus=false", "cluster.min_nodes=2", "cluster.join_timeout_s=4"};

inline std::string node_name(int node) { return fmt::format("node-{}", node); }

class ClusterJob {
 public:
  // `sets`: overrides every node's keeld gets.
  ClusterJob(const EtcdCluster& etcd, int nodes, std::vector<std::string> sets = {})
      : etcd_(etcd), nodes_(nodes), sets_(std::move(sets)) {
    write_pattern_shard(dir_ / "train.bin", 30000);
    config_ = dir_.write("job.toml", kKeeldJobConfig);
  }

  std::filesystem::path run_dir(int node) const { return dir_ / node_name(node); }
  std::string socket(int node) const { return (dir_ / (node_name(node) + ".sock")).string(); }
  std::filesystem::path checkpoints() const { return dir_ / "checkpoints"; }
  std::filesystem::path write(const std::string& name, const std::string& text) const { return dir_.write(name, text); }

  // keeld of node `node`; `extra` overrides follow the node's own, and
  // `prefix` comes before the command (a network namespace's).
  std::unique_ptr<ChildProcess> start(int node, const std::vector<std::string>& extra = {},
                                      const std::vector<std::string>& prefix = {}) const {
    std::vector<std::string> sets = kCluster;
    sets.insert(
        sets.end(),
        {fmt::format("checkpoint.dir={}", checkpoints().string()),
         fmt::format("job.run_dir={}", run_dir(node).string()), fmt::format("daemon.socket={}", socket(node)),
         fmt::format("cluster.node_name={}", node_name(node)), fmt::format("cluster.address=127.0.0.{}", node + 1)});
    // keeld takes etcd's TLS files from [cluster], not in the address.
    const std::string address = etcd_.address("keel/cluster-test");
    sets.push_back("cluster.etcd=" + address.substr(0, address.find('?')));
    if (const auto tls = etcd_.client_tls(); tls.on()) {
      sets.insert(sets.end(), {"cluster.tls_ca_file=" + tls.ca_file, "cluster.tls_cert_file=" + tls.cert_file,
                               "cluster.tls_key_file=" + tls.key_file});
    }
    sets.insert(sets.end(), sets_.begin(), sets_.end());
    sets.insert(sets.end(), extra.begin(), extra.end());
    std::vector<std::string> argv = prefix;
    argv.insert(argv.end(), {keel_binary("keeld").string(), "--config", config_.string(), "--foreground"});
    for (const auto& s : sets) {
      argv.push_back("--set");
      argv.push_back(s);
    }
    return std::make_unique<ChildProcess>(argv);
  }

  nlohmann::json ask(int node, daemon::Command command) const {
    daemon::Request request;
    request.command = command;
    return daemon::call_daemon(socket(node), request, std::chrono::seconds(10));
  }
  nlohmann::json status(int node) const { return ask(node, daemon::Command::kStatus); }

  // Polls node `node`'s status until `done`; fails after `timeout_s`.
  nlohmann::json wait_for(int node, const std::function<bool(const nlohmann::json&)>& done,
                          double timeout_s = 180) const {
    nlohmann::json last;
    const bool got_there = wait_until(
        [&] {
          try {
            last = status(node);
            return done(last);
          } catch (const daemon::DaemonUnreachable&) {
            return false;  // not up yet, or gone
          }
        },
        timeout_s);
    INFO("node " << node << "'s last status: " << last.dump());
    REQUIRE(got_there);
    return last;
  }

  // The events of every node's events.jsonl of `kind`.
  std::vector<nlohmann::json> events_of(int node, const std::string& kind) const {
    std::vector<nlohmann::json> out;
    std::ifstream in(run_dir(node) / "events.jsonl");
    for (std::string line; std::getline(in, line);) {
      auto e = nlohmann::json::parse(line);
      if (e.at("kind") == kind) out.push_back(e);
    }
    return out;
  }

  // Step -> loss, from every node's metrics.jsonl (rank 0's node writes
  // it; which node that is depends on the generation), the newest record
  // of a step winning.
  std::map<int64_t, double> losses() const {
    std::map<int64_t, double> out;
    for (int node = 0; node < nodes_; ++node) {
      std::ifstream in(run_dir(node) / "metrics.jsonl");
      for (std::string line; std::getline(in, line);) {
        auto record = nlohmann::json::parse(line);
        if (record.contains("loss") && record.contains("step")) {
          out[record.at("step").get<int64_t>()] = record.at("loss").get<double>();
        }
      }
    }
    return out;
  }

 private:
  const EtcdCluster& etcd_;
  int nodes_;
  std::vector<std::string> sets_;
  TempDir dir_;
  std::filesystem::path config_;
};

inline int nodes_in(const nlohmann::json& status) {
  const auto& cluster = status.at("cluster");
  return cluster.is_null() ? 0 : static_cast<int>(cluster.at("nodes").size());
}

inline bool running_on(const nlohmann::json& status, int nodes) {
  return status.at("state") == "running" && nodes_in(status) == nodes;
}

// Every node's keeld.
inline std::vector<std::unique_ptr<ChildProcess>> start_all(const ClusterJob& job, int nodes = 3) {
  std::vector<std::unique_ptr<ChildProcess>> keelds;
  for (int node = 0; node < nodes; ++node) keelds.push_back(job.start(node));
  return keelds;
}

// Waits for every keeld to end with the job finished.
inline void require_finished(std::vector<std::unique_ptr<ChildProcess>>& keelds) {
  for (size_t node = 0; node < keelds.size(); ++node) {
    auto result = keelds[node]->wait(300);
    INFO("node " << node << ": " << result.output);
    CHECK(result.exit_code == 0);
  }
}

// Endless, and stopped on purpose once a node is back: its return must not
// race the job's end.
inline const std::vector<std::string> kEndless = {"train.steps=1000000", "checkpoint.every_steps=10"};

}  // namespace keel::test
