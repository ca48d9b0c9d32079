// The parts a model is made of (docs/architecture.md "Model"). GPT-2 and
// Llama are two settings of one decoder: a block is a norm, attention (its
// query heads sharing key/value heads, positions learned or rotary), a norm
// and an MLP (GELU or SwiGLU, dense or experts of either), with or without
// biases, under a head tied to the token embedding or not. The parameter
// table, the model and every layout read these settings, never the
// family's name; only the tensor names differ, each family keeping its own
// (nanoGPT's for GPT-2, Hugging Face's for Llama) so stock tools read
// keel's checkpoints.
#pragma once

#include "common/config.h"

#include <cstdint>
#include <string>

namespace keel::trainer {

struct ModelParts {
  enum class Norm { kLayerNorm, kRmsNorm };
  enum class Positions { kLearned, kRotary };
  enum class Mlp { kGelu, kSwiGlu };
  // What a tensor is to the model: code finds tensors by role, checkpoints
  // by name. One GEMM multiplies attention's query, key and value rows
  // (GPT-2's fused c_attn; Llama's q_proj, k_proj and v_proj, packed) and
  // SwiGLU's gate and up rows (gate_proj and up_proj, packed): see
  // ParamSpec::packed.
  enum class Role {
    kTokenEmbedding,
    kPositionEmbedding,
    kFinalNorm,
    kFinalNormBias,
    kHead,  // an untied LM head
    kNorm1,
    kNorm1Bias,
    kQkv,  // the queries (with the keys and values where they are one tensor)
    kQkvBias,
    kKeys,
    kValues,
    kAttentionOut,
    kAttentionOutBias,
    kNorm2,
    kNorm2Bias,
    kRouter,
    kMlpIn,  // GELU's input, or SwiGLU's gate
    kMlpInBias,
    kMlpUp,  // SwiGLU's up
    kMlpOut,
    kMlpOutBias,
  };

  Norm norm = Norm::kLayerNorm;
  Positions positions = Positions::kLearned;
  Mlp mlp = Mlp::kGelu;
  bool biases = true;
  bool tied_head = true;
  // GPT-2 draws the projections into the residual stream with std
  // 0.02 / sqrt(2 n_layer), so the stream's variance does not grow with
  // depth; Llama (Hugging Face's init) draws every weight with std 0.02.
  bool depth_scaled_init = true;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  int64_t mlp_width = 0;  // the hidden width of the MLP and of each expert
  double norm_eps = 1e-5;

  // The parts `model.arch` and the keys refining it choose.
  static ModelParts of(const common::ModelConfig& model);

  // The name a tensor is saved under; `layer` and `expert` place block and
  // expert tensors.
  std::string name(Role role, int64_t layer = -1, int64_t expert = -1) const;

 private:
  bool hf_names_ = false;
};

}  // namespace keel::trainer
