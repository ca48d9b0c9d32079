// How the keelds of many nodes become one job (docs/architecture.md
// "Multi-node on etcd: the design being built"): they join a generation in
// etcd, one of them seals its membership by compare-and-set, and every one
// of them reads the same sorted node list, so that node ranks agree without
// a leader. A node's lease is its liveness; a generation ends when its
// counter is bumped (by compare-and-set, so once however many keelds see the
// same failure).
//
// Keys, under the job's store prefix:
//   rdzv/generation          the current generation, decimal
//   rdzv/config              RendezvousOptions::job_config of the job's nodes
//   rdzv/nodes/<name>        a node's record, under its lease
//   rdzv/g<g>/join/<name>    who joined generation g, under their leases
//   rdzv/g<g>/members        g's sealed membership: a JSON list of names
//   rdzv/g<g>/failed         why g ended (the first cause recorded)
//   rdzv/g<g>/done/<name>    a node whose ranks finished the job in g
//   rdzv/waiting/<name>      a node that came after the seal, under its lease
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "store/store.h"

namespace keel::cluster {

struct RendezvousOptions {
  std::string node_name;  // unique in the job: the host name by default
  std::string address;    // what this node's ranks bind for Gloo and NCCL
  // Where this node's keeld takes copies of another node's in-memory
  // snapshots (daemon/snapshot_buddy.h), "address:port"; empty: it does not.
  std::string snapshot_endpoint;
  int ranks_per_node = 1;
  int min_nodes = 1;
  int max_nodes = 1;
  // How long a join waits for max_nodes before it seals with fewer.
  std::chrono::milliseconds join_timeout{30000};
  std::chrono::seconds lease_ttl{5};
  // What every node of the job must agree on, as a JSON object of objects
  // (sections of the config); empty: not checked. A node whose config
  // differs from the one the job's live nodes recorded is refused.
  std::string job_config;
  // Whether the job can run on this many nodes (the layout's DP must divide
  // the world, and the global batch); the seal takes the most nodes it can.
  std::function<bool(int nodes)> runs_on = [](int) { return true; };
};

// A generation's sealed membership, as every member reads it.
struct Membership {
  int64_t generation = 0;
  std::vector<std::string> nodes;  // sorted; a node's rank is its index
  // Each node's [cluster] address, as its join record says; "" where it
  // could not be read. For operators; nothing is dialed by it.
  std::vector<std::string> addresses;
  // Each node's snapshot endpoint (RendezvousOptions::snapshot_endpoint), as
  // its join record says; "" where it has none or it could not be read.
  std::vector<std::string> snapshot_endpoints;
  int node_rank = 0;               // this node's
  int ranks_per_node = 1;
  int64_t revision = 0;  // where watches of its events start: before its seal, then past each event read
  // The job finished without this node: every member of `generation`
  // recorded it done, under the config this node has. There is nothing to
  // join, and `node_rank` means nothing.
  bool job_finished = false;

  int world_size() const { return static_cast<int>(nodes.size()) * ranks_per_node; }
  int rank_offset() const { return node_rank * ranks_per_node; }
  // The node that runs global rank `rank`; empty for a rank outside the world.
  std::string node_of(int64_t rank) const {
    if (rank < 0 || rank >= world_size()) return "";
    return nodes[static_cast<size_t>(rank / ranks_per_node)];
  }
};

// Why a generation ended, as etcd records it: the first cause wins.
struct GenerationFailure {
  std::string cause;
  // The nodes whose ranks a detector's verdict named (a hang's culprits, a
  // corrupted rank): their keelds kill those ranks at once, as the node that
  // reached the verdict does, rather than wait out a hung rank's grace.
  std::vector<std::string> culprit_nodes;
};

// What ends a generation, or asks for the next one.
struct GenerationEvent {
  enum Kind {
    kEnded,        // the generation was failed: stop the ranks and join the next
    kNodeWaiting,  // a node came after the seal: grow at the next checkpoint
    // This node failed a generation that had ended already: `cause` is
    // what ended it, and what this node saw (a peer gone) followed from it.
    kEndedBefore,
  } kind = kEnded;
  std::string cause;
  std::vector<std::string> culprit_nodes;  // kEnded: GenerationFailure's
};

class Rendezvous {
 public:
  // Takes a lease of `options.lease_ttl` and puts rdzv/nodes/<name> under
  // it; a thread renews it every third of the TTL until destruction, which
  // revokes it. Error(kBadConfig) when another live keeld holds the name,
  // or when the job's live nodes run another job_config (naming what differs).
  Rendezvous(store::ClusterStore& store, RendezvousOptions options);
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  // Joins the current generation and returns its sealed membership with
  // this node in it. A node whose lease expired takes a new one first. A node that finds the generation sealed without it
  // waits (rdzv/waiting/<name>) for the next; one that finds itself in a
  // sealed generation it did not join here (its keeld restarted) fails that
  // generation, whose ranks died with it, and joins the next. Either
  // returns a Membership with job_finished when that generation's every
  // member finished the job with the same config (a job that changed, say
  // more steps, goes on instead).
  // Error(kPeerFailure) after `timeout` naming who joined.
  Membership join(std::chrono::milliseconds timeout);

  // Records `failure` for generation g (the first one wins) and moves the
  // generation from g to g + 1 (only if it is still g). Returns the failure
  // recorded, which is another keeld's when it was first.
  GenerationFailure fail(int64_t generation, const GenerationFailure& failure);

  // Records that this node's ranks finished the job in `generation`, with
  // the job's config, so that its leaving (its lease revoked as keeld exits)
  // ends nothing for the nodes whose ranks are finishing the same last
  // step, and a node that comes back later learns the job is over.
  void finish(int64_t generation);

  // Waits up to `timeout` for what ends `membership`'s generation: the
  // generation moved on, or a member's lease ended (then this keeld fails
  // the generation itself), or a node waits to join while the job is below
  // max_nodes. nullopt on timeout. Moves `membership.revision` past what it
  // read, so the next call reports only what came after.
  std::optional<GenerationEvent> next_event(Membership& membership, std::chrono::milliseconds timeout);

  // Makes a join() under way, and any later one, throw Error(kPeerFailure)
  // within a second: keeld is stopping and must not wait out a join timeout.
  void cancel() { cancelled_ = true; }

  // False once this node's lease has expired: etcd forgot the node (it was
  // cut off longer than the TTL), and the others have gone on without it.
  bool alive() const { return !lease_lost_; }
  // Since when the renewals have failed to reach etcd (nullopt: they reach
  // it), for a degraded status.
  std::optional<std::chrono::steady_clock::time_point> unreachable_since() const;
  // The node's lease: what else this node keeps in etcd lives under it, and
  // ends with the node. It changes when a lost lease is taken again.
  store::ClusterStore::LeaseId lease() const { return lease_; }

 private:
  // Takes a lease and rdzv/nodes/<name> under it, waiting out an earlier
  // keeld's record of the name, and starts the renewer.
  void take_name();
  // Records options_.job_config for the job, or refuses one that differs
  // from what other live nodes recorded.
  void check_job_config();
  // Whether every one of `members` finished the job in `generation` with this node's config.
  bool finished_by(int64_t generation, const std::vector<std::string>& members);
  int64_t current_generation();
  std::optional<std::vector<std::string>> sealed_members(int64_t generation);
  std::optional<std::vector<std::string>> try_seal(int64_t generation, const store::ClusterStore::Listing& joined,
                                                   bool timed_out);
  // The membership of a sealed generation this node joined; `revision`
  // comes before the seal, so watches from it miss nothing after.
  Membership sealed_with_this_node(int64_t generation, std::vector<std::string> nodes, int64_t revision);
  // Each member's [cluster] address and snapshot endpoint, from its join
  // record of `generation`.
  void read_join_records(int64_t generation, Membership& m);
  // Blocks until rdzv/generation moves past `generation` or `deadline`.
  void wait_for_generation_after(int64_t generation, std::chrono::steady_clock::time_point deadline);
  // A watch of `prefix` from `revision` until `until`, at most a second of
  // it, after which a cancel() is seen.
  void watch_a_while(const std::string& prefix, int64_t revision, std::chrono::steady_clock::time_point until);
  void renew_until_stopped();
  // The end of `m`'s generation, with the cause recorded for it.
  GenerationEvent ended(const Membership& m);
  // next_event() from the present when its cursor fell out of etcd's
  // history: the generation moved on, a member's record is gone, or a node
  // waits; the cursor moves to the present.
  std::optional<GenerationEvent> resync(
      Membership& m, const std::function<GenerationEvent(const std::string&)>& node_lost,
      const std::function<std::optional<GenerationEvent>(const std::string&)>& node_waits);

  store::ClusterStore& store_;
  const RendezvousOptions options_;
  std::atomic<store::ClusterStore::LeaseId> lease_{0};  // read by lease() from other threads
  std::string record_;  // rdzv/nodes/<name>'s value: JSON with a nonce of this keeld's

  std::atomic<bool> stop_{false};
  std::atomic<bool> lease_lost_{false};
  std::atomic<bool> cancelled_{false};
  mutable std::mutex mutex_;
  std::condition_variable stop_signal_;
  std::optional<std::chrono::steady_clock::time_point> unreachable_since_;
  std::thread renewer_;
};

}  // namespace keel::cluster
