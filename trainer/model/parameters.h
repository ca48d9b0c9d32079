// The model's tensors (DESIGN §3.1): names, PyTorch [out, in] shapes, how
// each is initialised, and where it sits in the flat parameter buffer.
#pragma once

#include "common/config.h"

#include <cstdint>
#include <string>
#include <vector>

namespace keel::trainer {

enum class InitKind { kNormal, kZeros, kOnes };

struct ParamSpec {
  std::string name;            // nanoGPT name, e.g. "h.0.attn.c_attn.weight"
  std::vector<int64_t> shape;  // global shape, PyTorch layout
  InitKind init = InitKind::kNormal;
  float init_std = 0.02f;      // for kNormal
  size_t offset = 0;           // first element in the flat buffer
  size_t numel = 0;

  // AdamW decays 2-D tensors only (weights and embeddings, not biases or norms).
  bool weight_decay() const { return shape.size() == 2; }
};

class ParameterTable {
 public:
  // Every tensor of the GPT described by `model`, in a fixed order.
  explicit ParameterTable(const common::ModelConfig& model);

  const std::vector<ParamSpec>& specs() const { return specs_; }
  // Floats in the flat buffer, alignment gaps between tensors included.
  size_t total() const { return total_; }
  // Model parameters, gaps excluded.
  size_t parameter_count() const;
  // Throws std::out_of_range naming the tensor when there is none.
  const ParamSpec& find(const std::string& name) const;

 private:
  void add(std::string name, std::vector<int64_t> shape, InitKind init, float init_std = 0.02f);
  std::vector<ParamSpec> specs_;
  size_t total_ = 0;
};

// Fills `out` (host memory, table.total() floats) with the initial model:
// element i of tensor `name` is N(0, std) drawn from the counter RNG keyed
// by (seed, name) at counter i, so any rank can draw exactly its own shard.
void init_parameters(const ParameterTable& table, uint64_t seed, float* out);

}  // namespace keel::trainer
