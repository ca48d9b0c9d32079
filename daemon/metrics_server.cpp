#include "daemon/metrics_server.h"

#include "common/error.h"
#include "common/log.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>

#include <chrono>
#include <optional>
#include <string_view>
#include <utility>

namespace keel::daemon {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using boost::system::error_code;

// A scrape is one small request; anything slower or larger is a broken or
// hostile client, and each open connection costs the daemon a socket.
constexpr std::chrono::seconds kIoTimeout{10};
constexpr std::uint32_t kHeaderLimit = 8 * 1024;
constexpr std::uint64_t kBodyLimit = 1024;
constexpr int kMaxConnections = 32;
constexpr std::chrono::milliseconds kAcceptRetry{500};
constexpr const char* kContentType = "text/plain; version=0.0.4; charset=utf-8";

spdlog::logger& metrics_log() {
  static const std::shared_ptr<spdlog::logger> instance = common::logger("metrics");
  return *instance;
}

using Response = http::response<http::string_body>;

Response text_response(http::status status, unsigned version, std::string body) {
  Response res{status, version};
  res.set(http::field::server, "keeld");
  res.set(http::field::content_type, "text/plain; charset=utf-8");
  res.body() = std::move(body);
  return res;
}

}  // namespace

struct MetricsServer::State {
  explicit State(asio::io_context& io, std::function<std::string()> render_fn)
      : acceptor(io), retry(io), render(std::move(render_fn)) {}

  tcp::acceptor acceptor;
  asio::steady_timer retry;
  std::function<std::string()> render;
  bool stopped = false;
  int connections = 0;
};

namespace {

// One connection: read one request, answer it, close. Prometheus reconnects
// every scrape interval anyway, and closing keeps no idle sockets around.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, std::shared_ptr<MetricsServer::State> state)
      : stream_(std::move(socket)), state_(std::move(state)) {
    ++state_->connections;
  }
  ~Session() { --state_->connections; }

  void start() {
    parser_.emplace();
    parser_->header_limit(kHeaderLimit);
    parser_->body_limit(kBodyLimit);
    stream_.expires_after(kIoTimeout);
    http::async_read(stream_, buffer_, *parser_, [self = shared_from_this()](error_code ec, std::size_t) {
      self->guarded([&] { self->on_read(ec); });
    });
  }

 private:
  // No exception may leave an Asio handler (it would unwind through
  // io_context::run and take the daemon down): log it and drop this client.
  template <typename F>
  void guarded(F&& body) {
    try {
      body();
    } catch (const std::exception& e) {
      metrics_log().warn("dropping a metrics connection: {}", e.what());
      close();
    } catch (...) {
      metrics_log().warn("dropping a metrics connection: unknown exception");
      close();
    }
  }

  void on_read(error_code ec) {
    if (ec == http::error::end_of_stream || ec == beast::error::timeout || ec == asio::error::operation_aborted) {
      close();
      return;
    }
    if (ec) {
      // Oversized or malformed: say so once, then hang up, since the rest of
      // the byte stream cannot be trusted to frame another request.
      metrics_log().debug("bad metrics request: {}", ec.message());
      respond(text_response(http::status::bad_request, 11, fmt::format("bad request: {}\n", ec.message())));
      return;
    }
    respond(answer(parser_->get()));
  }

  Response answer(const http::request<http::string_body>& req) {
    std::string_view target(req.target().data(), req.target().size());
    target = target.substr(0, target.find('?'));
    if (target != "/metrics") return text_response(http::status::not_found, req.version(), "not found; try /metrics\n");
    if (req.method() != http::verb::get) {
      Response res = text_response(http::status::method_not_allowed, req.version(), "only GET\n");
      res.set(http::field::allow, "GET");
      return res;
    }
    if (state_->stopped || !state_->render) {
      return text_response(http::status::service_unavailable, req.version(), "keeld is stopping\n");
    }
    Response res = text_response(http::status::ok, req.version(), {});
    try {
      res.body() = state_->render();
    } catch (const std::exception& e) {
      metrics_log().error("rendering /metrics failed: {}", e.what());
      return text_response(http::status::internal_server_error, req.version(), "rendering metrics failed\n");
    }
    res.set(http::field::content_type, kContentType);
    return res;
  }

  void respond(Response res) {
    response_ = std::move(res);
    response_.keep_alive(false);
    response_.prepare_payload();
    stream_.expires_after(kIoTimeout);
    http::async_write(stream_, response_, [self = shared_from_this()](error_code, std::size_t) {
      self->guarded([&] { self->close(); });
    });
  }

  void close() {
    error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    stream_.socket().close(ignored);
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  Response response_;
  std::shared_ptr<MetricsServer::State> state_;
};

void accept(const std::shared_ptr<MetricsServer::State>& state) {
  state->acceptor.async_accept([state](error_code ec, tcp::socket socket) {
    try {
      if (state->stopped || ec == asio::error::operation_aborted) return;
      if (ec) {
        // Out of file descriptors and the like: accepting again at once
        // would spin the daemon's loop, so pause first.
        metrics_log().warn("accepting a metrics connection failed: {}; retrying", ec.message());
        state->retry.expires_after(kAcceptRetry);
        state->retry.async_wait([state](error_code wait_ec) {
          if (!wait_ec && !state->stopped) accept(state);
        });
        return;
      }
      if (state->connections >= kMaxConnections) {
        metrics_log().warn("refusing a metrics connection: {} already open", state->connections);
      } else {
        std::make_shared<Session>(std::move(socket), state)->start();
      }
    } catch (const std::exception& e) {
      metrics_log().warn("dropping a metrics connection: {}", e.what());
    }
    accept(state);
  });
}

}  // namespace

MetricsServer::MetricsServer(asio::io_context& io, std::string address, std::uint16_t port,
                             std::function<std::string()> render)
    : state_(std::make_shared<State>(io, std::move(render))) {
  try {
    const tcp::endpoint endpoint(asio::ip::make_address(address), port);
    state_->acceptor.open(endpoint.protocol());
    state_->acceptor.set_option(tcp::acceptor::reuse_address(true));
    state_->acceptor.bind(endpoint);
    state_->acceptor.listen();
    port_ = state_->acceptor.local_endpoint().port();
  } catch (const boost::system::system_error& e) {
    throw common::Error(common::ErrorCode::kBadConfig,
                        fmt::format("cannot serve metrics on {}:{}: {}; choose another address or port in [daemon]",
                                    address, port, e.code().message()));
  }
  metrics_log().info("serving Prometheus metrics on http://{}:{}/metrics", address, port_);
  accept(state_);
}

MetricsServer::~MetricsServer() { stop(); }

void MetricsServer::stop() {
  if (state_->stopped) return;
  state_->stopped = true;
  // Dropping render now releases whatever it captured; sessions still in
  // flight answer 503 instead of calling into a daemon that is going away.
  state_->render = nullptr;
  error_code ignored;
  state_->acceptor.close(ignored);
  state_->retry.cancel();
}

}  // namespace keel::daemon
