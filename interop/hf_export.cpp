#include "interop/hf_export.h"

#include "checkpoint/catalog.h"
#include "checkpoint/manifest.h"
#include "checkpoint/reader.h"
#include "common/atomic_file.h"
#include "common/clock.h"
#include "common/config.h"
#include "common/error.h"
#include "interop/hf_names.h"

#include <fmt/format.h>

#include <chrono>

namespace keel::interop {
namespace {

using common::Error;
using common::ErrorCode;

std::filesystem::path chosen_checkpoint(const std::filesystem::path& given) {
  if (std::filesystem::exists(given / "manifest.json")) return given;
  const auto entries = checkpoint::committed(given);
  if (entries.empty()) {
    throw Error(ErrorCode::kBadConfig,
                fmt::format("{} is neither a checkpoint (no manifest.json) nor a directory of committed checkpoints; "
                            "name a step_NNNNNNNN directory or a run's checkpoints/",
                            given.string()));
  }
  return entries.back().dir;
}

// The model a checkpoint was saved with, checked as its run's config was:
// the manifest holds every section of that config.
common::ModelConfig saved_model(const checkpoint::Manifest& manifest, const std::filesystem::path& dir) {
  if (!manifest.config.is_object() || !manifest.config.contains("model")) {
    throw Error(ErrorCode::kCheckpointFailure, fmt::format("{}/manifest.json holds no model config", dir.string()));
  }
  std::vector<std::string> sets;
  for (const auto& [section, keys] : manifest.config.items()) {
    if (!keys.is_object()) continue;
    for (const auto& [key, value] : keys.items()) sets.push_back(fmt::format("{}.{}={}", section, key, value.dump()));
  }
  return common::Config::parse("", (dir / "manifest.json").string(), dir, sets).model;
}

// Shards of at most `limit` bytes of data, tensors in order; a tensor past
// the limit alone gets a shard of its own.
std::vector<std::vector<size_t>> shard(const std::vector<TensorToWrite>& tensors, TensorDtype dtype, uint64_t limit) {
  std::vector<std::vector<size_t>> shards(1);
  uint64_t in_shard = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t bytes = static_cast<uint64_t>(tensors[i].numel()) * dtype_bytes(dtype);
    if (!shards.back().empty() && in_shard + bytes > limit) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += bytes;
  }
  return shards;
}

std::string shard_name(size_t k, size_t n) {
  return n == 1 ? std::string("model.safetensors") : fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, n);
}

}  // namespace

nlohmann::json HfExportReport::to_json() const {
  return {{"checkpoint", checkpoint.string()}, {"step", step},   {"out", out.string()},
          {"files", files},                    {"tensors", tensors}, {"bytes", bytes},
          {"seconds", seconds}};
}

HfExportReport export_hf(const HfExportOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  HfExportReport report;
  report.out = options.out;
  if (std::filesystem::exists(options.out)) {
    throw Error(ErrorCode::kBadConfig, fmt::format("{} exists: an export writes a new directory, so name another "
                                                   "--out or move that one away",
                                                   options.out.string()));
  }
  report.checkpoint = chosen_checkpoint(options.checkpoint);
  const auto& dir = report.checkpoint;
  checkpoint::CheckpointReader reader(dir);
  report.step = reader.manifest().step;
  const auto problems = checkpoint::verify_files(dir, reader.manifest());
  if (!problems.empty()) {
    throw Error(ErrorCode::kCheckpointFailure,
                fmt::format("checkpoint {} does not verify, so it is not exported: {}", dir.string(), problems.front()));
  }
  const common::ModelConfig model = saved_model(reader.manifest(), dir);
  const auto hf = hf_tensors(model);
  const std::string group = "/" + reader.weights_group() + "/";

  std::vector<TensorToWrite> tensors;
  HfExportProgress progress;
  for (const auto& t : hf) {
    tensors.push_back({t.name, t.shape});
    progress.bytes += static_cast<uint64_t>(tensors.back().numel()) * dtype_bytes(options.dtype);
  }
  progress.tensors = tensors.size();
  // keel's rows [0, rows) of the tensor, turned to Hugging Face's layout.
  std::vector<float> keel_rows;
  auto fill = [&](size_t i, float* dst) {
    const HfTensor& t = hf[i];
    const int64_t rows = t.rows();
    const int64_t cols = t.keel_shape.size() == 2 ? t.keel_shape[1] : 1;
    if (!t.transposed) {
      reader.read(group + t.keel_name, 0, 0, rows, cols, dst);
    } else {
      keel_rows.resize(static_cast<size_t>(rows * cols));
      reader.read(group + t.keel_name, 0, 0, rows, cols, keel_rows.data());
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = keel_rows[static_cast<size_t>(r * cols + c)];
      }
    }
    progress.tensors_done += 1;
    progress.bytes_done += static_cast<uint64_t>(rows * cols) * dtype_bytes(options.dtype);
    progress.seconds = common::seconds_since(start);
    if (options.progress) options.progress(progress);
  };

  // Written beside `out` under a name no reader takes for a model, then renamed.
  const auto parent = options.out.has_parent_path() ? options.out.parent_path() : std::filesystem::path(".");
  std::filesystem::create_directories(parent);
  const auto partial = parent / ("." + options.out.filename().string() + ".partial");
  std::filesystem::remove_all(partial);  // a crashed export's, never complete
  std::filesystem::create_directory(partial);
  try {
    const auto shards = shard(tensors, options.dtype, options.max_shard_bytes);
    nlohmann::json weight_map = nlohmann::json::object();
    uint64_t data_bytes = 0;
    for (size_t k = 0; k < shards.size(); ++k) {
      std::vector<TensorToWrite> in_shard;
      for (size_t i : shards[k]) in_shard.push_back(tensors[i]);
      const std::string file = shard_name(k, shards.size());
      write_safetensors(partial / file, in_shard, options.dtype, [&](size_t j, float* dst) { fill(shards[k][j], dst); });
      report.files.push_back(file);
      for (const auto& t : in_shard) {
        weight_map[t.name] = file;
        data_bytes += static_cast<uint64_t>(t.numel()) * dtype_bytes(options.dtype);
      }
    }
    if (shards.size() > 1) {
      const nlohmann::json index = {{"metadata", {{"total_size", data_bytes}}}, {"weight_map", weight_map}};
      common::write_file_atomically(partial / "model.safetensors.index.json", index.dump(2) + "\n", 0644,
                                    ErrorCode::kCheckpointFailure);
      report.files.push_back("model.safetensors.index.json");
    }
    common::write_file_atomically(partial / "config.json", hf_config(model, options.dtype).dump(2) + "\n", 0644,
                                  ErrorCode::kCheckpointFailure);
    report.files.push_back("config.json");
    checkpoint::fsync_path(partial);
    std::filesystem::rename(partial, options.out);
    checkpoint::fsync_path(parent);
  } catch (const std::filesystem::filesystem_error& e) {
    std::filesystem::remove_all(partial);
    throw Error(ErrorCode::kCheckpointFailure, fmt::format("cannot write the export {}: {}", options.out.string(), e.what()));
  } catch (...) {
    std::filesystem::remove_all(partial);
    throw;
  }
  for (const auto& file : report.files) report.bytes += std::filesystem::file_size(options.out / file);
  report.tensors = tensors.size();
  report.seconds = common::seconds_since(start);
  return report;
}

}  // namespace keel::interop
