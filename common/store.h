// The Store (docs/architecture.md "Parallel layout and communication"): a small key-value service that ranks and keeld
// rendezvous through. Gloo's rendezvous and NCCL's unique id travel through
// it; generations and membership live in it. Implementations: the embedded
// TCP store (tcp_store.h, one node, served by keeld or a test launcher) and
// etcd (many nodes, with the Multi-node issue). Values are arbitrary bytes.
//
// Every call may throw Error(kPeerFailure) when the store cannot be reached
// or a wait outlives its timeout: a rank that cannot rendezvous cannot train.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace keel::common {

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

// The key keeld sets, to the failure's cause, when a rank of generation
// `generation` dies: the surviving ranks stop waiting for anything from it
// (a rank killed between two collectives tells nobody itself).
inline std::string rank_failed_key(int64_t generation) {
  return "job/g" + std::to_string(generation) + "/rank_failed";
}

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

}  // namespace keel::common
