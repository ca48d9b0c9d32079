// The nodes' boards, shared through etcd (docs/architecture.md "Multi-node on
// etcd": detectors across nodes). Once a period this keeld puts the newest
// summary of its own ranks (health/board_summary.h) under `health/<node>`,
// under the node's lease so that it ends with the node, and reads every
// other node's. etcd waits happen on a thread of their own: keeld's loop
// only offers its summary and takes what was received, without blocking.
//
// Traffic: one put and one range read a period per node, each summary about
// 1.7 KiB a rank: 1,000 ranks on 125 nodes put 1.7 MB/s into etcd and each
// keeld reads as much.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "common/clock.h"
#include "health/board_summary.h"
#include "store/store.h"

namespace keel::daemon {

// What was heard of each other node: its newest summary, decoded when it
// first came (NodeSummary::as_of_ns, on `clock`), by node name.
using RemoteSummaries = std::map<std::string, std::shared_ptr<const health::NodeSummary>>;

class HealthExchange {
 public:
  // `lease` says the node's lease now (it changes when a lost one is taken
  // again); `clock` times the summaries received.
  HealthExchange(store::ClusterStore& store, std::string node_name, std::function<store::ClusterStore::LeaseId()> lease,
                 const common::Clock& clock, std::chrono::milliseconds period = std::chrono::seconds(1));
  // Stops the thread within a period and an etcd call.
  ~HealthExchange();
  HealthExchange(const HealthExchange&) = delete;
  HealthExchange& operator=(const HealthExchange&) = delete;

  // This node's newest summary; the thread publishes the newest offered.
  void offer(std::string summary);
  // Every other node's newest summary that etcd holds (a node whose lease
  // ended is gone from it).
  RemoteSummaries received() const;

 private:
  void run();
  void exchange_once();

  store::ClusterStore& store_;
  const std::string node_name_;
  const std::function<store::ClusterStore::LeaseId()> lease_;
  const common::Clock& clock_;
  const std::chrono::milliseconds period_;

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::optional<std::string> offered_;  // not published yet
  RemoteSummaries received_;  // written by the thread only, under mutex_
  std::map<std::string, int64_t> revisions_;  // the thread's own: the etcd revision of each node's summary decoded
  std::set<std::string> unreadable_;          // the thread's own: nodes whose summary did not decode, logged once
  std::string failing_;                       // the thread's own: the last failure logged, so it is logged once
  std::thread thread_;
};

}  // namespace keel::daemon
