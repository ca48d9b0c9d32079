// A keel checkpoint as a Hugging Face model directory (docs/architecture.md
// "Outside formats"): config.json and model.safetensors, or past
// `max_shard_bytes` model-0000k-of-0000n.safetensors with
// model.safetensors.index.json, as Hugging Face's save_pretrained splits a
// model. What `keelctl export` runs.
#pragma once

#include "interop/safetensors.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace keel::interop {

struct HfExportProgress {
  size_t tensors_done = 0, tensors = 0;
  uint64_t bytes_done = 0, bytes = 0;  // of tensor data
  double seconds = 0;
};

struct HfExportOptions {
  // One checkpoint (a directory with manifest.json), or a run's checkpoint
  // directory, whose newest committed checkpoint is taken.
  std::filesystem::path checkpoint;
  std::filesystem::path out;  // must not exist
  TensorDtype dtype = TensorDtype::kF32;
  uint64_t max_shard_bytes = 5'000'000'000;  // Hugging Face's default "5GB"
  std::function<void(const HfExportProgress&)> progress;  // after each tensor
};

struct HfExportReport {
  std::filesystem::path checkpoint;  // the checkpoint exported
  int64_t step = 0;
  std::filesystem::path out;
  std::vector<std::string> files;  // written, relative to out
  size_t tensors = 0;
  uint64_t bytes = 0;  // of every file written
  double seconds = 0;
  nlohmann::json to_json() const;
};

// Verifies the checkpoint's every file against its manifest's checksum (as
// a resume with checkpoint.verify = "full" does), reads each tensor whole
// through the resharding reader (any layout), drops the padded vocabulary
// rows and writes the model as options.dtype: the float32 master weights
// where the run kept them beside bf16 ones. Everything is written into a
// hidden directory beside `out`, fsynced, then renamed to `out`, so that a
// partial export never looks complete. Throws Error(kBadConfig) for a bad
// request (out exists, no checkpoint there, a model Hugging Face has no
// class for) and Error(kCheckpointFailure) for a checkpoint that does not
// verify or an export that cannot be written, each naming what to change.
HfExportReport export_hf(const HfExportOptions& options);

}  // namespace keel::interop
