#include "tests/support/rank_launcher.h"

namespace keel::test {

RankLauncher::RankLauncher(int world_size, const std::vector<std::string>& argv,
                           const std::map<std::string, std::string>& extra_env, int64_t generation)
    : RankLauncher(world_size, [&](int) { return argv; }, extra_env, generation) {}

RankLauncher::RankLauncher(int world_size, const std::function<std::vector<std::string>(int rank)>& argv_of,
                           const std::map<std::string, std::string>& extra_env, int64_t generation) {
  for (int r = 0; r < world_size; ++r) {
    auto env = extra_env;
    env["KEEL_RANK"] = std::to_string(r);
    env["KEEL_WORLD_SIZE"] = std::to_string(world_size);
    env["KEEL_LOCAL_RANK"] = std::to_string(r);
    env["KEEL_LOCAL_WORLD_SIZE"] = std::to_string(world_size);
    env["KEEL_GENERATION"] = std::to_string(generation);
    // A test may name another store (etcd) for the ranks.
    env.try_emplace("KEEL_STORE", store_.address());
    env.try_emplace("KEEL_STORE_SECRET", store_secret_);
    ranks_.push_back(std::make_unique<ChildProcess>(argv_of(r), env));
  }
}

std::unique_ptr<store::Store> RankLauncher::connect_store() const {
  return store::connect_store(store_.address(), store_secret_, std::chrono::seconds(30));
}

std::vector<ProcessResult> RankLauncher::wait_all(double timeout_s) {
  std::vector<ProcessResult> results;
  for (auto& rank : ranks_) results.push_back(rank->wait(timeout_s));
  return results;
}

}  // namespace keel::test
