// An etcd cluster for a doctest case, or a skip: the case says why this
// machine has none (no etcd installed) and returns.
#pragma once

#include <doctest/doctest.h>

#include <filesystem>
#include <memory>
#include <string>

#include "tests/support/etcd_cluster.h"

namespace keel::test {

// The cluster, or nullptr after telling doctest why this machine has none.
inline std::unique_ptr<EtcdCluster> start_etcd_or_skip(
    const std::filesystem::path& dir, int members = 3, const std::string& also_on = "",
    EtcdCluster::Transport transport = EtcdCluster::Transport::kHttp) {
  if (std::string why = EtcdCluster::unavailable_reason(); !why.empty()) {
    MESSAGE("skipped: " << why);
    return nullptr;
  }
  return std::make_unique<EtcdCluster>(dir, members, also_on, transport);
}

}  // namespace keel::test
