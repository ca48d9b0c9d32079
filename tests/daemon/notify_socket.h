// A test's stand-in for systemd's notify socket: keeld, started with
// NOTIFY_SOCKET set to path(), sends its READY, STATUS, WATCHDOG and
// STOPPING datagrams here. A thread drains them while keeld runs, as
// systemd does, because a full datagram queue would block keeld's sd_notify.
#pragma once

#include <doctest/doctest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace keel::test {

class NotifySocket {
 public:
  explicit NotifySocket(std::filesystem::path path) : path_(std::move(path)) {
    fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd_ >= 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strcpy(address.sun_path, path_.c_str());
    REQUIRE(bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
    reader_ = std::thread([this] {
      while (!done_.load()) {
        if (!receive()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    });
  }
  ~NotifySocket() {
    stop();
    close(fd_);
  }
  NotifySocket(const NotifySocket&) = delete;
  NotifySocket& operator=(const NotifySocket&) = delete;

  std::string path() const { return path_.string(); }

  // Stops the reader and takes what is still queued. Call it once keeld has
  // exited: a datagram is queued by the time sd_notify returns, so nothing
  // keeld sent is missed.
  void stop() {
    if (!reader_.joinable()) return;
    done_ = true;
    reader_.join();
    while (receive()) {
    }
  }

  // The variables keeld set ("READY", "STATUS", ...), and its STATUS= lines in order.
  std::set<std::string> seen() const {
    std::lock_guard lock(mutex_);
    return seen_;
  }
  std::vector<std::string> statuses() const {
    std::lock_guard lock(mutex_);
    return statuses_;
  }

 private:
  // One datagram, if one is queued.
  bool receive() {
    char datagram[4096];
    const ssize_t n = recv(fd_, datagram, sizeof(datagram), MSG_DONTWAIT);
    if (n <= 0) return false;
    const std::string message(datagram, static_cast<size_t>(n));
    std::lock_guard lock(mutex_);
    size_t at = 0;
    while (at < message.size()) {
      const size_t end = message.find('\n', at);
      const std::string line = message.substr(at, end == std::string::npos ? std::string::npos : end - at);
      seen_.insert(line.substr(0, line.find('=')));
      if (line.starts_with("STATUS=")) statuses_.push_back(line.substr(7));
      at = end == std::string::npos ? message.size() : end + 1;
    }
    return true;
  }

  std::filesystem::path path_;
  int fd_ = -1;
  std::atomic<bool> done_{false};
  std::thread reader_;
  mutable std::mutex mutex_;
  std::set<std::string> seen_;
  std::vector<std::string> statuses_;
};

}  // namespace keel::test
