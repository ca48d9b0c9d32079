// The Store (docs/architecture.md "Store (store/)"): a small key-value service that ranks and keeld
// rendezvous through. Gloo's rendezvous and NCCL's unique id travel through
// it; generations and membership live in it. Implementations: the embedded
// TCP store (tcp_store.h, one node, served by keeld or a test launcher) and
// etcd (etcd_store.h, many nodes). Values are arbitrary bytes.
//
// Every call may throw Error(kPeerFailure) when the store cannot be reached
// or a wait outlives its timeout: a rank that cannot rendezvous cannot train.
#pragma once

#include "common/error.h"

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace keel::store {

class Store {
 public:
  virtual ~Store() = default;

  virtual void set(const std::string& key, const std::string& value) = 0;
  // The value, or nullopt when the key does not exist. Never blocks on the key.
  virtual std::optional<std::string> get(const std::string& key) = 0;
  // Blocks until every key exists; Error(kPeerFailure) naming the missing
  // keys after `timeout`.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  // Adds delta to the integer stored at key (absent counts as 0) and
  // returns the new value, atomically.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Atomically: if the key's value equals `expected` (nullopt: the key is
  // absent), sets it to `desired`. Returns the value after the call (nullopt
  // only when the key is absent and stays so).
  virtual std::optional<std::string> compare_set(const std::string& key, const std::optional<std::string>& expected,
                                                 const std::string& desired) = 0;
  // Deletes the key; returns whether it existed.
  virtual bool remove(const std::string& key) = 0;
};

// What a store shared by many nodes adds, where etcd has it: leases (a
// node's liveness: its keys vanish when it stops renewing) and watches (a
// change is pushed, not polled). The rendezvous of many keelds needs both;
// the embedded TCP store of one node has neither.
class ClusterStore : public Store {
 public:
  using LeaseId = int64_t;

  struct Entry {
    std::string key;
    std::string value;
    int64_t revision = 0;  // the store revision of its last change
  };
  // Every key under a prefix, read at one revision.
  struct Listing {
    int64_t revision = 0;
    std::vector<Entry> entries;
  };
  struct Change {
    std::string key;
    std::optional<std::string> value;  // nullopt: deleted (or its lease expired)
    int64_t revision = 0;
  };

  // A lease that expires `ttl` after its last renewal.
  virtual LeaseId grant_lease(std::chrono::seconds ttl) = 0;
  // Renews the lease within `timeout` (a renewal that outlasts the TTL is
  // too late anyway); false when it has expired already (its keys are gone).
  virtual bool keep_alive(LeaseId lease, std::chrono::milliseconds timeout) = 0;
  // Ends the lease and deletes its keys now; an expired lease is no error.
  virtual void revoke(LeaseId lease) = 0;
  // set(), but the key is deleted when `lease` ends.
  virtual void set_with_lease(const std::string& key, const std::string& value, LeaseId lease) = 0;
  // compare_set() whose new value lives under `lease`.
  virtual std::optional<std::string> compare_set_with_lease(const std::string& key,
                                                            const std::optional<std::string>& expected,
                                                            const std::string& desired, LeaseId lease) = 0;
  virtual Listing list(const std::string& prefix) = 0;
  // The changes under `prefix` made after `after_revision`, as soon as there
  // is at least one; empty when `timeout` passes without any. A set() sent
  // again after its answer was lost (the member died mid-call; etcd's puts
  // are retried, EtcdGateway::Retry::kIdempotent) may show as two changes
  // of the same value.
  // HistoryCompacted when the store no longer keeps the changes after
  // `after_revision`: the caller reads the present with list() instead.
  virtual std::vector<Change> watch(const std::string& prefix, int64_t after_revision,
                                    std::chrono::milliseconds timeout) = 0;
};

// A watch from a revision the store compacted away (etcd keeps a window of
// history, --auto-compaction-retention): what changed since is lost.
class HistoryCompacted : public common::Error {
 public:
  HistoryCompacted(int64_t compacted_revision, const std::string& message)
      : common::Error(common::ErrorCode::kPeerFailure, message), compacted_revision_(compacted_revision) {}
  int64_t compacted_revision() const { return compacted_revision_; }

 private:
  int64_t compacted_revision_;
};

// Connects to a store by its address, as KEEL_STORE gives it:
//   tcp://HOST:PORT                        the embedded TCP store; `credential` is its secret
//   etcd://HOST:PORT[,HOST:PORT...][/PREFIX] etcd's v3 API; every key lives under PREFIX;
//                                          `credential` is USER:PASSWORD, or empty without auth
// Error(kBadConfig) for a malformed address or a credential the store
// refuses, Error(kPeerFailure) when no store answers within `timeout`.
std::unique_ptr<Store> connect_store(const std::string& address, const std::string& credential,
                                     std::chrono::milliseconds timeout);

// The key keeld sets, to the failure's cause, when a rank of generation
// `generation` dies: the surviving ranks stop waiting for anything from it
// (a rank killed between two collectives tells nobody itself).
inline std::string rank_failed_key(int64_t generation) { return "job/g" + std::to_string(generation) + "/rank_failed"; }

// The value of `key` once it exists, or nullopt after `deadline`: polled
// with get() every 20 ms rather than waited on, because a long wait on a
// connection shared by several threads (TcpStore) holds up the others,
// such as the communicators' failure watchers.
inline std::optional<std::string> poll(Store& store, const std::string& key,
                                       std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    if (auto value = store.get(key)) return value;
    if (std::chrono::steady_clock::now() > deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace keel::store
