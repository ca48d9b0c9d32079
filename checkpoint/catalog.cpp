#include "checkpoint/catalog.h"

#include "checkpoint/manifest.h"
#include "checkpoint/paths.h"
#include "common/error.h"
#include "common/log.h"

#include <fmt/format.h>

#include <algorithm>
#include <thread>

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

Inspection inspect(const CatalogEntry& entry, Depth depth, FileSystem& fs) {
  Manifest manifest;
  try {
    manifest = read_manifest(entry.dir);
  } catch (const common::Error& e) {
    return {Inspection::State::kDamaged, e.what()};
  }
  if (manifest.step != entry.step) {
    return {Inspection::State::kDamaged, fmt::format("its manifest says step {}", manifest.step)};
  }
  try {
    const auto problems = verify_files(entry.dir, manifest, depth == Depth::kChecksums, fs);
    if (!problems.empty()) return {Inspection::State::kDamaged, problems.front()};
  } catch (const common::Error& e) {
    return {Inspection::State::kUnreadable, e.what()};
  }
  return {};
}

std::optional<CatalogEntry> choose_resume(
    const std::filesystem::path& root, const ResumeOptions& options,
    const std::function<void(const std::filesystem::path&, const std::string&)>& on_skip, FileSystem& fs) {
  auto log = common::logger("checkpoint");
  const auto entries = committed(root);
  std::vector<std::string> reasons;
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    Inspection found = inspect(*it, options.depth, fs);
    auto delay = options.retry_delay;
    for (int retry = 0; retry < options.read_retries && found.state == Inspection::State::kUnreadable; ++retry) {
      log->warn("cannot read checkpoint {} ({}); reading it again in {} ms", it->dir.string(), found.why,
                delay.count());
      std::this_thread::sleep_for(delay);
      delay *= 2;
      found = inspect(*it, options.depth, fs);
    }
    if (found.state == Inspection::State::kGood) return *it;
    if (found.state == Inspection::State::kUnreadable) {
      throw common::Error(
          common::ErrorCode::kCheckpointFailure,
          fmt::format("cannot read checkpoint {} after {} retries: {}. A read error is not a damaged checkpoint, so "
                      "the run does not fall back to an older one: fix the storage (or its permissions) and start "
                      "again",
                      it->dir.string(), options.read_retries, found.why));
    }
    on_skip(it->dir, found.why);
    reasons.push_back(fmt::format("{}: {}", it->dir.filename().string(), found.why));
  }
  if (!reasons.empty()) {
    std::string list;
    for (const auto& r : reasons) list += (list.empty() ? "" : "; ") + r;
    throw common::Error(common::ErrorCode::kCheckpointFailure,
                        fmt::format("none of the {} committed checkpoints in {} loads ({}). The run does not start "
                                    "over by itself: repair or restore a checkpoint, or start from step 0 on "
                                    "purpose with checkpoint.init_from = \"none\" (keel-trainer --init-from none)",
                                    reasons.size(), root.string(), list));
  }
  return std::nullopt;
}

std::vector<CatalogEntry> prune_candidates(const std::vector<CatalogEntry>& entries, const RetentionPolicy& policy,
                                           const std::function<bool(const CatalogEntry&)>& good) {
  // Walk from the newest: everything down to the keep-th good checkpoint stays.
  int64_t kept = 0;
  size_t cut = entries.size();
  while (cut > 0 && kept < std::max<int64_t>(policy.keep, 0)) {
    --cut;
    if (good(entries[cut])) ++kept;
  }
  if (kept < policy.keep) return {};  // fewer good checkpoints than `keep`: remove nothing
  std::vector<CatalogEntry> doomed;
  for (size_t i = 0; i < cut; ++i) {
    if (policy.keep_every > 0 && entries[i].step % policy.keep_every == 0) continue;
    if (entries[i].step == policy.protect_step) continue;
    doomed.push_back(entries[i]);
  }
  return doomed;
}

void remove_checkpoint(const std::filesystem::path& dir, FileSystem& fs) {
  auto doomed = dir;
  doomed += ".deleting";
  fs.rename(dir, doomed);
  fs.sync(dir.parent_path());
  fs.remove_all(doomed);
}

}  // namespace keel::checkpoint
