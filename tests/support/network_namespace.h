// A node of its own on the test's machine: a network namespace joined to
// the host by a veth pair, so that a test can cut the node off for real
// (its end of the link down) and let it back. Needs root (CI has it); a
// test without it is told why and skips.
#pragma once

#include <string>
#include <vector>

namespace keel::test {

class NetworkNamespace {
 public:
  // Why no namespace can be made here (not root, no `ip`), or empty.
  static std::string unavailable_reason();

  // The namespace, with loopback up and a veth pair whose host end has
  // `host_address`/24 and whose namespace end has `node_address`/24.
  NetworkNamespace(std::string host_address, std::string node_address);
  // Deletes the namespace and the pair.
  ~NetworkNamespace();
  NetworkNamespace(const NetworkNamespace&) = delete;
  NetworkNamespace& operator=(const NetworkNamespace&) = delete;

  // `argv` run inside the namespace.
  std::vector<std::string> inside(const std::vector<std::string>& argv) const;
  // The node's end of the link down (cut off) or up again.
  void set_link(bool up);

 private:
  std::string name_;
  std::string host_end_, node_end_;
};

}  // namespace keel::test
