// keel's tensors as Hugging Face's model classes hold them
// (docs/architecture.md "Outside formats"): one table, keyed by
// ModelParts::Role, that export and import both read; nothing else names a
// Hugging Face tensor. Llama's keel names already are LlamaForCausalLM's;
// GPT-2's are nanoGPT's, which GPT2LMHeadModel holds under `transformer.`
// with its four Conv1D weights stored [in, out], the transpose of keel's
// [out, in].
#pragma once

#include "common/config.h"
#include "interop/safetensors.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace keel::interop {

struct HfTensor {
  std::string name;                 // Hugging Face's, e.g. "transformer.h.0.attn.c_attn.weight"
  std::string keel_name;            // the checkpoint's global tensor, e.g. "h.0.attn.c_attn.weight"
  std::vector<int64_t> keel_shape;  // as keel holds it, the padded vocabulary rows included
  std::vector<int64_t> shape;       // as Hugging Face holds it
  // Stored [in, out] (GPT-2's Conv1D): Hugging Face's element (c, r) is keel's (r, c).
  bool transposed = false;
  // keel's first rows() rows are Hugging Face's; the rest pad the vocabulary.
  int64_t rows() const { return transposed ? shape[1] : shape[0]; }
};

// Every tensor of `model` under Hugging Face's name, in keel's table order.
// Throws Error(kBadConfig) for a model no Hugging Face class holds as keel
// trains it: one with expert layers.
std::vector<HfTensor> hf_tensors(const common::ModelConfig& model);

// config.json for `model`: GPT2Config's or LlamaConfig's fields, with
// `torch_dtype` the dtype its weights are written in.
nlohmann::json hf_config(const common::ModelConfig& model, TensorDtype dtype);

// What Hugging Face's files may hold beside the weights, which import
// passes over: GPT-2's causal-mask buffers (attn.bias, attn.masked_bias)
// and rotary tables (rotary_emb.inv_freq).
bool hf_buffer(const std::string& name);

}  // namespace keel::interop
