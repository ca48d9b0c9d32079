// A small model's config for a job of many nodes, with `sets` applied: the
// layout tests' starting point.
#pragma once

#include <string>
#include <vector>

#include "common/config.h"

namespace keel::test {

inline common::Config cluster_config(const std::vector<std::string>& sets) {
  const char* base = R"(
[job]
name = "layout"
[data]
train = "train.bin"
[model]
n_layer = 4
n_head = 4
n_embd = 32
[cluster]
etcd = "etcd://127.0.0.1:2379/keel/layout"
)";
  return common::Config::parse(base, "layout.toml", "/base", sets);
}

}  // namespace keel::test
