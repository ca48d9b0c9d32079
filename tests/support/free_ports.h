// Loopback ports for servers a test starts later (etcd members, a store, a
// port nobody listens on).
#pragma once

#include <cstddef>
#include <vector>

namespace keel::test {

// Ports the kernel has free now: each bound to port 0 at once and closed
// together, so the set holds no duplicate. Another process may take one
// before the server binds it; a caller that cannot bind starts again.
// Throws std::runtime_error when none can be had.
std::vector<int> free_loopback_ports(size_t count);

// One of them; nothing listens on it when it returns.
int free_loopback_port();

}  // namespace keel::test
