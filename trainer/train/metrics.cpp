#include "trainer/train/metrics.h"

#include "common/error.h"

#include <fmt/format.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

namespace keel::trainer {

MetricsWriter::MetricsWriter(const std::filesystem::path& run_dir, int64_t first_step)
    : path_(run_dir / "metrics.jsonl") {
  std::error_code ec;
  std::filesystem::create_directories(run_dir, ec);
  auto fail = [&](const std::filesystem::path& path) {
    throw common::Error(common::ErrorCode::kBadConfig,
                        fmt::format("cannot write {}: {}; set job.run_dir to a writable directory", path.string(),
                                    std::strerror(errno)));
  };
  // The records kept go to a new file that replaces the old one by rename,
  // so a crash at any moment leaves the whole old history or the new file,
  // never a half-rewritten one.
  auto fresh = path_;
  fresh += ".new";
  std::FILE* out = std::fopen(fresh.c_str(), "w");
  if (out == nullptr) fail(fresh);
  std::ifstream in(path_);
  for (std::string line; std::getline(in, line);) {
    const auto record = nlohmann::json::parse(line, nullptr, false);
    if (record.is_object() && record.contains("step") && record["step"].is_number_integer() &&
        record["step"].get<int64_t>() < first_step) {
      line += "\n";
      if (std::fwrite(line.data(), 1, line.size(), out) != line.size()) fail(fresh);
    }
  }
  if (std::fflush(out) != 0 || ::fsync(fileno(out)) != 0) fail(fresh);
  std::fclose(out);
  if (std::rename(fresh.c_str(), path_.c_str()) != 0) fail(path_);
  const int dir = ::open(run_dir.c_str(), O_RDONLY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
  file_ = std::fopen(path_.c_str(), "a");
  if (file_ == nullptr) fail(path_);
}

MetricsWriter::~MetricsWriter() { close(); }

void MetricsWriter::write(const nlohmann::json& record) {
  std::string line = record.dump() + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0) {
    throw common::Error(common::ErrorCode::kInternal,
                        fmt::format("cannot append to {}: {}", path_.string(), std::strerror(errno)));
  }
}

void MetricsWriter::close() {
  if (file_ == nullptr) return;
  std::fflush(file_);
  fsync(fileno(file_));
  std::fclose(file_);
  file_ = nullptr;
}

}  // namespace keel::trainer
