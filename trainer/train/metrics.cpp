#include "trainer/train/metrics.h"

#include "common/error.h"

#include <fmt/format.h>
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
  std::string kept;
  if (first_step > 0) {
    std::ifstream in(path_);
    for (std::string line; std::getline(in, line);) {
      const auto record = nlohmann::json::parse(line, nullptr, false);
      if (record.is_object() && record.contains("step") && record["step"].is_number_integer() &&
          record["step"].get<int64_t>() < first_step) {
        kept += line + "\n";
      }
    }
  }
  file_ = std::fopen(path_.c_str(), "w");
  if (file_ != nullptr && !kept.empty()) std::fwrite(kept.data(), 1, kept.size(), file_);
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
