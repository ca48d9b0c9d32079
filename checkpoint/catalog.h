// The checkpoints of a run directory: which are committed, which is the
// newest that still loads, and which retention removes.
#pragma once

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

// The newest committed checkpoint whose manifest parses and, with `verify`,
// whose files all match their sizes and checksums. Each newer one passed
// over is reported through on_skip(dir, why).
std::optional<CatalogEntry> newest_loadable(
    const std::filesystem::path& root, bool verify,
    const std::function<void(const std::filesystem::path&, const std::string&)>& on_skip);

// The committed checkpoints retention removes: all but the newest `keep`
// and those whose step is a multiple of keep_every (0: none such).
std::vector<CatalogEntry> prune_candidates(const std::vector<CatalogEntry>& entries, int64_t keep, int64_t keep_every);

// Removes a checkpoint so that a crash halfway never leaves something that
// looks committed: it is renamed out of the step_%08d pattern first.
void remove_checkpoint(const std::filesystem::path& dir);

}  // namespace keel::checkpoint
