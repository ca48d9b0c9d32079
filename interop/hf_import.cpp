#include "interop/hf_import.h"

#include "common/error.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fstream>
#include <set>

namespace keel::interop {
namespace {

using common::Error;
using common::ErrorCode;

// The safetensors files of a model directory.
std::vector<std::filesystem::path> model_files(const std::filesystem::path& dir) {
  const auto index_path = dir / "model.safetensors.index.json";
  if (!std::filesystem::exists(index_path)) {
    if (!std::filesystem::exists(dir / "model.safetensors")) {
      throw Error(ErrorCode::kBadConfig,
                  fmt::format("checkpoint.init_from names {}, which holds neither model.safetensors nor "
                              "model.safetensors.index.json: name a Hugging Face model directory",
                              dir.string()));
    }
    return {dir / "model.safetensors"};
  }
  std::ifstream in(index_path);
  const auto index = nlohmann::json::parse(in, nullptr, false);
  if (index.is_discarded() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    throw Error(ErrorCode::kDataError, fmt::format("{} is not JSON with a weight_map object", index_path.string()));
  }
  std::set<std::string> files;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos) {
      throw Error(ErrorCode::kDataError,
                  fmt::format("{} maps {} to {}, not a file of the directory", index_path.string(), name, file.dump()));
    }
    files.insert(file.get<std::string>());
  }
  std::vector<std::filesystem::path> out;
  for (const auto& file : files) out.push_back(dir / file);
  return out;
}

}  // namespace

HfWeights::HfWeights(const std::filesystem::path& dir, const common::ModelConfig& model) {
  std::map<std::string, const HfTensor*> expected;  // by Hugging Face's name
  for (auto& t : hf_tensors(model)) {
    const auto& kept = by_keel_name_[t.keel_name] = std::move(t);
    expected[kept.name] = &kept;
  }
  std::vector<std::string> problems;
  for (const auto& path : model_files(dir)) {
    files_.push_back(std::make_unique<SafetensorsFile>(path));
    for (const auto& entry : files_.back()->tensors()) {
      if (hf_buffer(entry.name)) continue;
      std::string name = entry.name;
      // A bare GPT2Model saves its tensors without GPT2LMHeadModel's prefix.
      if (!model.llama() && !expected.contains(name) && expected.contains("transformer." + name)) {
        name = "transformer." + name;
      }
      const auto want = expected.find(name);
      if (want == expected.end()) {
        problems.push_back(fmt::format("{} (in {}) is not a tensor of this model", entry.name, path.filename().string()));
        continue;
      }
      if (found_.contains(want->second->keel_name)) {
        problems.push_back(fmt::format("{} is in more than one file", entry.name));
        continue;
      }
      if (entry.shape != want->second->shape) {
        problems.push_back(fmt::format("{} has shape [{}] where this model's is [{}]", entry.name,
                                       fmt::join(entry.shape, ", "), fmt::join(want->second->shape, ", ")));
      }
      found_[want->second->keel_name] = {files_.back().get(), &entry};
    }
  }
  for (const auto& [name, t] : expected) {
    if (!found_.contains(t->keel_name)) {
      problems.push_back(fmt::format("{} of shape [{}] is missing", name, fmt::join(t->shape, ", ")));
    }
  }
  if (problems.empty()) return;
  constexpr size_t kNamed = 4;  // a whole model's worth would bury the cause
  const size_t named = std::min(problems.size(), kNamed);
  throw Error(ErrorCode::kBadConfig,
              fmt::format("the weights in {} do not fit this model ({} {}): {}{}. Set [model] as the weights were "
                          "trained (their config.json says how), or import other weights",
                          dir.string(), model.arch, model.llama() ? "as LlamaForCausalLM" : "as GPT2LMHeadModel",
                          fmt::join(problems.begin(), problems.begin() + named, "; "),
                          problems.size() > named ? fmt::format(" and {} more", problems.size() - named) : ""));
}

HfWeights::~HfWeights() = default;

std::vector<float> HfWeights::global_tensor(const std::string& keel_name) const {
  const HfTensor& t = by_keel_name_.at(keel_name);
  const Found& found = found_.at(keel_name);
  const int64_t rows = t.keel_shape[0];
  const int64_t cols = t.keel_shape.size() == 2 ? t.keel_shape[1] : 1;
  std::vector<float> out(static_cast<size_t>(rows * cols), 0.0f);  // padded vocabulary rows stay 0
  if (!t.transposed) {
    found.file->read(*found.entry, out.data());
    return out;
  }
  std::vector<float> stored(static_cast<size_t>(found.entry->numel()));
  found.file->read(*found.entry, stored.data());
  const int64_t kept = t.rows();
  for (int64_t r = 0; r < kept; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[static_cast<size_t>(r * cols + c)] = stored[static_cast<size_t>(c * kept + r)];
  }
  return out;
}

}  // namespace keel::interop
