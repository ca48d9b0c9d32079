#include "daemon/rank_log.h"

#include "common/error.h"
#include "common/events.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <string_view>

namespace keel::daemon {
namespace {

constexpr std::string_view kHeader = "===== keeld: generation ";
constexpr std::string_view kTrainer = "keel-trainer: ";

// The sentence of `line` when it is keel-trainer's last word, else empty.
std::string_view sentence_of(std::string_view line) {
  if (!line.starts_with(kTrainer)) return {};
  line.remove_prefix(kTrainer.size());
  for (auto code : common::kErrorCodes) {
    const std::string name = std::string(common::error_code_name(code)) + ": ";
    if (line.starts_with(name)) return line.substr(name.size());
  }
  return {};
}

}  // namespace

std::filesystem::path rank_log_path(const std::filesystem::path& run_dir, int rank) {
  return run_dir / "logs" / fmt::format("rank-{:05d}.log", rank);
}

std::string rank_log_header(int64_t generation, int rank) {
  return fmt::format("{}{} starts rank {} ({}) =====\n", kHeader, generation, rank, common::utc_now());
}

std::string last_error_sentence(const std::filesystem::path& log, size_t max_bytes) {
  std::ifstream in(log, std::ios::binary | std::ios::ate);
  if (!in) return "";
  const std::streamoff size = in.tellg();
  const std::streamoff from = std::max<std::streamoff>(0, size - static_cast<std::streamoff>(max_bytes));
  std::string tail(static_cast<size_t>(size - from), '\0');
  in.seekg(from);
  in.read(tail.data(), static_cast<std::streamsize>(tail.size()));
  tail.resize(static_cast<size_t>(in.gcount()));

  std::string_view rest(tail);
  if (const size_t header = rest.rfind(kHeader); header != std::string_view::npos) rest.remove_prefix(header);
  std::string_view found;
  while (!rest.empty()) {
    const size_t end = rest.find('\n');
    const std::string_view sentence = sentence_of(rest.substr(0, end));
    if (!sentence.empty()) found = sentence;
    rest.remove_prefix(end == std::string_view::npos ? rest.size() : end + 1);
  }
  return std::string(found);
}

}  // namespace keel::daemon
