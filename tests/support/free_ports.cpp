#include "tests/support/free_ports.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <stdexcept>

namespace keel::test {

std::vector<int> free_loopback_ports(size_t count) {
  std::vector<int> fds;
  std::vector<int> ports;
  auto close_all = [&fds] {
    for (int fd : fds) close(fd);
  };
  for (size_t i = 0; i < count; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd >= 0) fds.push_back(fd);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      close_all();
      throw std::runtime_error("cannot find a free loopback port");
    }
    ports.push_back(ntohs(address.sin_port));
  }
  close_all();
  return ports;
}

int free_loopback_port() { return free_loopback_ports(1).front(); }

}  // namespace keel::test
