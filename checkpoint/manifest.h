// manifest.json (docs/architecture.md "Checkpoints"): written last, it is what makes a directory a
// checkpoint. It names every file with its size and XXH3-64 checksum, so a
// truncated, corrupted or missing file is caught before anything trusts it
// (a virtual dataset would silently read fill values for a missing piece).
#pragma once

#include "checkpoint/file_system.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace keel::checkpoint {

struct ManifestFile {
  std::string name;   // relative to the checkpoint directory
  uint64_t bytes = 0;
  std::string xxh3;   // 16 hex digits
};

struct Manifest {
  int64_t step = 0;     // optimizer steps completed: training resumes at this step
  int64_t tokens = 0;   // tokens trained on
  std::string created;  // UTC, ISO 8601
  nlohmann::json config;
  nlohmann::json layout;  // {"world_size", "dp", "tp", "pp", "cp", "ep", "zero"}
  std::vector<ManifestFile> files;

  nlohmann::json to_json() const;
  // Throws Error(kCheckpointFailure) naming the problem.
  static Manifest from_json(const nlohmann::json& json);
};

// Writes dir/manifest.json and fsyncs it. Throws Error(kCheckpointFailure).
void write_manifest(const std::filesystem::path& dir, const Manifest& manifest);
// Throws Error(kCheckpointFailure) when it is missing or malformed.
Manifest read_manifest(const std::filesystem::path& dir);

// XXH3-64 of a whole file as 16 hex digits; throws Error(kCheckpointFailure).
std::string file_xxh3(const std::filesystem::path& path);
// One sentence per file of the manifest that is missing, has another size
// or (with `checksums`) another checksum; empty when every file matches.
// A file that cannot be read throws Error(kCheckpointFailure): a read error
// is not evidence of damage.
std::vector<std::string> verify_files(const std::filesystem::path& dir, const Manifest& manifest,
                                      bool checksums = true, FileSystem& fs = FileSystem::real());

// fsync of a file or a directory; throws Error(kCheckpointFailure).
void fsync_path(const std::filesystem::path& path);

}  // namespace keel::checkpoint
