// The embedded Store (docs/architecture.md "Store (store/)"): one node's ranks and keeld rendezvous
// through a small TCP key-value server, as PyTorch's TCPStore does.
// StoreServer lives inside keeld (or a test launcher) and serves on its own
// thread; every rank reaches it through a TcpStore named by KEEL_STORE
// ("tcp://127.0.0.1:PORT", docs/architecture.md "Worker contract").
//
// Loopback TCP is open to every local user, and what the store holds steers
// the run (failure records, the resume choice, checkpoint reports), so every
// connection must first present the server's secret (KEEL_STORE_SECRET); a
// connection that does not is refused before any request is read. The
// secret belongs to this TCP store: etcd brings its own authentication.
//
// The server handles every request on one thread, so add and compare_set
// are atomic without locks, and a wait is parked on the server (per key,
// with a server-side timer) instead of being polled by the client.
#pragma once

#include "store/store.h"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace keel::store {

// The largest message either side accepts: bounds what one connection can
// make the server allocate, and still carries any rendezvous value with room
// to spare (NCCL's unique id is 128 bytes).
inline constexpr size_t kMaxStoreMessageBytes = size_t{64} << 20;

// A store secret is this many random bytes, written as twice as many
// lowercase hex digits so that it travels as text in an environment variable.
inline constexpr size_t kStoreSecretBytes = 32;

// A fresh secret from the kernel's random source (getrandom).
std::string new_store_secret();

// Why `secret` cannot be a store secret, or empty when it can. The sentence
// never quotes the secret: it may be a real one, mistyped.
std::string store_secret_problem(std::string_view secret);

class StoreServer {
 public:
  // Listens on 127.0.0.1:port (0 picks a free port) and serves until
  // destroyed, only to connections that present `secret` (one from
  // new_store_secret()). Error(kBadConfig) when the port cannot be bound,
  // Error(kInternal) when `secret` is not a store secret.
  explicit StoreServer(std::string secret, uint16_t port = 0);
  // Stops serving: every connected client sees its connection close.
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  uint16_t port() const { return port_; }
  // "tcp://127.0.0.1:PORT", the KEEL_STORE value for the ranks.
  std::string address() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
  uint16_t port_ = 0;
};

// A client: one TCP connection, safe to share between threads (calls take
// turns, so a wait holds up the other threads' calls until it returns).
// `timeout` bounds connecting (retried until then, since ranks may start
// before the server) and every call; a wait may take its own timeout plus
// this one. Connecting presents `secret`: Error(kBadConfig) when it is not a
// store secret or the server refuses it (retrying cannot help). Once the connection fails (the server died or stopped
// answering) every later call throws Error(kPeerFailure): a rank that lost
// its store cannot rejoin the generation and should exit.
class TcpStore final : public Store {
 public:
  TcpStore(const std::string& host, uint16_t port, const std::string& secret, std::chrono::milliseconds timeout);
  ~TcpStore() override;
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, const std::string& value) override;
  std::optional<std::string> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  // Values written by add are decimal text ("42"), so get reads them too;
  // add on a value that is not an integer throws Error(kInternal).
  int64_t add(const std::string& key, int64_t delta) override;
  std::optional<std::string> compare_set(const std::string& key, const std::optional<std::string>& expected,
                                         const std::string& desired) override;
  bool remove(const std::string& key) override;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace keel::store
