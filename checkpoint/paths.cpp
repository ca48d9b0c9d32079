#include "checkpoint/paths.h"

#include <fmt/format.h>

#include <cctype>

namespace keel::checkpoint {

std::filesystem::path step_dir(const std::filesystem::path& root, int64_t step) {
  return root / fmt::format("step_{:08d}", step);
}

std::filesystem::path partial_dir(const std::filesystem::path& root, int64_t step) {
  return root / fmt::format("step_{:08d}.partial", step);
}

std::string rank_file_name(int rank) { return fmt::format("rank-{:05d}.h5", rank); }

std::optional<int64_t> step_of(const std::filesystem::path& dir) {
  const std::string name = dir.filename().string();
  constexpr std::string_view prefix = "step_";
  if (name.size() != prefix.size() + 8 || !name.starts_with(prefix)) return std::nullopt;
  int64_t step = 0;
  for (char c : name.substr(prefix.size())) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return std::nullopt;
    step = step * 10 + (c - '0');
  }
  return step;
}

}  // namespace keel::checkpoint
