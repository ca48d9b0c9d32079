// Hugging Face's safetensors files (docs/architecture.md "Outside
// formats"): an 8-byte little-endian header length N, N bytes of a JSON
// header
//   {"NAME": {"dtype": "F32", "shape": [rows, cols], "data_offsets": [begin, end]},
//    ..., "__metadata__": {"format": "pt"}}
// then the tensors' bytes, little-endian and row-major, `data_offsets`
// counting from the end of the header. Big models split over several such
// files, which model.safetensors.index.json maps tensor by tensor.
#pragma once

#include "common/error.h"

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace keel::interop {

// The element types keel reads: what published weights come in (F32,
// BF16, F16). Export writes F32 or BF16.
enum class TensorDtype { kF32, kBF16, kF16 };
const char* dtype_name(TensorDtype dtype);  // "F32", "BF16", "F16": the header's spelling
size_t dtype_bytes(TensorDtype dtype);

struct TensorEntry {
  std::string name;
  TensorDtype dtype = TensorDtype::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // of its bytes, from the end of the header
  int64_t numel() const;
};

// One safetensors file, mapped read-only and checked whole when opened:
// the header's length against the file, the header as JSON, and every
// entry's dtype, shape and offsets against each other, the other entries
// (no two overlap) and the file's end. A file that fails any of them is
// refused with Error(kDataError) naming the file and what is wrong.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // Every tensor, in the order of its bytes in the file.
  const std::vector<TensorEntry>& tensors() const { return tensors_; }
  // The tensor named `name`; nullptr when the file has none.
  const TensorEntry* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Its elements as float32 (BF16 and F16 widen exactly): dst holds numel().
  void read(const TensorEntry& tensor, float* dst) const;

 private:
  std::filesystem::path path_;
  const std::byte* mapped_ = nullptr;
  size_t size_ = 0;
  size_t data_start_ = 0;  // 8 + the header's length
  std::vector<TensorEntry> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A tensor to write: its name and shape; its values come from a callback,
// so that a model need never be held whole in memory.
struct TensorToWrite {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel() const;
};

// Writes `tensors` as `dtype` (F32 or BF16) into the file `path` (created, never
// replaced), in the order given, with {"format": "pt"} as its metadata
// (what Hugging Face's loaders ask for). fill(i, dst) puts tensor i's
// numel() values, float32, row-major, into dst; BF16 rounds them to
// nearest-even. The file is fsynced before this returns. Throws
// Error(kCheckpointFailure) on an I/O error, naming the file.
void write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                       TensorDtype dtype, const std::function<void(size_t, float*)>& fill);

// Its bytes once written: the header (padded to 8 bytes, as the reference
// writer pads it) and the data.
uint64_t safetensors_bytes(const std::vector<TensorToWrite>& tensors, TensorDtype dtype);

}  // namespace keel::interop
