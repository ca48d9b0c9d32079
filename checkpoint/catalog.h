// The checkpoints of a run directory: which are committed, which one a run
// resumes from, and which retention removes (docs/architecture.md
// "Checkpoints", "Resume and retention").
#pragma once

#include "checkpoint/file_system.h"

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace keel::checkpoint {

struct CatalogEntry {
  int64_t step = 0;
  std::filesystem::path dir;
};

// Every step_%08d directory under root that has a manifest.json, oldest
// first. A directory without a manifest is not a checkpoint (docs/architecture.md "Checkpoints").
std::vector<CatalogEntry> committed(const std::filesystem::path& root);

// How much of a checkpoint is checked: its manifest and every file's size,
// or also every file's checksum (reads every byte).
enum class Depth { kSizes, kChecksums };

// What checking a committed checkpoint found. kUnreadable (an I/O or
// permission error) is kept apart from kDamaged: it says nothing about the
// bytes, so nothing may treat such a checkpoint as corrupt.
struct Inspection {
  enum class State { kGood, kDamaged, kUnreadable };
  State state = State::kGood;
  std::string why;  // empty when good
};
Inspection inspect(const CatalogEntry& entry, Depth depth, FileSystem& fs = FileSystem::real());

struct ResumeOptions {
  Depth depth = Depth::kChecksums;
  // An unreadable checkpoint is read again this many times, `retry_delay`
  // apart (doubling), before the choice fails.
  int read_retries = 2;
  std::chrono::milliseconds retry_delay{500};
};

// The checkpoint a run resumes from: the newest committed one that passes
// inspect(). A damaged newer one is passed over and reported through
// on_skip(dir, why). Nothing when no checkpoint is committed. Throws
// Error(kCheckpointFailure) with one sentence naming each checkpoint and
// why when checkpoints exist but none loads, and when one stays unreadable
// after the retries: a run never falls back silently to an older state, or
// to step 0, because of a read error.
std::optional<CatalogEntry> choose_resume(
    const std::filesystem::path& root, const ResumeOptions& options,
    const std::function<void(const std::filesystem::path&, const std::string&)>& on_skip,
    FileSystem& fs = FileSystem::real());

struct RetentionPolicy {
  int64_t keep = 3;        // the newest `keep` checkpoints that pass inspect() stay
  int64_t keep_every = 0;  // and those whose step is a multiple of this (0: none)
  int64_t protect_step = -1;  // and this one (the checkpoint a run resumed from until a newer one commits)
};

// The committed checkpoints retention removes, given which of `entries`
// (oldest first) pass inspection. Only checkpoints older than the newest
// `keep` good ones are candidates, so a damaged or unreadable newer one
// never pushes a good one out, and is itself left for an operator to look
// at.
std::vector<CatalogEntry> prune_candidates(const std::vector<CatalogEntry>& entries, const RetentionPolicy& policy,
                                           const std::function<bool(const CatalogEntry&)>& good);

// Removes a checkpoint so that a crash halfway never leaves something that
// looks committed: it is renamed out of the step_%08d pattern first.
void remove_checkpoint(const std::filesystem::path& dir, FileSystem& fs = FileSystem::real());

}  // namespace keel::checkpoint
