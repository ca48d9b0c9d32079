#pragma once

#include "store/tcp_store.h"
#include "tests/support/process.h"

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace keel::test {

// What keeld does for one node, for tests: serves an embedded Store and
// starts `world_size` ranks of a program as real processes, each with the
// worker environment of docs/architecture.md "Worker contract" (KEEL_RANK, KEEL_WORLD_SIZE,
// KEEL_LOCAL_RANK, KEEL_LOCAL_WORLD_SIZE, KEEL_GENERATION, KEEL_STORE,
// KEEL_STORE_SECRET; `extra_env` may name another store, such as etcd).
class RankLauncher {
 public:
  RankLauncher(int world_size, const std::vector<std::string>& argv,
               const std::map<std::string, std::string>& extra_env = {}, int64_t generation = 0);
  // The same with a command line of each rank's own, argv_of(rank).
  RankLauncher(int world_size, const std::function<std::vector<std::string>(int rank)>& argv_of,
               const std::map<std::string, std::string>& extra_env = {}, int64_t generation = 0);

  int world_size() const { return static_cast<int>(ranks_.size()); }
  ChildProcess& rank(int r) { return *ranks_.at(static_cast<size_t>(r)); }
  // A client of the ranks' Store, as keeld would use it.
  std::unique_ptr<store::Store> connect_store() const;
  // Waits for every rank, in rank order.
  std::vector<ProcessResult> wait_all(double timeout_s = 300);

 private:
  std::string store_secret_ = store::new_store_secret();
  store::StoreServer store_{store_secret_};
  std::vector<std::unique_ptr<ChildProcess>> ranks_;
};

}  // namespace keel::test
