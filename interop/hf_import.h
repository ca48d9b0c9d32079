// Published weights as a run's step 0 (docs/architecture.md "Outside
// formats"): checkpoint.init_from = "hf:DIR" reads a Hugging Face model
// directory through the name map export writes with (hf_names.h), and
// each rank takes its blocks of keel's global tensors from it.
#pragma once

#include "common/config.h"
#include "interop/hf_names.h"
#include "interop/safetensors.h"

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace keel::interop {

class HfWeights {
 public:
  // Opens DIR's model.safetensors, or every file its
  // model.safetensors.index.json names, and checks that together they
  // hold exactly the tensors of `model` under Hugging Face's names (GPT-2's
  // with or without the `transformer.` prefix a bare GPT2Model saves;
  // buffers such as attn.bias passed over), each of its shape. Error
  // (kBadConfig) names the tensors that are missing, extra or of another
  // shape, with the shape expected and the one found; Error(kDataError) a
  // file that does not read as safetensors.
  HfWeights(const std::filesystem::path& dir, const common::ModelConfig& model);
  ~HfWeights();

  // keel's global tensor `keel_name` as keel lays it out, [rows, cols]
  // row-major with the padded vocabulary rows zero.
  std::vector<float> global_tensor(const std::string& keel_name) const;

 private:
  struct Found {
    const SafetensorsFile* file = nullptr;
    const TensorEntry* entry = nullptr;
  };
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, HfTensor> by_keel_name_;
  std::map<std::string, Found> found_;  // by keel's name
};

}  // namespace keel::interop
