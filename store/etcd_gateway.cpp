#include "store/etcd_gateway.h"

#include <openssl/ssl.h>
#include <openssl/x509_vfy.h>

#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>

#include "common/error.h"
#include "common/log.h"
// Beast's base64 is the codec its websocket handshake uses; etcd's JSON
// needs no other.
#include <fmt/format.h>

#include <algorithm>
#include <boost/beast/core/detail/base64.hpp>
#include <boost/beast/http.hpp>
#include <charconv>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <utility>

namespace keel::store {

using common::Error;
using common::ErrorCode;

namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using boost::system::error_code;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

spdlog::logger& etcd_log() {
  static const std::shared_ptr<spdlog::logger> instance = common::logger("etcd");
  return *instance;
}

// One attempt on one member gets at most this long, so that a member cut
// off from its quorum (it accepts the connection, then waits for a leader it
// cannot reach) costs one attempt and not the call's whole timeout.
constexpr milliseconds kAttemptBound{3000};
// Between rounds over every member: an election takes about a second.
constexpr milliseconds kRoundPause{100};
// The largest answer read: a listing of a job's keys is far smaller.
constexpr uint64_t kMaxAnswerBytes = uint64_t{64} << 20;

// gRPC status codes etcd's errors carry (grpc/codes).
constexpr int kCodeDeadlineExceeded = 4;
constexpr int kCodePermissionDenied = 7;
constexpr int kCodeResourceExhausted = 8;  // "too many requests"
constexpr int kCodeUnavailable = 14;
constexpr int kCodeUnauthenticated = 16;

// A connection to one member with its own event loop: each call runs its
// asynchronous operations to completion under a deadline (tcp_stream's
// timeout closes the socket when it passes), so nothing blocks past it.
struct Connection {
  asio::io_context io;
  beast::tcp_stream tcp{io};
  // Over TLS, what requests and answers go through, on `tcp`.
  std::unique_ptr<asio::ssl::stream<beast::tcp_stream&>> tls;
  beast::flat_buffer buffer;
  size_t endpoint = 0;

  // Runs one asynchronous operation, which `start(stream, handler)` begins
  // on the layer HTTP goes through, until it completes or `deadline` passes
  // (beast::error::timeout).
  template <class Start>
  error_code run(Clock::time_point deadline, Start start) {
    if (tls) return run_on_tcp(deadline, [&](auto handler) { start(*tls, std::move(handler)); });
    return run_on_tcp(deadline, [&](auto handler) { start(tcp, std::move(handler)); });
  }

  // The same for an operation `start(handler)` begins itself (connecting,
  // the TLS handshake).
  template <class Start>
  error_code run_on_tcp(Clock::time_point deadline, Start start) {
    error_code result = asio::error::would_block;
    tcp.expires_at(deadline);
    start([&result](error_code ec, auto&&...) { result = ec; });
    io.restart();
    io.run();
    return result;
  }
};

std::string describe(const error_code& ec) {
  if (ec == beast::error::timeout) return "no answer in time";
  return ec.message();
}

// What one attempt came to.
struct Attempt {
  enum Kind { kAnswered, kNotSent, kMaybeApplied } kind = kNotSent;
  unsigned status = 0;
  std::string body;
  std::string failure;  // why, when not answered
  // Not sent because of keel's TLS settings, which no retry changes.
  bool config_problem = false;
};

// Why a connection failed, with what to change when it is the settings.
struct ConnectFailure {
  std::string why;  // empty: connected
  bool config_problem = false;
};

// Why a member turned away keel's client certificate, or empty when `ec` is
// something else. Over TLS 1.3 a client finishes its handshake before the
// server checks its certificate, so the refusal arrives as an alert on the
// first read, before the server has read any request.
std::string certificate_refusal(const error_code& ec) {
  if (ec.category() != asio::error::get_ssl_category()) return "";
  switch (ERR_GET_REASON(static_cast<unsigned long>(ec.value()))) {
    case SSL_R_TLSV13_ALERT_CERTIFICATE_REQUIRED:
    case SSL_R_SSLV3_ALERT_BAD_CERTIFICATE:
    case SSL_R_SSLV3_ALERT_CERTIFICATE_UNKNOWN:
    case SSL_R_SSLV3_ALERT_CERTIFICATE_EXPIRED:
    case SSL_R_SSLV3_ALERT_CERTIFICATE_REVOKED:
    case SSL_R_TLSV1_ALERT_UNKNOWN_CA:
    case SSL_R_TLSV1_ALERT_ACCESS_DENIED:
      return fmt::format("it refused keel's TLS client certificate ({}): etcd with --client-cert-auth wants one "
                         "signed by its --trusted-ca-file in cluster.tls_cert_file and tls_key_file",
                         ec.message());
    default:
      return "";
  }
}

// Loads the TLS files into a client context; Error(kBadConfig) naming the
// file that cannot be used and OpenSSL's reason.
std::unique_ptr<asio::ssl::context> tls_context(const EtcdTls& tls) {
  auto context = std::make_unique<asio::ssl::context>(asio::ssl::context::tls_client);
  context->set_verify_mode(asio::ssl::verify_peer);
  auto load = [](const std::string& file, const char* what, auto load_file) {
    error_code ec;
    load_file(ec);
    if (ec) {
      throw Error(ErrorCode::kBadConfig,
                  fmt::format("the {} for etcd's TLS, {}, cannot be used: {} (check [cluster] tls_ca_file, "
                              "tls_cert_file and tls_key_file)",
                              what, file, ec.message()));
    }
  };
  load(tls.ca_file, "CA file", [&](error_code& ec) { context->load_verify_file(tls.ca_file, ec); });
  if (!tls.cert_file.empty()) {
    load(tls.cert_file, "client certificate",
         [&](error_code& ec) { context->use_certificate_chain_file(tls.cert_file, ec); });
    // OpenSSL refuses a key that does not match the certificate here.
    load(tls.key_file, "client key",
         [&](error_code& ec) { context->use_private_key_file(tls.key_file, asio::ssl::context::pem, ec); });
  }
  return context;
}

// etcd's error answer: {"error": ..., "message": ..., "code": N}.
struct EtcdStatus {
  int code = -1;
  std::string message;
};

// Unary calls answer {"code", "message"}; streaming calls (watch, lease
// keepalive) {"error": {"grpc_code", "message"}}.
EtcdStatus parse_status(const std::string& body) {
  EtcdStatus status;
  auto answer = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (answer.is_object()) {
    if (auto nested = answer.find("error"); nested != answer.end() && nested->is_object()) answer = *nested;
    if (auto code = answer.find("grpc_code"); code != answer.end() && code->is_number_integer()) {
      status.code = code->get<int>();
    }
    if (auto code = answer.find("code"); code != answer.end() && code->is_number_integer()) {
      status.code = code->get<int>();
    }
    for (const char* field : {"message", "error"}) {
      if (auto text = answer.find(field); text != answer.end() && text->is_string()) {
        status.message = text->get<std::string>();
        break;
      }
    }
  }
  if (status.message.empty()) status.message = body.substr(0, 200);
  return status;
}

// A request etcd turned away before proposing it: safe to send elsewhere.
bool refused_before_proposing(const EtcdStatus& status) {
  return status.code == kCodeResourceExhausted || status.message.find("no leader") != std::string::npos;
}

}  // namespace

class EtcdGateway::Impl {
 public:
  explicit Impl(EtcdOptions options)
      : options_(std::move(options)), tls_context_(options_.tls.on() ? tls_context(options_.tls) : nullptr) {}

  const EtcdOptions& options() const { return options_; }

  std::string endpoint_names() const {
    std::string names;
    for (const auto& endpoint : options_.endpoints) names += (names.empty() ? "" : ", ") + endpoint.name();
    return names;
  }

  void authenticate() {
    nlohmann::json body = {{"name", options_.user}, {"password", options_.password}};
    auto answer = call("/v3/auth/authenticate", body.dump(), Retry::kIdempotent, /*with_token=*/false);
    auto token = answer.find("token");
    if (token == answer.end() || !token->is_string()) {
      throw Error(ErrorCode::kPeerFailure,
                  fmt::format("etcd at {} answered authentication without a token", endpoint_names()));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    token_ = token->get<std::string>();
  }

  nlohmann::json call(std::string_view path, const std::string& body, Retry retry, bool with_token = true,
                      std::optional<milliseconds> timeout = std::nullopt) {
    const milliseconds limit = timeout.value_or(options_.timeout);
    const auto deadline = Clock::now() + limit;
    // Half the call at most, so that a silent member leaves time for another.
    const milliseconds attempt_bound = std::clamp(limit / 2, milliseconds(500), kAttemptBound);
    std::vector<std::string> failures(options_.endpoints.size());
    // A member that turned away the TLS settings keeps that as its failure:
    // the connection it refused may also end in a reset, which says less.
    std::vector<bool> config_problems(options_.endpoints.size());
    auto failed = [&](size_t index, const std::string& why, bool config_problem) {
      if (config_problems[index] && !config_problem) return;
      failures[index] = options_.endpoints[index].name() + ": " + why;
      config_problems[index] = config_problem;
    };
    bool authenticated_again = false;
    const size_t n = options_.endpoints.size();
    for (;;) {
      const size_t first = preferred();
      for (size_t k = 0; k < n; ++k) {
        const size_t index = (first + k) % n;
        const auto now = Clock::now();
        if (now >= deadline) break;
        Attempt attempt = send(index, path, body, with_token ? token() : std::string(),
                               std::min(deadline, now + attempt_bound), retry);
        const std::string& name = options_.endpoints[index].name();
        if (attempt.kind == Attempt::kNotSent) {
          failed(index, attempt.failure, attempt.config_problem);
          demote(index);
          continue;
        }
        if (attempt.kind == Attempt::kMaybeApplied) {
          demote(index);
          if (retry == Retry::kOnce) throw maybe_applied(path, name, attempt.failure);
          failed(index, attempt.failure, false);
          continue;
        }
        if (attempt.status == 200) {
          prefer(index);
          return parse_answer(attempt.body, path, name);
        }
        EtcdStatus status = parse_status(attempt.body);
        if (status.code == kCodeUnauthenticated && with_token && !options_.user.empty() && !authenticated_again) {
          // Tokens expire (etcd's simple tokens after 5 minutes unused).
          authenticated_again = true;
          authenticate();
          --k;
          continue;
        }
        if (status.code == kCodeUnavailable || status.code == kCodeDeadlineExceeded ||
            status.code == kCodeResourceExhausted) {
          demote(index);
          if (retry == Retry::kOnce && !refused_before_proposing(status)) {
            throw maybe_applied(path, name, status.message);
          }
          failed(index, status.message, false);
          continue;
        }
        throw refused(path, name, status);
      }
      if (Clock::now() + kRoundPause >= deadline) break;
      std::this_thread::sleep_for(kRoundPause);
    }
    std::string why;
    for (const auto& failure : failures) {
      if (!failure.empty()) why += (why.empty() ? "" : "; ") + failure;
    }
    // Every member turned away keel's TLS settings: no restart mends that.
    if (std::all_of(config_problems.begin(), config_problems.end(), [](bool b) { return b; })) {
      throw Error(ErrorCode::kBadConfig, fmt::format("no etcd member at {} takes keel's TLS settings: {}",
                                                     endpoint_names(), why));
    }
    throw Error(ErrorCode::kPeerFailure,
                fmt::format("etcd cannot be reached at {} within {} ms ({}): check that etcd runs there and that the "
                            "store address (KEEL_STORE, or [cluster] etcd in keeld's config) lists its client URLs{}",
                            endpoint_names(), limit.count(), why.empty() ? "no attempt" : why,
                            tls_context_ ? "" : " (if they are https, set cluster.tls_ca_file)"));
  }

  bool stream(std::string_view path, const std::function<nlohmann::json()>& body_for_retry, Clock::time_point deadline,
              const std::function<bool(const nlohmann::json&)>& on_message) {
    const size_t n = options_.endpoints.size();
    size_t index = preferred();
    std::string last_failure;
    bool authenticated_again = false;
    for (bool first = true; Clock::now() < deadline; first = false) {
      // A stream that broke is taken up elsewhere after a pause, never in a
      // tight loop of reconnections.
      if (!first && Clock::now() + kRoundPause < deadline) std::this_thread::sleep_for(kRoundPause);
      Connection connection;
      connection.endpoint = index;
      const std::string& name = options_.endpoints[index].name();
      index = (index + 1) % n;  // the next attempt goes elsewhere
      const auto attempt_deadline = std::min(deadline, Clock::now() + kAttemptBound);
      if (ConnectFailure failure = connect(connection, attempt_deadline); !failure.why.empty()) {
        last_failure = name + ": " + failure.why;
        continue;
      }
      // A member cut off from its quorum would keep a watch open and silent;
      // asked to require a leader, it ends the watch with "no leader".
      auto request = make_request(path, body_for_retry().dump(), token(), name, /*require_leader=*/true);
      if (auto ec = connection.run(attempt_deadline, [&](auto& stream, auto handler) {
            http::async_write(stream, request, std::move(handler));
          })) {
        last_failure = name + ": " + describe(ec);
        continue;
      }
      http::response_parser<http::buffer_body> parser;
      parser.body_limit(boost::none);  // a watch streams for as long as it is read
      if (auto ec = connection.run(deadline, [&](auto& stream, auto handler) {
            http::async_read_header(stream, connection.buffer, parser, std::move(handler));
          })) {
        if (ec == beast::error::timeout) return false;
        std::string refusal = certificate_refusal(ec);
        last_failure = name + ": " + (refusal.empty() ? describe(ec) : refusal);
        continue;
      }
      const bool ok_status = parser.get().result_int() == 200;
      std::string pending;
      std::optional<EtcdStatus> ended;  // etcd's error, in the status or a stream line
      for (;;) {
        char chunk[8192];
        parser.get().body().data = chunk;
        parser.get().body().size = sizeof(chunk);
        auto ec = connection.run(deadline, [&](auto& stream, auto handler) {
          http::async_read_some(stream, connection.buffer, parser, std::move(handler));
        });
        if (ec == beast::error::timeout) return false;
        if (ec && ec != http::error::need_buffer) {
          last_failure = name + ": " + describe(ec);
          break;
        }
        pending.append(chunk, sizeof(chunk) - parser.get().body().size);
        if (ok_status) {
          for (size_t eol; !ended && (eol = pending.find('\n')) != std::string::npos;) {
            std::string line = pending.substr(0, eol);
            pending.erase(0, eol + 1);
            if (line.find_first_not_of(" \r\t") == std::string::npos) continue;
            nlohmann::json message = parse_answer(line, path, name);
            if (message.contains("error")) {
              ended = parse_status(line);
              break;
            }
            if (!on_message(message)) return true;
          }
          if (ended) break;
          if (pending.size() > kMaxAnswerBytes) {
            throw Error(ErrorCode::kPeerFailure,
                        fmt::format("etcd at {} sent a {} message over {} bytes", name, path, kMaxAnswerBytes));
          }
        }
        if (parser.is_done()) {
          last_failure = name + ": the stream ended";
          break;
        }
      }
      if (!ok_status && !ended) ended = parse_status(pending);
      if (!ended) continue;
      last_failure = name + ": " + ended->message;
      if (ended->code == kCodeUnavailable || ended->code == kCodeDeadlineExceeded) continue;
      if (ended->code == kCodeUnauthenticated && !options_.user.empty() && !authenticated_again) {
        authenticated_again = true;
        authenticate();
        continue;
      }
      throw refused(path, name, *ended);
    }
    etcd_log().debug("{} stream ended at its deadline; last failure: {}", path, last_failure);
    return false;
  }

 private:
  size_t preferred() {
    std::lock_guard<std::mutex> lock(mutex_);
    return preferred_;
  }
  void prefer(size_t index) {
    std::lock_guard<std::mutex> lock(mutex_);
    preferred_ = index;
  }
  // The next call starts at the next member, not at one that just failed.
  void demote(size_t index) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (preferred_ == index) preferred_ = (index + 1) % options_.endpoints.size();
  }
  std::string token() {
    std::lock_guard<std::mutex> lock(mutex_);
    return token_;
  }

  ConnectFailure connect(Connection& connection, Clock::time_point deadline) {
    const EtcdEndpoint& endpoint = options_.endpoints[connection.endpoint];
    error_code ec;
    // A numeric address resolves at once; a host name waits on the system
    // resolver, which has no deadline of its own.
    auto addresses = tcp::resolver(connection.io).resolve(endpoint.host, std::to_string(endpoint.port), ec);
    if (ec) return {"cannot resolve " + endpoint.host + ": " + ec.message()};
    ec = connection.run_on_tcp(deadline,
                               [&](auto handler) { connection.tcp.async_connect(addresses, std::move(handler)); });
    if (ec) return {describe(ec)};
    return tls_context_ ? handshake(connection, endpoint, deadline) : ConnectFailure{};
  }

  // The member's certificate must chain to the CA and name the host or
  // address keel dialed, as an https client checks.
  ConnectFailure handshake(Connection& connection, const EtcdEndpoint& endpoint, Clock::time_point deadline) {
    connection.tls = std::make_unique<asio::ssl::stream<beast::tcp_stream&>>(connection.tcp, *tls_context_);
    SSL* ssl = connection.tls->native_handle();
    error_code not_address;
    asio::ip::make_address(endpoint.host, not_address);
    if (not_address) {
      SSL_set_tlsext_host_name(ssl, endpoint.host.c_str());  // SNI, for names only
      SSL_set1_host(ssl, endpoint.host.c_str());
    } else {
      X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), endpoint.host.c_str());
    }
    error_code ec = connection.run_on_tcp(deadline, [&](auto handler) {
      connection.tls->async_handshake(asio::ssl::stream_base::client, std::move(handler));
    });
    if (!ec) return {};
    if (ec == beast::error::timeout || ec.category() != asio::error::get_ssl_category()) {
      return {"TLS handshake: " + describe(ec)};
    }
    if (long verdict = SSL_get_verify_result(ssl); verdict != X509_V_OK) {
      return {fmt::format("its TLS certificate is not trusted: {} (cluster.tls_ca_file must name the CA that "
                          "signed etcd's certificates, and they must name {})",
                          X509_verify_cert_error_string(verdict), endpoint.host),
              true};
    }
    return {fmt::format("TLS handshake: {} (is etcd's client URL https? keel speaks TLS to it because "
                        "cluster.tls_ca_file is set)",
                        ec.message()),
            true};
  }

  static http::request<http::string_body> make_request(std::string_view path, const std::string& body,
                                                       const std::string& token, const std::string& host,
                                                       bool require_leader = false) {
    http::request<http::string_body> request{http::verb::post, std::string(path), 11};
    request.set(http::field::host, host);
    request.set(http::field::content_type, "application/json");
    if (!token.empty()) request.set(http::field::authorization, token);
    // The gateway passes it on as gRPC metadata (etcd's WithRequireLeader).
    if (require_leader) request.set("Grpc-Metadata-hasleader", "true");
    request.keep_alive(true);
    request.body() = body;
    request.prepare_payload();
    return request;
  }

  // One request to member `index`. An idempotent one may go on a pooled
  // connection, and again on a fresh one when the pooled one fails (the
  // member closed it while idle). A once-only one always goes on a fresh
  // connection: an answer cut off on a pooled one could not tell "closed
  // while idle" from "read, maybe applied, then the member died".
  Attempt send(size_t index, std::string_view path, const std::string& body, const std::string& token,
               Clock::time_point deadline, Retry retry) {
    if (retry == Retry::kIdempotent) {
      if (std::unique_ptr<Connection> pooled = take_idle(index)) {
        Attempt attempt = exchange(pooled, path, body, token, deadline);
        if (attempt.kind == Attempt::kAnswered) return attempt;
      }
    }
    auto connection = std::make_unique<Connection>();
    connection->endpoint = index;
    if (ConnectFailure failure = connect(*connection, deadline); !failure.why.empty()) {
      return {Attempt::kNotSent, 0, {}, failure.why, failure.config_problem};
    }
    return exchange(connection, path, body, token, deadline);
  }

  // Writes the request and reads the answer; a connection the member keeps
  // open goes back to the pool.
  Attempt exchange(std::unique_ptr<Connection>& connection, std::string_view path, const std::string& body,
                   const std::string& token, Clock::time_point deadline) {
    auto request = make_request(path, body, token, options_.endpoints[connection->endpoint].name());
    if (auto ec = connection->run(
            deadline, [&](auto& stream, auto handler) { http::async_write(stream, request, std::move(handler)); })) {
      return {Attempt::kMaybeApplied, 0, {}, describe(ec)};
    }
    http::response_parser<http::string_body> parser;
    parser.body_limit(kMaxAnswerBytes);
    if (auto ec = connection->run(deadline, [&](auto& stream, auto handler) {
          http::async_read(stream, connection->buffer, parser, std::move(handler));
        })) {
      if (std::string refusal = certificate_refusal(ec); !refusal.empty()) {
        return {Attempt::kNotSent, 0, {}, refusal, /*config_problem=*/true};
      }
      return {Attempt::kMaybeApplied, 0, {}, describe(ec)};
    }
    auto response = parser.release();
    Attempt attempt{Attempt::kAnswered, response.result_int(), std::move(response.body()), {}};
    if (response.keep_alive()) give_back(std::move(connection));
    return attempt;
  }

  std::unique_ptr<Connection> take_idle(size_t index) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = idle_.begin(); it != idle_.end(); ++it) {
      if ((*it)->endpoint == index) {
        auto connection = std::move(*it);
        idle_.erase(it);
        return connection;
      }
    }
    return nullptr;
  }

  void give_back(std::unique_ptr<Connection> connection) {
    std::lock_guard<std::mutex> lock(mutex_);
    // A few per member: as many as threads call at once, seldom more than 4.
    if (idle_.size() < 4 * options_.endpoints.size()) idle_.push_back(std::move(connection));
  }

  static nlohmann::json parse_answer(const std::string& text, std::string_view path, const std::string& name) {
    auto answer = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (answer.is_discarded() || !answer.is_object()) {
      throw Error(ErrorCode::kPeerFailure, fmt::format("etcd at {} answered {} with something that is not a JSON "
                                                       "object: '{}'",
                                                       name, path, text.substr(0, 120)));
    }
    return answer;
  }

  Error maybe_applied(std::string_view path, const std::string& name, const std::string& why) const {
    return Error(ErrorCode::kPeerFailure,
                 fmt::format("the call {} to etcd at {} broke off ({}) and may or may not have been applied; it is "
                             "not repeated, so that it cannot apply twice",
                             path, name, why));
  }

  Error refused(std::string_view path, const std::string& name, const EtcdStatus& status) const {
    // etcd's fix for CVE-2018-16886: with client-cert-auth and users on, its
    // gateway refuses any client certificate that has a Common Name.
    if (status.message.find("CommonName of client sending a request against gateway") != std::string::npos) {
      return Error(ErrorCode::kBadConfig,
                   fmt::format("etcd at {} refuses keel's client certificate ({}): with its authentication on, "
                               "etcd's JSON gateway takes only client certificates without a Common Name; issue "
                               "cluster.tls_cert_file without one (say, subject /O=keel) and authenticate with "
                               "cluster.credential_file",
                               name, options_.tls.cert_file));
    }
    if (status.code == kCodePermissionDenied || status.message.find("authentication failed") != std::string::npos ||
        status.message.find("user name is empty") != std::string::npos) {
      return Error(ErrorCode::kBadConfig,
                   fmt::format("etcd at {} refused {} ({}): check the etcd user and password keel was given (the "
                               "store credential, KEEL_STORE_SECRET) and that the user may read and write under '{}'",
                               name, path, status.message, options_.prefix));
    }
    return Error(ErrorCode::kPeerFailure,
                 fmt::format("etcd at {} refused {}: {} (code {})", name, path, status.message, status.code));
  }

  const EtcdOptions options_;
  const std::unique_ptr<asio::ssl::context> tls_context_;  // null without TLS
  std::mutex mutex_;
  size_t preferred_ = 0;
  std::string token_;
  std::vector<std::unique_ptr<Connection>> idle_;
};

EtcdGateway::EtcdGateway(EtcdOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  if (!impl_->options().user.empty()) impl_->authenticate();
}

EtcdGateway::~EtcdGateway() = default;

nlohmann::json EtcdGateway::call(std::string_view path, const nlohmann::json& body, Retry retry,
                                 std::optional<std::chrono::milliseconds> timeout) {
  return impl_->call(path, body.dump(), retry, /*with_token=*/true, timeout);
}

bool EtcdGateway::stream(std::string_view path, const std::function<nlohmann::json()>& body_for_retry,
                         std::chrono::steady_clock::time_point deadline,
                         const std::function<bool(const nlohmann::json&)>& on_message) {
  return impl_->stream(path, body_for_retry, deadline, on_message);
}

void EtcdGateway::authenticate_again() {
  if (!impl_->options().user.empty()) impl_->authenticate();
}

const EtcdOptions& EtcdGateway::options() const { return impl_->options(); }

std::string EtcdGateway::endpoint_names() const { return impl_->endpoint_names(); }

namespace {

// The query of an etcd address: ca=FILE[&cert=FILE&key=FILE]. `malformed`
// makes the error for a reason.
template <class Malformed>
EtcdTls parse_tls_query(std::string_view query, const Malformed& malformed) {
  EtcdTls tls;
  while (!query.empty()) {
    size_t amp = query.find('&');
    std::string_view item = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    size_t equals = item.find('=');
    std::string_view name = item.substr(0, equals);
    std::string_view value = equals == std::string_view::npos ? std::string_view() : item.substr(equals + 1);
    std::string* field = name == "ca" ? &tls.ca_file : name == "cert" ? &tls.cert_file : name == "key" ? &tls.key_file
                                                                                                      : nullptr;
    if (field == nullptr) throw malformed(fmt::format("'{}' is none of ca, cert and key", name));
    if (value.empty()) throw malformed(fmt::format("'{}' names no file", name));
    *field = std::string(value);
  }
  if (tls.cert_file.empty() != tls.key_file.empty()) throw malformed("a client cert goes with its key: give both");
  if (!tls.cert_file.empty() && tls.ca_file.empty()) throw malformed("a client cert needs ca, the CA of etcd's");
  return tls;
}

}  // namespace

EtcdOptions parse_etcd_address(std::string_view address, std::string_view credential, milliseconds timeout) {
  auto malformed = [&address](const std::string& why) {
    return Error(ErrorCode::kBadConfig,
                 fmt::format("bad etcd address 'etcd://{}': {}; expected "
                             "etcd://HOST:PORT[,HOST:PORT...][/PREFIX][?ca=FILE[&cert=FILE&key=FILE]], e.g. "
                             "etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379/keel/job-a",
                             address, why));
  };
  EtcdOptions options;
  options.timeout = timeout;
  std::string_view hosts = address;
  if (size_t question = hosts.find('?'); question != std::string_view::npos) {
    options.tls = parse_tls_query(hosts.substr(question + 1), malformed);
    hosts = hosts.substr(0, question);
  }
  if (size_t slash = hosts.find('/'); slash != std::string_view::npos) {
    std::string_view prefix = hosts.substr(slash + 1);
    hosts = hosts.substr(0, slash);
    while (!prefix.empty() && prefix.back() == '/') prefix.remove_suffix(1);
    if (!prefix.empty()) options.prefix = std::string(prefix) + "/";
  }
  if (hosts.empty()) throw malformed("it names no member");
  while (!hosts.empty()) {
    size_t comma = hosts.find(',');
    std::string_view item = hosts.substr(0, comma);
    hosts = comma == std::string_view::npos ? std::string_view() : hosts.substr(comma + 1);
    if (comma != std::string_view::npos && hosts.empty()) throw malformed("it ends with a comma");
    size_t colon = item.rfind(':');
    if (item.empty() || colon == std::string_view::npos || colon == 0) {
      throw malformed(fmt::format("'{}' is not HOST:PORT", item));
    }
    std::string_view port_text = item.substr(colon + 1);
    unsigned port = 0;
    auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
    if (port_text.empty() || ec != std::errc() || end != port_text.data() + port_text.size() || port == 0 ||
        port > 65535) {
      throw malformed(fmt::format("the port of '{}' must be a number from 1 to 65535", item));
    }
    options.endpoints.push_back({std::string(item.substr(0, colon)), static_cast<uint16_t>(port)});
  }
  if (!credential.empty()) {
    size_t colon = credential.find(':');
    if (colon == std::string_view::npos || colon == 0) {
      throw Error(ErrorCode::kBadConfig,
                  "the etcd credential must be USER:PASSWORD (KEEL_STORE_SECRET with an etcd "
                  "store address); it has no user name before a ':'");
    }
    options.user = std::string(credential.substr(0, colon));
    options.password = std::string(credential.substr(colon + 1));
  }
  return options;
}

std::string etcd_address_with_tls(const std::string& address, const EtcdTls& tls) {
  if (!tls.on()) return address;
  std::string query;
  for (auto [name, file, key] : {std::tuple{"ca", &tls.ca_file, "cluster.tls_ca_file"},
                                 {"cert", &tls.cert_file, "cluster.tls_cert_file"},
                                 {"key", &tls.key_file, "cluster.tls_key_file"}}) {
    if (file->empty()) continue;
    if (file->find_first_of("&?") != std::string::npos) {
      throw Error(ErrorCode::kBadConfig, fmt::format("{} = \"{}\": keel hands etcd's TLS files to its ranks in the "
                                                     "store address, where a file name cannot hold '&' or '?'; "
                                                     "rename the file",
                                                     key, *file));
    }
    query += fmt::format("{}{}={}", query.empty() ? "?" : "&", name, *file);
  }
  return address + query;
}

std::string etcd_base64(std::string_view bytes) {
  namespace base64 = boost::beast::detail::base64;
  std::string text(base64::encoded_size(bytes.size()), '\0');
  text.resize(base64::encode(text.data(), bytes.data(), bytes.size()));
  return text;
}

std::string etcd_unbase64(std::string_view text) {
  namespace base64 = boost::beast::detail::base64;
  size_t padding = 0;
  while (padding < 2 && padding < text.size() && text[text.size() - 1 - padding] == '=') ++padding;
  std::string bytes(base64::decoded_size(text.size()), '\0');
  auto [written, read] = base64::decode(bytes.data(), text.data(), text.size());
  if (text.size() % 4 != 0 || read != text.size() - padding) {
    throw std::invalid_argument("not base64: '" + std::string(text.substr(0, 40)) + "'");
  }
  bytes.resize(written);
  return bytes;
}

int64_t etcd_int(const nlohmann::json& object, const char* field) {
  auto it = object.find(field);
  if (it == object.end()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (!it->is_string()) throw std::invalid_argument(std::string(field) + " is neither a number nor a string");
  const std::string& text = it->get_ref<const std::string&>();
  int64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size()) {
    throw std::invalid_argument(std::string(field) + " is not an integer: '" + text.substr(0, 40) + "'");
  }
  return value;
}

}  // namespace keel::store
