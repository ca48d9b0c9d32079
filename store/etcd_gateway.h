// HTTP to etcd's v3 JSON gateway (docs/architecture.md "Store (store/)"):
// every etcd v3 call is a POST of JSON to /v3/<service>/<method> on any
// member, which forwards it to the leader. keel speaks the gateway rather
// than gRPC because Boost.Beast is a dependency already and gRPC is not;
// the v2 API, which etcd 3.6 removed, is never used.
//
// The gateway fails over: a call goes to the member that answered last, and
// to the next one when that member cannot be reached, has no leader or does
// not answer within the attempt bound, until the call's timeout. A call that
// may have been applied before its connection broke is retried only when it
// says it is idempotent; otherwise it fails with kPeerFailure rather than
// applying twice.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace keel::store {

struct EtcdEndpoint {
  std::string host;
  uint16_t port = 0;
  std::string name() const { return host + ":" + std::to_string(port); }
};

// etcd over TLS, for client URLs that are https: PEM files. The member's
// certificate must be signed by the CA and name the host or address keel
// dials.
struct EtcdTls {
  std::string ca_file;    // empty: plain HTTP
  std::string cert_file;  // a client certificate, for etcd's --client-cert-auth; with key_file or neither
  std::string key_file;
  bool on() const { return !ca_file.empty(); }
};

struct EtcdOptions {
  std::vector<EtcdEndpoint> endpoints;
  // What every key is stored under ("keel/job-a/"), so that jobs can share
  // one etcd cluster.
  std::string prefix;
  // etcd's own authentication; empty user: auth is off.
  std::string user;
  std::string password;
  EtcdTls tls;
  // Bounds reaching a member and every call (a watch has its own).
  std::chrono::milliseconds timeout{10000};
};

// Parses the part of a store address after "etcd://":
// HOST:PORT[,HOST:PORT...][/PREFIX][?ca=FILE[&cert=FILE&key=FILE]], the
// query naming the TLS files (EtcdTls). `credential` is USER:PASSWORD or
// empty. Error(kBadConfig) naming what is wrong and the expected form.
EtcdOptions parse_etcd_address(std::string_view address, std::string_view credential,
                               std::chrono::milliseconds timeout);

// `address` (etcd://..., without a query) with `tls` as its query, so that
// one string carries everything a rank needs to reach etcd (KEEL_STORE).
// Error(kBadConfig) for a file name that cannot go in a query ('&', '?').
std::string etcd_address_with_tls(const std::string& address, const EtcdTls& tls);

class EtcdGateway {
 public:
  enum class Retry {
    kIdempotent,  // may run again after an attempt that might have applied
    kOnce,        // fails with kPeerFailure when an attempt might have applied
  };

  // Authenticates when `options` has a user: Error(kBadConfig) when etcd
  // refuses the name or password, Error(kPeerFailure) when no member answers.
  // Error(kBadConfig) when a TLS file cannot be read or the key does not
  // match the certificate.
  explicit EtcdGateway(EtcdOptions options);
  ~EtcdGateway();
  EtcdGateway(const EtcdGateway&) = delete;
  EtcdGateway& operator=(const EtcdGateway&) = delete;

  // POSTs `body` to `path` ("/v3/kv/range") and returns the answer. Errors
  // etcd states (an HTTP status other than 200) are Error(kPeerFailure)
  // with etcd's message, except a refused permission (kBadConfig); an
  // answer that is not JSON is Error(kPeerFailure) naming the member.
  // `timeout` bounds this call instead of the options' timeout.
  nlohmann::json call(std::string_view path, const nlohmann::json& body, Retry retry,
                      std::optional<std::chrono::milliseconds> timeout = std::nullopt);

  // POSTs `body` to a streaming path (/v3/watch) and hands each message of
  // the answer to `on_message` until it returns false (then true) or
  // `deadline` passes (then false). Reconnects to another member when the
  // stream breaks; `body_for_retry` gives the body for that attempt (a watch
  // resumes after the last revision it saw).
  bool stream(std::string_view path, const std::function<nlohmann::json()>& body_for_retry,
              std::chrono::steady_clock::time_point deadline,
              const std::function<bool(const nlohmann::json&)>& on_message);

  // Takes a new token (with a user; nothing without one). A watch is
  // cancelled, not refused, when its token expired (etcd's simple tokens
  // end 5 minutes unused, or when the user's password is set): the watch
  // itself cannot tell the gateway, so its caller does.
  void authenticate_again();

  const EtcdOptions& options() const;
  // "127.0.0.1:2379, 127.0.0.1:2479", for messages.
  std::string endpoint_names() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// etcd's JSON carries keys and values as base64, and 64-bit integers as
// decimal strings.
std::string etcd_base64(std::string_view bytes);
std::string etcd_unbase64(std::string_view text);                   // throws std::invalid_argument
int64_t etcd_int(const nlohmann::json& object, const char* field);  // absent: 0 (the gateway omits zero values)

}  // namespace keel::store
