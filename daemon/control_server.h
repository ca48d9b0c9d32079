// keeld's control server (docs/architecture.md "Daemon"): the Unix socket keelctl talks to.
// It runs on keeld's event loop and never blocks it: every connection is
// read asynchronously, bounded in size (max_message_bytes per request) and
// in time (a connection idle past client_timeout is closed).
//
// The socket file is world-connectable on purpose: who may control the job
// is decided per connection from the peer's credentials as the kernel
// recorded them at connect() (SO_PEERCRED, SO_PEERGROUPS): root, keeld's own
// user and processes in control_group. Any other peer gets one error reply
// and is disconnected, so an operator sees why instead of a bare
// "permission denied" from connect().
//
// Malformed requests get an error reply and the connection stays usable; a
// request over the size cap gets an error reply and the connection is closed
// (the rest of it cannot be framed). Nothing a client sends reaches the job.
#pragma once

#include "daemon/protocol.h"

#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/steady_timer.hpp>

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace keel::daemon {

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;                // effective
  gid_t gid = 0;                // effective
  std::vector<gid_t> groups;    // supplementary, as the process has them
};

// The credentials of the process at the other end of a connected Unix
// socket; nullopt (errno set) when the kernel does not give them.
std::optional<PeerCredentials> peer_credentials(int fd);

// Whether a peer may use the control socket: root, `daemon_uid`, or a
// process whose primary or supplementary groups hold `group`. The groups are
// the process's own, not the user database's: those are what the kernel
// grants file access by, a process that dropped its groups stays out, and
// no lookup (NSS may mean LDAP) blocks keeld's event loop.
bool peer_allowed(const PeerCredentials& peer, uid_t daemon_uid, std::optional<gid_t> group);

struct ControlServerOptions {
  std::string path;             // the socket file
  std::string group;            // control_group; empty = none
  size_t max_message_bytes = 65536;
  std::chrono::milliseconds client_timeout{10000};
};

class ControlServer {
 public:
  // Answers each request with handler(request); the handler runs on the
  // event loop and must not throw. Binding: a stale socket file is replaced,
  // a live one (another keeld) is Error(kBadConfig); a missing parent
  // directory is created.
  using Handler = std::function<nlohmann::json(const Request&)>;
  ControlServer(boost::asio::io_context& io, ControlServerOptions options, Handler handler);
  // Closes the listener and removes the socket file.
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  const std::string& path() const { return options_.path; }

 private:
  class Session;
  void accept();

  ControlServerOptions options_;
  Handler handler_;
  std::optional<gid_t> group_;
  boost::asio::local::stream_protocol::acceptor acceptor_;
  boost::asio::steady_timer retry_timer_;
};

}  // namespace keel::daemon
