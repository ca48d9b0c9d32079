#include "store/store.h"

#include <fmt/format.h>

#include <charconv>
#include <string_view>

#include "common/error.h"
#include "store/etcd_store.h"
#include "store/tcp_store.h"

namespace keel::store {

using common::Error;
using common::ErrorCode;

namespace {

std::unique_ptr<Store> connect_tcp(const std::string& address, std::string_view rest, const std::string& secret,
                                   std::chrono::milliseconds timeout) {
  auto malformed = [&address](const std::string& why) {
    return Error(ErrorCode::kBadConfig, fmt::format("bad store address '{}': {}; expected tcp://HOST:PORT, e.g. "
                                                    "tcp://127.0.0.1:29500 (check KEEL_STORE)",
                                                    address, why));
  };
  size_t colon = rest.rfind(':');
  if (colon == std::string_view::npos) throw malformed("it has no port");
  std::string_view host = rest.substr(0, colon);
  std::string_view port_text = rest.substr(colon + 1);
  if (host.empty()) throw malformed("it has no host");
  unsigned port = 0;
  auto [parsed_to, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (port_text.empty() || ec != std::errc() || parsed_to != port_text.data() + port_text.size() || port == 0 ||
      port > 65535) {
    throw malformed("the port must be a number from 1 to 65535");
  }
  return std::make_unique<TcpStore>(std::string(host), static_cast<uint16_t>(port), secret, timeout);
}

}  // namespace

std::unique_ptr<Store> connect_store(const std::string& address, const std::string& credential,
                                     std::chrono::milliseconds timeout) {
  constexpr std::string_view kTcp = "tcp://";
  constexpr std::string_view kEtcd = "etcd://";
  if (address.starts_with(kTcp))
    return connect_tcp(address, std::string_view(address).substr(kTcp.size()), credential, timeout);
  if (address.starts_with(kEtcd)) {
    return std::make_unique<EtcdStore>(
        parse_etcd_address(std::string_view(address).substr(kEtcd.size()), credential, timeout));
  }
  throw Error(ErrorCode::kBadConfig,
              fmt::format("bad store address '{}': it starts with neither tcp:// nor etcd://; expected tcp://HOST:PORT "
                          "(the store keeld embeds, one node) or etcd://HOST:PORT[,HOST:PORT...][/PREFIX] (an etcd "
                          "cluster, many nodes); check KEEL_STORE",
                          address));
}

}  // namespace keel::store
