// The worker contract (docs/architecture.md "Worker contract"): the environment keeld starts every rank
// with. Without it keel-trainer is a single rank, which is how tests and
// developers run it by hand.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace keel::trainer {

struct WorkerEnv {
  int rank = 0;                  // KEEL_RANK: global rank
  int world_size = 1;            // KEEL_WORLD_SIZE
  int local_rank = 0;            // KEEL_LOCAL_RANK: rank on this node
  int local_world_size = 1;      // KEEL_LOCAL_WORLD_SIZE: ranks on this node
  int64_t generation = 0;        // KEEL_GENERATION: bumped by every restart
  std::string store;             // KEEL_STORE: Store address, e.g. tcp://127.0.0.1:29500
  std::string store_secret;      // KEEL_STORE_SECRET: what the Store asks of every connection
  std::string board;             // KEEL_BOARD: this rank's progress-board segment
  // KEEL_BIND_ADDRESS: the address this rank's Gloo transport binds and
  // tells its peers, its node's address on the job's network.
  std::string bind_address = "127.0.0.1";
  std::optional<std::string> run_dir;  // KEEL_RUN_DIR: overrides job.run_dir
  // KEEL_SNAPSHOT_FD: the descriptor of this rank's in-memory snapshot
  // area, which keeld holds across generations; none: no area.
  std::optional<int> snapshot_fd;
  // KEEL_SNAPSHOT_BUDDY=1: keeld copies the snapshots the ranks agree on to
  // another node's keeld (daemon/snapshot_buddy.h).
  bool snapshot_buddy = false;

  // Reads the contract through `getenv` (std::getenv by default, a map in
  // tests). Throws Error(kBadConfig) naming the variable when a value is
  // not a number, out of range or inconsistent (rank >= world size, a world
  // above one without KEEL_STORE or KEEL_STORE_SECRET, a secret that is not
  // one, ...). Messages never quote the secret.
  static WorkerEnv read(const std::function<const char*(const char*)>& getenv);
  static WorkerEnv from_process();
};

}  // namespace keel::trainer
