// keeld's Prometheus endpoint: GET /metrics over HTTP/1.1 (Boost.Beast) on
// the daemon's own event loop. That loop also reaps ranks and pets the
// systemd watchdog, so nothing here blocks: every socket operation is
// asynchronous and bounded by a timeout, requests are size-limited, and a
// misbehaving client only ever loses its own connection.
#pragma once

#include <boost/asio/io_context.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace keel::daemon {

class MetricsServer {
 public:
  // Listens on address:port right away (port 0 picks a free one; throws
  // keel::common::Error when the address cannot be bound). render() is
  // called on the io_context's thread once per scrape and returns the page
  // in the text exposition format (see daemon/prometheus_text.h); if it
  // throws, that scrape gets a 500.
  MetricsServer(boost::asio::io_context& io, std::string address, std::uint16_t port,
                std::function<std::string()> render);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // The port actually bound.
  std::uint16_t port() const { return port_; }

  // Closes the listening socket; requests already read get a 503 and
  // render() is never called again. Call it on the io_context's thread, or
  // while the io_context is not running.
  void stop();

  // The acceptor, render() and the open connections' shared bookkeeping;
  // defined in metrics_server.cpp (public only so its sessions can name it).
  struct State;

 private:
  std::shared_ptr<State> state_;  // shared with pending handlers, which may outlive *this
  std::uint16_t port_ = 0;
};

}  // namespace keel::daemon
