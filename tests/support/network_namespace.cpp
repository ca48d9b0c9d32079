#include "tests/support/network_namespace.h"

#include <fmt/format.h>
#include <unistd.h>

#include <stdexcept>

#include "tests/support/process.h"

namespace keel::test {
namespace {

void run(const std::vector<std::string>& argv) {
  const auto result = run_process(argv, {}, 60);
  if (result.exit_code != 0) {
    throw std::runtime_error(fmt::format("{} {} {} failed: {}", argv[0], argv[1], argv[2], result.output));
  }
}

}  // namespace

std::string NetworkNamespace::unavailable_reason() {
  if (geteuid() != 0) return "network namespaces need root";
  const std::string probe = fmt::format("keel-probe-{}", getpid());
  if (run_process({"ip", "netns", "add", probe}, {}, 60).exit_code != 0) {
    return "`ip netns add` fails here (no iproute2, or no namespaces in this container)";
  }
  run_process({"ip", "netns", "del", probe}, {}, 60);
  return "";
}

NetworkNamespace::NetworkNamespace(std::string host_address, std::string node_address)
    : name_(fmt::format("keel-{}-{}", getpid(), node_address)),
      host_end_(fmt::format("kh{}", getpid() % 100000)),
      node_end_(fmt::format("kn{}", getpid() % 100000)) {
  run({"ip", "netns", "add", name_});
  run({"ip", "link", "add", host_end_, "type", "veth", "peer", "name", node_end_});
  run({"ip", "link", "set", node_end_, "netns", name_});
  run({"ip", "addr", "add", host_address + "/24", "dev", host_end_});
  run({"ip", "link", "set", host_end_, "up"});
  run(inside({"ip", "addr", "add", node_address + "/24", "dev", node_end_}));
  run(inside({"ip", "link", "set", node_end_, "up"}));
  run(inside({"ip", "link", "set", "lo", "up"}));
}

NetworkNamespace::~NetworkNamespace() {
  run_process({"ip", "link", "del", host_end_}, {}, 60);  // takes its peer along
  run_process({"ip", "netns", "del", name_}, {}, 60);
}

std::vector<std::string> NetworkNamespace::inside(const std::vector<std::string>& argv) const {
  std::vector<std::string> out = {"ip", "netns", "exec", name_};
  out.insert(out.end(), argv.begin(), argv.end());
  return out;
}

void NetworkNamespace::set_link(bool up) { run(inside({"ip", "link", "set", node_end_, up ? "up" : "down"})); }

}  // namespace keel::test
