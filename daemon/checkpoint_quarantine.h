// Moving suspect checkpoints aside (docs/architecture.md "Daemon"): after
// silent data corruption, every checkpoint of a step later than the last
// one known good may hold the corrupted state, and the ranks resume from the
// newest checkpoint that loads. keeld renames each such checkpoint out of
// the step_%08d pattern (checkpoint::step_of and the catalog ignore every
// other name, retention never removes it), to step_%08d.suspect-g<gen>,
// and never deletes one: an operator may still want it. A .partial of such
// a step goes too (step_%08d.partial.suspect-g<gen>), since rank 0 would
// otherwise commit a finished one at start. Only while no rank runs.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace keel::daemon {

struct Quarantine {
  std::vector<int64_t> steps;       // the committed checkpoints moved aside, ascending
  std::vector<std::string> moved;   // every directory moved, by its new name
  std::vector<std::string> errors;  // one sentence per directory that could not be moved
};

// Moves aside every checkpoint under `root` (committed or .partial) of a
// step after `last_good_step` (-1: every one), with the suffix of
// `generation`, and makes the renames durable (fsync of `root`).
Quarantine quarantine_checkpoints(const std::filesystem::path& root, int64_t last_good_step, int64_t generation);

}  // namespace keel::daemon
