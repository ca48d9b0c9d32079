#include "daemon/health_exchange.h"

#include "common/thread_name.h"

#include <exception>
#include <set>

#include "common/log.h"

namespace keel::daemon {
namespace {

constexpr const char* kHealthPrefix = "health/";

}  // namespace

HealthExchange::HealthExchange(store::ClusterStore& store, std::string node_name,
                               std::function<store::ClusterStore::LeaseId()> lease, const common::Clock& clock,
                               std::chrono::milliseconds period)
    : store_(store),
      node_name_(std::move(node_name)),
      lease_(std::move(lease)),
      clock_(clock),
      period_(period),
      thread_(common::named_thread("keel-health-ex", [this] { run(); })) {}

HealthExchange::~HealthExchange() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void HealthExchange::offer(std::string summary) {
  std::lock_guard<std::mutex> lock(mutex_);
  offered_ = std::move(summary);
}

RemoteSummaries HealthExchange::received() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return received_;
}

void HealthExchange::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    wake_.wait_for(lock, period_, [this] { return stop_; });
    if (stop_) return;
    lock.unlock();
    exchange_once();
    lock.lock();
  }
}

void HealthExchange::exchange_once() {
  auto log = common::logger("cluster");
  std::optional<std::string> summary;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    summary.swap(offered_);
  }
  std::string failure;
  try {
    if (summary) store_.set_with_lease(kHealthPrefix + node_name_, *summary, lease_());
    const auto listing = store_.list(kHealthPrefix);
    // Only this thread writes received_, so it reads it without the lock.
    RemoteSummaries next;
    for (const auto& entry : listing.entries) {
      const std::string node = entry.key.substr(std::string(kHealthPrefix).size());
      if (node == node_name_) continue;
      auto held = received_.find(node);
      if (held != received_.end() && revisions_[node] == entry.revision) {
        next.emplace(node, held->second);  // unchanged: its age goes on from when it came
        continue;
      }
      auto decoded = health::decode_summary(entry.value, clock_.now_ns());
      if (!decoded) {
        if (unreadable_.insert(node).second) {
          log->warn(
              "node '{}''s health summary in etcd is no summary this keeld reads (another keel version?); "
              "its ranks are unknown to this node's detectors",
              node);
        }
        continue;
      }
      unreadable_.erase(node);
      revisions_[node] = entry.revision;
      next.emplace(node, std::make_shared<const health::NodeSummary>(std::move(*decoded)));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    received_ = std::move(next);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  if (failure != failing_) {
    if (!failure.empty()) {
      log->warn(
          "cannot exchange health summaries through etcd ({}); other nodes' ranks become unknown to this "
          "node's detectors until it can",
          failure);
    } else {
      log->info("health summaries flow through etcd again");
    }
    failing_ = failure;
  }
}

}  // namespace keel::daemon
