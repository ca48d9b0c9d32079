#include "trainer/train/metrics.h"

#include "common/error.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace keel::trainer {

MetricsWriter::MetricsWriter(const std::filesystem::path& run_dir) : path_(run_dir / "metrics.jsonl") {
  std::error_code ec;
  std::filesystem::create_directories(run_dir, ec);
  file_ = std::fopen(path_.c_str(), "w");
  if (file_ == nullptr) {
    throw common::Error(common::ErrorCode::kBadConfig,
                        fmt::format("cannot write {}: {}; set job.run_dir to a writable directory", path_.string(),
                                    std::strerror(errno)));
  }
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
