// keelctl checkpoint list | verify | inspect | prune (docs/architecture.md "Daemon"): work
// directly on a run's checkpoint directory, with or without a daemon; list
// adds the in-memory snapshots of a keeld running that job.
// Readable tables by default, one JSON document with --json. Each returns
// the process exit code: 0 fine, 1 a checkpoint failed verification, 2 bad
// usage or input (no such directory, step or tensor).
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>

namespace keel::daemon {

struct CheckpointTarget {
  std::filesystem::path root;   // the checkpoint directory (run_dir/checkpoints by default)
  std::optional<int64_t> step;  // one checkpoint; default: the newest committed
  bool json = false;
};

// keeld's status reply when keeld runs the job of that directory (its
// in-memory snapshots are listed beside the checkpoints), or a sentence
// saying why they are not: keeld not running, or running another job.
struct SnapshotSource {
  nlohmann::json status;
  std::string absent;
};

int checkpoint_list(const CheckpointTarget& target, const SnapshotSource& memory, std::ostream& out,
                    std::ostream& err);
// Every file of the checkpoint against its size and checksum; `all`: every
// committed checkpoint.
int checkpoint_verify(const CheckpointTarget& target, bool all, std::ostream& out, std::ostream& err);
// The tensors with shapes and dtypes; with `tensor` ("model/wte"), its
// values too (the first `limit`, 0 for all).
int checkpoint_inspect(const CheckpointTarget& target, const std::string& tensor, int64_t limit, std::ostream& out,
                       std::ostream& err);
// Removes what retention would (all but the newest `keep`, except steps that
// are multiples of keep_every); `dry_run` only lists them.
int checkpoint_prune(const CheckpointTarget& target, int64_t keep, int64_t keep_every, bool dry_run, std::ostream& out,
                     std::ostream& err);

}  // namespace keel::daemon
