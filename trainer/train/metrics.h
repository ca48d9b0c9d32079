// run_dir/metrics.jsonl (docs/architecture.md "Run directory"): one JSON object per optimizer step,
// written by rank 0. Each line is flushed as it is written so a crash loses
// at most the line in flight; close() fsyncs.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <filesystem>

namespace keel::trainer {

class MetricsWriter {
 public:
  // Creates run_dir if needed and opens metrics.jsonl for the steps from
  // `first_step` on: the records of earlier steps are kept (a resumed run
  // continues the file), later ones dropped (they are trained again). The
  // file is replaced by rename, never rewritten in place.
  // Throws Error(kBadConfig) when the run directory cannot be written.
  explicit MetricsWriter(const std::filesystem::path& run_dir, int64_t first_step = 0);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  void write(const nlohmann::json& record);
  void close();

 private:
  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
};

}  // namespace keel::trainer
