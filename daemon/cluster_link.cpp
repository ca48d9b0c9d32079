#include "daemon/cluster_link.h"

#include "common/log.h"
#include "common/thread_name.h"
#include "store/store.h"

namespace keel::daemon {

namespace {
// How long one watch of the membership lasts before the thread looks at
// its commands again.
constexpr std::chrono::milliseconds kWatchSlice{500};
}  // namespace

ClusterLink::ClusterLink(store::ClusterStore& store, cluster::RendezvousOptions options,
                         std::function<void(std::function<void()>)> post, ClusterCallbacks callbacks)
    : store_(store),
      node_name_(options.node_name),
      join_bound_(2 * options.join_timeout +
                  2 * std::chrono::duration_cast<std::chrono::milliseconds>(options.lease_ttl)),
      post_(std::move(post)),
      callbacks_(std::move(callbacks)) {
  rendezvous_ = std::make_unique<cluster::Rendezvous>(store, std::move(options));
  thread_ = common::named_thread("keel-link", [this] { run(); });
  writer_ = common::named_thread("keel-link-write", [this] { write_until_stopped(); });
}

ClusterLink::~ClusterLink() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  rendezvous_->cancel();
  wake_.notify_all();
  thread_.join();
  writer_.join();
}

void ClusterLink::push(Command command) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    (std::holds_alternative<Join>(command) ? commands_ : writes_).push_back(std::move(command));
  }
  wake_.notify_all();
}

void ClusterLink::join_next(std::optional<int64_t> ended, std::string cause) { push(Join{ended, std::move(cause)}); }

void ClusterLink::fail(int64_t generation, cluster::GenerationFailure failure, std::function<void()> then) {
  push(Fail{generation, std::move(failure), std::move(then)});
}

void ClusterLink::finish(int64_t generation) { push(Finish{generation}); }

void ClusterLink::run() {
  for (;;) {
    std::optional<Command> command;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      // With a membership to watch, the wait is the watch itself.
      if (!watched_) wake_.wait(lock, [this] { return stop_ || !commands_.empty(); });
      if (stop_) return;  // a join no longer matters
      if (!commands_.empty()) {
        command = std::move(commands_.front());
        commands_.pop_front();
      }
    }
    if (command) {
      carry_out(*command);
    } else {
      watch_membership();
    }
  }
}

void ClusterLink::write_until_stopped() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [this] { return stop_ || !writes_.empty(); });
    // What the other nodes must learn before this one goes is written
    // before the thread ends.
    if (writes_.empty()) return;
    Command command = std::move(writes_.front());
    writes_.pop_front();
    lock.unlock();
    carry_out(command);
    lock.lock();
  }
}

void ClusterLink::carry_out(const Command& command) {
  auto log = common::logger("cluster");
  if (const auto* f = std::get_if<Finish>(&command)) {
    try {
      rendezvous_->finish(f->generation);
    } catch (const std::exception& e) {
      log->warn("could not record in etcd that this node finished generation {}: {}", f->generation, e.what());
    }
    return;
  }
  if (const auto* f = std::get_if<Fail>(&command)) {
    try {
      const std::string first = fail_generation(f->generation, f->failure);
      // The ranks of every node read why; the first cause is the one that explains the rest.
      store_.set(store::rank_failed_key(f->generation), first);
    } catch (const std::exception& e) {
      // The other nodes still learn of it: their collectives with this
      // node's ranks fail, and this node's lease ends if it is cut off.
      log->warn("could not record in etcd that generation {} failed ({}): {}", f->generation, f->failure.cause,
                e.what());
    }
    if (f->then) post_(f->then);
    return;
  }
  const auto& join = std::get<Join>(command);
  watched_.reset();
  try {
    if (join.ended) fail_generation(*join.ended, {join.cause});
    cluster::Membership membership = rendezvous_->join(join_bound_);
    if (!membership.job_finished) watched_ = membership;
    post_([this, membership] { callbacks_.joined(membership); });
  } catch (const std::exception& e) {
    std::string why = e.what();
    post_([this, why] { callbacks_.join_failed(why); });
  }
}

std::string ClusterLink::fail_generation(int64_t generation, const cluster::GenerationFailure& failure) {
  std::string first = rendezvous_->fail(generation, failure).cause;
  if (first != failure.cause) {
    post_([this, generation, first] {
      callbacks_.event(generation, cluster::GenerationEvent{cluster::GenerationEvent::kEndedBefore, first});
    });
  }
  return first;
}

void ClusterLink::watch_membership() {
  auto log = common::logger("cluster");
  try {
    auto event = rendezvous_->next_event(*watched_, kWatchSlice);
    if (watch_failing_) log->info("watching generation {} in etcd again", watched_->generation);
    watch_failing_ = false;
    if (!event) return;
    post_([this, g = watched_->generation, e = *event] { callbacks_.event(g, e); });
    // After its end nothing more of a generation matters.
    if (event->kind == cluster::GenerationEvent::kEnded) watched_.reset();
  } catch (const std::exception& e) {
    // etcd unreachable for now: the ranks train on (docs/architecture.md
    // "Multi-node on etcd"); the lease's renewer says when it comes back.
    // Said once an outage, not twice a second through it.
    log->log(watch_failing_ ? spdlog::level::debug : spdlog::level::warn, "cannot watch generation {} in etcd: {}",
             watched_->generation, e.what());
    watch_failing_ = true;
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait_for(lock, kWatchSlice, [this] { return stop_ || !commands_.empty(); });
  }
}

}  // namespace keel::daemon
