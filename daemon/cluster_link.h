// keeld's side of the rendezvous (docs/architecture.md "Multi-node on
// etcd"). Every Rendezvous call waits on etcd, and keeld's event loop must
// wait on nothing, so they run here on threads of their own (joins and
// watches on one; failures and finishes, which must not wait behind a
// watch, on another): the job asks for the next generation or reports a
// failure without blocking, and what the threads learn comes back as a
// function `post`ed to the loop, where the Job takes it as an input like a
// rank's exit.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <variant>

#include "cluster/rendezvous.h"

namespace keel::daemon {

struct ClusterCallbacks {
  // A generation's membership, with this node in it.
  std::function<void(cluster::Membership)> joined;
  // Why no membership came within the join timeout (or the join failed).
  std::function<void(std::string)> join_failed;
  // What ends generation `generation` (the one last joined), or asks it to grow.
  std::function<void(int64_t generation, cluster::GenerationEvent)> event;
};

class ClusterLink {
 public:
  // Takes the node's name and lease (cluster::Rendezvous's constructor, so
  // it blocks and throws as that does) and starts the thread. `post` runs a
  // function on keeld's event loop; the callbacks run there.
  ClusterLink(store::ClusterStore& store, cluster::RendezvousOptions options,
              std::function<void(std::function<void()>)> post, ClusterCallbacks callbacks);
  // Cancels a join under way and stops the thread within about a second,
  // once it has recorded the failures and finishes asked for, then gives up
  // the node's lease.
  ~ClusterLink();
  ClusterLink(const ClusterLink&) = delete;
  ClusterLink& operator=(const ClusterLink&) = delete;

  // Ends generation `ended` with `cause` (none for the first join), then
  // joins the next; joined() or join_failed() follows.
  void join_next(std::optional<int64_t> ended, std::string cause);
  // Ends `generation` with `failure` for every node: a failure seen here.
  // The ranks of every node get the generation's first cause as its
  // rank_failed record (store::rank_failed_key), so none waits for the
  // failed ones. `then` runs on the loop once etcd has it (or could not be
  // told): a node that kills ranks on a verdict kills them after, so that
  // the peers' failures that follow do not come first in etcd.
  void fail(int64_t generation, cluster::GenerationFailure failure, std::function<void()> then = {});

  // This node's ranks finished the job in `generation`: its leaving ends
  // nothing (cluster::Rendezvous::finish).
  void finish(int64_t generation);

  const std::string& node_name() const { return node_name_; }

  // False once etcd forgot this node (cut off for longer than its lease).
  bool alive() const { return rendezvous_->alive(); }
  std::optional<std::chrono::steady_clock::time_point> unreachable_since() const {
    return rendezvous_->unreachable_since();
  }
  // The node's lease (cluster::Rendezvous::lease); any thread may ask.
  store::ClusterStore::LeaseId lease() const { return rendezvous_->lease(); }

 private:
  struct Join {
    std::optional<int64_t> ended;
    std::string cause;
  };
  struct Fail {
    int64_t generation;
    cluster::GenerationFailure failure;
    std::function<void()> then;
  };
  struct Finish {
    int64_t generation;
  };
  using Command = std::variant<Join, Fail, Finish>;
  void push(Command command);

  // Joins and watches, on thread_; failures and finishes, short writes
  // that must not wait behind a watch, on writer_.
  void run();
  void write_until_stopped();
  void carry_out(const Command& command);
  // Rendezvous::fail; when another cause came first, the job hears it as a
  // kEndedBefore event. Returns the first cause.
  std::string fail_generation(int64_t generation, const cluster::GenerationFailure& failure);
  // Watches the membership last joined for what ends it, for a while.
  void watch_membership();

  store::ClusterStore& store_;
  std::string node_name_;
  std::unique_ptr<cluster::Rendezvous> rendezvous_;
  // How long a join may take in all: the join timeout after which it seals
  // with fewer nodes, twice (the generation may move on once meanwhile),
  // and the time a dead node's lease takes to end.
  std::chrono::milliseconds join_bound_;
  std::function<void(std::function<void()>)> post_;
  ClusterCallbacks callbacks_;

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Command> commands_;  // joins
  std::deque<Command> writes_;    // failures and finishes
  bool stop_ = false;
  std::optional<cluster::Membership> watched_;  // the thread's own: the generation it watches
  bool watch_failing_ = false;                  // the thread's own: the last watch failed
  std::thread thread_;
  std::thread writer_;
};

}  // namespace keel::daemon
