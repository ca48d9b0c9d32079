#include "trainer/train/worker_env.h"

#include "common/error.h"
#include "store/tcp_store.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <limits>

namespace keel::trainer {
namespace {

[[noreturn]] void fail(const std::string& what) {
  throw common::Error(common::ErrorCode::kBadConfig, "worker environment: " + what);
}

int64_t read_int(const std::function<const char*(const char*)>& getenv, const char* name, int64_t fallback,
                 int64_t min, int64_t max) {
  const char* value = getenv(name);
  if (value == nullptr) return fallback;
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(value, &end, 10);
  if (end == value || *end != '\0' || errno == ERANGE) fail(fmt::format("{}={} is not an integer", name, value));
  if (parsed < min || parsed > max) fail(fmt::format("{}={} is outside [{}, {}]", name, value, min, max));
  return parsed;
}

}  // namespace

WorkerEnv WorkerEnv::read(const std::function<const char*(const char*)>& getenv) {
  constexpr int64_t kMaxRanks = std::numeric_limits<int32_t>::max();
  WorkerEnv env;
  env.world_size = static_cast<int>(read_int(getenv, "KEEL_WORLD_SIZE", 1, 1, kMaxRanks));
  env.rank = static_cast<int>(read_int(getenv, "KEEL_RANK", 0, 0, kMaxRanks));
  env.local_world_size = static_cast<int>(read_int(getenv, "KEEL_LOCAL_WORLD_SIZE", env.world_size, 1, kMaxRanks));
  env.local_rank = static_cast<int>(read_int(getenv, "KEEL_LOCAL_RANK", env.rank, 0, kMaxRanks));
  env.generation = read_int(getenv, "KEEL_GENERATION", 0, 0, std::numeric_limits<int64_t>::max());
  if (const char* store = getenv("KEEL_STORE")) env.store = store;
  if (const char* secret = getenv("KEEL_STORE_SECRET")) env.store_secret = secret;
  if (const char* board = getenv("KEEL_BOARD")) env.board = board;
  if (const char* bind = getenv("KEEL_BIND_ADDRESS")) {
    env.bind_address = bind;
    if (env.bind_address.empty() || env.bind_address.find_first_of(" \t\n/") != std::string::npos) {
      fail(fmt::format("KEEL_BIND_ADDRESS='{}' is not an address: give this node's IP address (or host name) on the "
                       "job's network",
                       env.bind_address));
    }
  }
  if (const char* run_dir = getenv("KEEL_RUN_DIR"); run_dir != nullptr && *run_dir != '\0') env.run_dir = run_dir;
  // 0 to 2 are the standard streams.
  if (const int64_t fd = read_int(getenv, "KEEL_SNAPSHOT_FD", -1, 3, std::numeric_limits<int32_t>::max()); fd >= 0) {
    env.snapshot_fd = static_cast<int>(fd);
  }
  env.snapshot_buddy = read_int(getenv, "KEEL_SNAPSHOT_BUDDY", 0, 0, 1) == 1;
  if (env.snapshot_buddy && !env.snapshot_fd) {
    fail("KEEL_SNAPSHOT_BUDDY=1 needs KEEL_SNAPSHOT_FD, the area whose snapshots keeld copies");
  }

  if (env.rank >= env.world_size) {
    fail(fmt::format("KEEL_RANK={} must be below KEEL_WORLD_SIZE={}", env.rank, env.world_size));
  }
  if (env.local_world_size > env.world_size) {
    fail(fmt::format("KEEL_LOCAL_WORLD_SIZE={} exceeds KEEL_WORLD_SIZE={}", env.local_world_size, env.world_size));
  }
  if (env.local_rank >= env.local_world_size) {
    fail(fmt::format("KEEL_LOCAL_RANK={} must be below KEEL_LOCAL_WORLD_SIZE={}", env.local_rank,
                     env.local_world_size));
  }
  if (env.world_size > 1 && env.store.empty()) {
    fail(fmt::format("KEEL_WORLD_SIZE={} needs KEEL_STORE, the address of the rendezvous store", env.world_size));
  }
  // etcd brings its own authentication: its credential, where it has one,
  // is USER:PASSWORD, which connecting checks (docs/architecture.md "Store (store/)").
  const bool tcp_store = !env.store.starts_with("etcd://");
  if (tcp_store && env.world_size > 1 && env.store_secret.empty()) {
    fail(fmt::format("KEEL_WORLD_SIZE={} needs KEEL_STORE_SECRET, the secret of the rendezvous store",
                     env.world_size));
  }
  if (tcp_store && !env.store_secret.empty()) {
    if (std::string problem = store::store_secret_problem(env.store_secret); !problem.empty()) {
      fail("KEEL_STORE_SECRET is not a store secret: " + problem);
    }
  }
  return env;
}

WorkerEnv WorkerEnv::from_process() {
  return read([](const char* name) { return std::getenv(name); });
}

}  // namespace keel::trainer
