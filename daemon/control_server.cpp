#include "daemon/control_server.h"

#include "common/error.h"
#include "common/log.h"

#include <boost/asio/read_until.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/streambuf.hpp>
#include <boost/asio/write.hpp>

#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

namespace keel::daemon {
namespace {

namespace asio = boost::asio;
using local = asio::local::stream_protocol;

std::optional<gid_t> group_id(const std::string& name) {
  if (name.empty()) return std::nullopt;
  const group* g = getgrnam(name.c_str());
  if (g == nullptr) {
    throw common::Error(common::ErrorCode::kBadConfig,
                        fmt::format("daemon.control_group = \"{}\" is not a group on this machine; create it "
                                    "(groupadd {}) or leave control_group empty",
                                    name, name));
  }
  return g->gr_gid;
}

// True when something already accepts connections at `path`.
bool socket_is_live(asio::io_context& io, const std::string& path) {
  local::socket probe(io);
  boost::system::error_code ec;
  probe.connect(local::endpoint(path), ec);
  return !ec;
}

}  // namespace

std::optional<PeerCredentials> peer_credentials(int fd) {
  ucred cred{};
  socklen_t cred_size = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cred_size) != 0) return std::nullopt;
  PeerCredentials peer{cred.pid, cred.uid, cred.gid, std::vector<gid_t>(64)};
  // ERANGE says how large the list is; it cannot change (it was recorded at
  // connect()), so the second call fits.
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto size = static_cast<socklen_t>(peer.groups.size() * sizeof(gid_t));
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, peer.groups.data(), &size) == 0) {
      peer.groups.resize(size / sizeof(gid_t));
      return peer;
    }
    if (errno != ERANGE) return std::nullopt;
    peer.groups.resize(size / sizeof(gid_t));
  }
  return std::nullopt;
}

bool peer_allowed(const PeerCredentials& peer, uid_t daemon_uid, std::optional<gid_t> group) {
  if (peer.uid == 0 || peer.uid == daemon_uid) return true;
  if (!group) return false;
  return peer.gid == *group || std::find(peer.groups.begin(), peer.groups.end(), *group) != peer.groups.end();
}

class ControlServer::Session : public std::enable_shared_from_this<Session> {
 public:
  Session(local::socket socket, ControlServer& server)
      : socket_(std::move(socket)),
        server_(server),
        timer_(socket_.get_executor()),
        buffer_(server.options_.max_message_bytes + 1) {}

  void start() {
    const std::optional<PeerCredentials> peer = peer_credentials(socket_.native_handle());
    if (!peer) {
      common::logger("control")->warn("refused a control connection: cannot read its credentials: {}",
                                      std::strerror(errno));
      refuse("cannot read the peer's credentials");
      return;
    }
    if (!peer_allowed(*peer, geteuid(), server_.group_)) {
      common::logger("control")->warn("refused a control connection from uid {} (pid {})", peer->uid, peer->pid);
      refuse(fmt::format("permission denied: uid {} is not root, keeld's user{}", peer->uid,
                         server_.options_.group.empty()
                             ? std::string(" (set daemon.control_group to let a group in)")
                             : fmt::format(" or in group {} (a member added since login must log in again)",
                                           server_.options_.group)));
      return;
    }
    read();
  }

 private:
  void refuse(const std::string& why) { reply(error_reply(why), true); }

  void read() {
    timer_.expires_after(server_.options_.client_timeout);
    timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (!ec) {
        boost::system::error_code ignored;
        self->socket_.close(ignored);
      }
    });
    asio::async_read_until(socket_, buffer_, '\n',
                           [self = shared_from_this()](const boost::system::error_code& ec, size_t length) {
                             self->on_line(ec, length);
                           });
  }

  void on_line(const boost::system::error_code& ec, size_t length) {
    timer_.cancel();
    if (ec == asio::error::not_found) {
      reply(error_reply(fmt::format("request longer than daemon.max_message_bytes = {}; closing the connection",
                                    server_.options_.max_message_bytes)),
            true);
      return;
    }
    if (ec) return;  // closed by the client or by the idle timer
    std::string line(asio::buffers_begin(buffer_.data()), asio::buffers_begin(buffer_.data()) + length - 1);
    buffer_.consume(length);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    nlohmann::json answer;
    try {
      answer = server_.handler_(parse_request(line));
    } catch (const ProtocolError& e) {
      answer = error_reply(e.what());
    } catch (const std::exception& e) {
      common::logger("control")->error("control request failed: {}", e.what());
      answer = error_reply(std::string("keeld could not answer: ") + e.what());
    }
    reply(answer, false);
  }

  void reply(const nlohmann::json& answer, bool close_after) {
    outgoing_ = reply_line(answer);
    timer_.expires_after(server_.options_.client_timeout);
    timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (!ec) {
        boost::system::error_code ignored;
        self->socket_.close(ignored);
      }
    });
    asio::async_write(socket_, asio::buffer(outgoing_),
                      [self = shared_from_this(), close_after](const boost::system::error_code& ec, size_t) {
                        self->timer_.cancel();
                        if (ec || close_after) {
                          boost::system::error_code ignored;
                          self->socket_.shutdown(local::socket::shutdown_both, ignored);
                          self->socket_.close(ignored);
                          return;
                        }
                        self->read();
                      });
  }

  local::socket socket_;
  ControlServer& server_;
  asio::steady_timer timer_;
  asio::streambuf buffer_;
  std::string outgoing_;
};

ControlServer::ControlServer(asio::io_context& io, ControlServerOptions options, Handler handler)
    : options_(std::move(options)),
      handler_(std::move(handler)),
      group_(group_id(options_.group)),
      acceptor_(io),
      retry_timer_(io) {
  const std::filesystem::path path(options_.path);
  std::error_code fs_error;
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), fs_error);
  if (std::filesystem::exists(path, fs_error)) {
    if (socket_is_live(io, options_.path)) {
      throw common::Error(common::ErrorCode::kBadConfig,
                          fmt::format("another keeld already serves {}; stop it first or set daemon.socket (or "
                                      "--socket) to another path",
                                      options_.path));
    }
    std::filesystem::remove(path, fs_error);
  }
  boost::system::error_code ec;
  acceptor_.open(local(), ec);
  if (!ec) acceptor_.bind(local::endpoint(options_.path), ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    throw common::Error(common::ErrorCode::kBadConfig,
                        fmt::format("cannot listen on control socket {}: {}; check that its directory exists and "
                                    "is writable, or set daemon.socket (or --socket)",
                                    options_.path, ec.message()));
  }
  // Access is decided per connection from SO_PEERCRED (see the header).
  chmod(options_.path.c_str(), 0666);
  accept();
}

ControlServer::~ControlServer() {
  boost::system::error_code ignored;
  retry_timer_.cancel();
  acceptor_.close(ignored);
  std::error_code fs_error;
  std::filesystem::remove(options_.path, fs_error);
}

void ControlServer::accept() {
  acceptor_.async_accept([this](const boost::system::error_code& ec, local::socket socket) {
    if (ec == asio::error::operation_aborted) return;
    if (!ec) {
      std::make_shared<Session>(std::move(socket), *this)->start();
      accept();
      return;
    }
    // Out of descriptors, say: retrying at once would spin the event loop.
    common::logger("control")->warn("accepting a control connection failed: {}; retrying in 0.5 s", ec.message());
    retry_timer_.expires_after(std::chrono::milliseconds(500));
    retry_timer_.async_wait([this](const boost::system::error_code& wait_ec) {
      if (!wait_ec) accept();
    });
  });
}

}  // namespace keel::daemon
