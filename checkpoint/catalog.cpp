#include "checkpoint/catalog.h"

#include "checkpoint/manifest.h"
#include "checkpoint/paths.h"
#include "common/error.h"

#include <fmt/format.h>

#include <algorithm>

namespace keel::checkpoint {

std::vector<CatalogEntry> committed(const std::filesystem::path& root) {
  std::vector<CatalogEntry> entries;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(root, ec)) {
    const auto step = step_of(entry.path());
    if (!step || !entry.is_directory() || !std::filesystem::exists(entry.path() / kManifestFile)) continue;
    entries.push_back(CatalogEntry{*step, entry.path()});
  }
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
  return entries;
}

std::optional<CatalogEntry> newest_loadable(
    const std::filesystem::path& root, bool verify,
    const std::function<void(const std::filesystem::path&, const std::string&)>& on_skip) {
  auto entries = committed(root);
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    std::string why;
    try {
      const Manifest manifest = read_manifest(it->dir);
      if (manifest.step != it->step) {
        why = fmt::format("its manifest says step {}", manifest.step);
      } else if (verify) {
        const auto problems = verify_files(it->dir, manifest);
        if (!problems.empty()) why = problems.front();
      }
    } catch (const common::Error& e) {
      why = e.what();
    }
    if (why.empty()) return *it;
    on_skip(it->dir, why);
  }
  return std::nullopt;
}

std::vector<CatalogEntry> prune_candidates(const std::vector<CatalogEntry>& entries, int64_t keep, int64_t keep_every) {
  std::vector<CatalogEntry> doomed;
  const size_t kept_newest = static_cast<size_t>(std::max<int64_t>(keep, 0));
  for (size_t i = 0; i + kept_newest < entries.size(); ++i) {
    if (keep_every > 0 && entries[i].step % keep_every == 0) continue;
    doomed.push_back(entries[i]);
  }
  return doomed;
}

void remove_checkpoint(const std::filesystem::path& dir) {
  auto doomed = dir;
  doomed += ".deleting";
  std::error_code ec;
  std::filesystem::rename(dir, doomed, ec);
  if (ec) throw common::Error(common::ErrorCode::kCheckpointFailure,
                              fmt::format("cannot remove {}: {}", dir.string(), ec.message()));
  fsync_path(dir.parent_path());
  std::filesystem::remove_all(doomed, ec);
}

}  // namespace keel::checkpoint
