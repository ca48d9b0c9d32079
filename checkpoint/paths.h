// Where a checkpoint's files live (docs/architecture.md "Checkpoints", fixed):
// <root>/step_%08d/{rank-%05d.h5, index.h5, manifest.json}, written under
// <root>/step_%08d.partial/ until committed.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

namespace keel::checkpoint {

inline constexpr const char* kIndexFile = "index.h5";
inline constexpr const char* kManifestFile = "manifest.json";

std::filesystem::path step_dir(const std::filesystem::path& root, int64_t step);
std::filesystem::path partial_dir(const std::filesystem::path& root, int64_t step);
std::string rank_file_name(int rank);
// The step of a committed checkpoint directory's name ("step_00000120"),
// nothing for anything else (a .partial directory, a stray file).
std::optional<int64_t> step_of(const std::filesystem::path& dir);

}  // namespace keel::checkpoint
