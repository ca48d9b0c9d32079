// keeld's Prometheus endpoint over real sockets: the page, wrong paths and
// methods, hostile requests that must not stop the next scrape; and the
// text format Prometheus has to parse.
#include "common/error.h"
#include "daemon/metrics_server.h"
#include "daemon/prometheus_text.h"

#include <boost/asio.hpp>
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <future>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using keel::daemon::MetricsServer;
using keel::daemon::PrometheusText;

namespace {

// A MetricsServer on 127.0.0.1 with a free port, its io_context run by a
// thread of its own as keeld's event loop would run it.
class RunningServer {
 public:
  explicit RunningServer(std::function<std::string()> render) {
    server_.emplace(io_, "127.0.0.1", 0, std::move(render));
    thread_ = std::thread([this] { io_.run(); });
  }
  ~RunningServer() {
    io_.stop();
    thread_.join();
  }

  std::uint16_t port() const { return server_->port(); }

  // stop() on the loop's thread, as keeld calls it.
  void stop() {
    std::promise<void> done;
    asio::post(io_, [&] {
      server_->stop();
      done.set_value();
    });
    done.get_future().wait();
  }

 private:
  asio::io_context io_;
  std::optional<MetricsServer> server_;
  std::thread thread_;
};

struct Reply {
  int status = 0;  // 0: the server closed without answering
  std::string head;
  std::string body;
};

// Sends raw bytes and reads whatever comes back until the server closes.
// Errors while writing are ignored: a server that hangs up on an oversized
// request may reset the connection before the client finished sending.
Reply send_raw(std::uint16_t port, const std::string& request) {
  asio::io_context io;
  tcp::socket socket(io);
  socket.connect({asio::ip::make_address("127.0.0.1"), port});
  boost::system::error_code ec;
  asio::write(socket, asio::buffer(request), ec);
  std::string raw;
  asio::read(socket, asio::dynamic_buffer(raw), ec);
  Reply reply;
  const auto split = raw.find("\r\n\r\n");
  if (raw.starts_with("HTTP/1.") && split != std::string::npos) {
    reply.status = std::stoi(raw.substr(9, 3));
    reply.head = raw.substr(0, split);
    reply.body = raw.substr(split + 4);
  }
  return reply;
}

Reply request(std::uint16_t port, const std::string& method, const std::string& target) {
  return send_raw(port, method + " " + target + " HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
}

const std::string kPage = "# HELP keel_up Whether keeld runs.\n# TYPE keel_up gauge\nkeel_up 1\n";

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("the metrics server answers GET /metrics with the rendered page") {
    std::atomic<int> renders{0};
    RunningServer server([&] {
      ++renders;
      return kPage;
    });
    REQUIRE(server.port() != 0);

    const Reply reply = request(server.port(), "GET", "/metrics");
    CAPTURE(reply.head);
    CHECK(reply.status == 200);
    CHECK(reply.head.find("Content-Type: text/plain; version=0.0.4") != std::string::npos);
    CHECK(reply.body == kPage);
    CHECK(renders == 1);

    // Prometheus may add query parameters; each scrape renders afresh.
    CHECK(request(server.port(), "GET", "/metrics?scrape=2").body == kPage);
    CHECK(send_raw(server.port(), "GET /metrics HTTP/1.0\r\n\r\n").status == 200);
    CHECK(renders == 3);
  }

  TEST_CASE("the metrics server answers other paths with 404 and other methods with 405") {
    std::atomic<int> renders{0};
    RunningServer server([&] {
      ++renders;
      return kPage;
    });
    CHECK(request(server.port(), "GET", "/").status == 404);
    CHECK(request(server.port(), "GET", "/metrics/extra").status == 404);
    CHECK(request(server.port(), "POST", "/other").status == 404);

    const Reply post = send_raw(server.port(),
                                "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello");
    CHECK(post.status == 405);
    CHECK(post.head.find("Allow: GET") != std::string::npos);
    CHECK(request(server.port(), "DELETE", "/metrics").status == 405);
    CHECK(renders == 0);
  }

  TEST_CASE("the metrics server drops oversized and garbage requests and keeps serving") {
    RunningServer server([] { return kPage; });

    // A client that connects and says nothing must not hold up the others:
    // the loop never waits on one connection.
    asio::io_context idle_io;
    tcp::socket idle(idle_io);
    idle.connect({asio::ip::make_address("127.0.0.1"), server.port()});

    const std::string huge_header = "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + std::string(64 * 1024, 'a') +
                                    "\r\n\r\n";
    const std::string huge_body = "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" +
                                  std::string(100000, 'b');
    const std::string garbage = "\x01\x02\x03 not http at all\r\n\r\n";
    for (const std::string* bad : {&huge_header, &huge_body, &garbage}) {
      const Reply reply = send_raw(server.port(), *bad);
      CAPTURE(reply.head);
      CHECK((reply.status == 400 || reply.status == 0));
      CHECK(request(server.port(), "GET", "/metrics").status == 200);
    }
    // Half a request, then the client hangs up.
    {
      tcp::socket quitter(idle_io);
      quitter.connect({asio::ip::make_address("127.0.0.1"), server.port()});
      asio::write(quitter, asio::buffer(std::string("GET /met")));
    }
    CHECK(request(server.port(), "GET", "/metrics").body == kPage);
  }

  TEST_CASE("a render that throws gives 500 and the next scrape works") {
    std::atomic<int> renders{0};
    RunningServer server([&]() -> std::string {
      if (renders++ == 0) throw std::runtime_error("board not mapped yet");
      return kPage;
    });
    CHECK(request(server.port(), "GET", "/metrics").status == 500);
    CHECK(request(server.port(), "GET", "/metrics").status == 200);
  }

  TEST_CASE("stopping the metrics server closes its port") {
    RunningServer server([] { return kPage; });
    const std::uint16_t port = server.port();
    CHECK(request(port, "GET", "/metrics").status == 200);
    server.stop();
    asio::io_context io;
    tcp::socket socket(io);
    boost::system::error_code ec;
    socket.connect({asio::ip::make_address("127.0.0.1"), port}, ec);
    CHECK(ec == asio::error::connection_refused);
  }

  TEST_CASE("the metrics server refuses an address it cannot listen on") {
    asio::io_context io;
    CHECK_THROWS_AS(MetricsServer(io, "not-an-address", 0, [] { return std::string(); }), keel::common::Error);
    MetricsServer first(io, "127.0.0.1", 0, [] { return std::string(); });
    try {
      MetricsServer second(io, "127.0.0.1", first.port(), [] { return std::string(); });
      FAIL("a second server bound a port already in use");
    } catch (const keel::common::Error& e) {
      CHECK(std::string(e.what()).find(std::to_string(first.port())) != std::string::npos);
    }
  }

  TEST_CASE("PrometheusText formats numbers the way Prometheus parses them") {
    constexpr double kInf = std::numeric_limits<double>::infinity();
    struct Row {
      double value;
      const char* text;
    };
    const Row rows[] = {
        {0.0, "0"},       {1.0, "1"},
        {-2.0, "-2"},     {1.5, "1.5"},
        {0.1, "0.1"},     {123456789.0, "123456789"},
        {1e20, "1e+20"},  {2.5e-7, "2.5e-07"},
        {kInf, "+Inf"},   {-kInf, "-Inf"},
        {std::nan(""), "NaN"},
    };
    for (const Row& row : rows) {
      CAPTURE(row.text);
      PrometheusText text;
      text.gauge("keel_value", "A value.", row.value);
      CHECK(text.str() == std::string("# HELP keel_value A value.\n# TYPE keel_value gauge\nkeel_value ") +
                              row.text + "\n");
    }
  }

  TEST_CASE("PrometheusText escapes label values and help text") {
    struct Row {
      std::string value;
      std::string escaped;
    };
    const Row rows[] = {
        {"plain", "plain"},
        {R"(C:\runs)", R"(C:\\runs)"},
        {R"(say "hi")", R"(say \"hi\")"},
        {"two\nlines", R"(two\nlines)"},
        {"", ""},
        {"ünïcode", "ünïcode"},
    };
    for (const Row& row : rows) {
      CAPTURE(row.value);
      PrometheusText text;
      text.counter("keel_restarts_total", "Restarts.", 3, {{"cause", row.value}, {"rank", "0"}});
      CHECK(text.str().ends_with("keel_restarts_total{cause=\"" + row.escaped + "\",rank=\"0\"} 3\n"));
    }

    // Help escapes backslash and newline but leaves quotes alone.
    PrometheusText help;
    help.gauge("keel_x", "a \"quoted\" C:\\path\nsecond line", 1);
    CHECK(help.str().starts_with("# HELP keel_x a \"quoted\" C:\\\\path\\nsecond line\n"));
  }

  TEST_CASE("PrometheusText keeps the samples of one metric together under one header") {
    PrometheusText text;
    text.gauge("keel_rank_step", "Step each rank reached.", 10, {{"rank", "0"}});
    text.counter("keel_restarts_total", "Generations restarted.", 2);
    text.gauge("keel_rank_step", "Step each rank reached.", 9, {{"rank", "1"}});
    CHECK(text.str() ==
          "# HELP keel_rank_step Step each rank reached.\n"
          "# TYPE keel_rank_step gauge\n"
          "keel_rank_step{rank=\"0\"} 10\n"
          "keel_rank_step{rank=\"1\"} 9\n"
          "# HELP keel_restarts_total Generations restarted.\n"
          "# TYPE keel_restarts_total counter\n"
          "keel_restarts_total 2\n");
    CHECK(PrometheusText().str().empty());
  }

  TEST_CASE("PrometheusText refuses names Prometheus would reject") {
    PrometheusText text;
    text.gauge("keel_ok:ratio", "Fine.", 1);
    CHECK_THROWS_AS(text.counter("keel_ok:ratio", "Now a counter.", 1), keel::common::Error);
    CHECK_THROWS_AS(text.gauge("9lives", "Digit first.", 1), keel::common::Error);
    CHECK_THROWS_AS(text.gauge("keel-dash", "Dash.", 1), keel::common::Error);
    CHECK_THROWS_AS(text.gauge("", "Empty.", 1), keel::common::Error);
    CHECK_THROWS_AS(text.gauge("keel_y", "Colon label.", 1, {{"a:b", "1"}}), keel::common::Error);
    CHECK_THROWS_AS(text.gauge("keel_y", "Reserved label.", 1, {{"__name__", "1"}}), keel::common::Error);
  }
}
