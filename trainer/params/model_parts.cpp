#include "trainer/params/model_parts.h"

#include <stdexcept>

namespace keel::trainer {

ModelParts ModelParts::of(const common::ModelConfig& model) {
  ModelParts parts;
  const bool llama = model.llama();
  parts.norm = llama ? Norm::kRmsNorm : Norm::kLayerNorm;
  parts.positions = llama ? Positions::kRotary : Positions::kLearned;
  parts.mlp = llama ? Mlp::kSwiGlu : Mlp::kGelu;
  parts.biases = !llama;
  parts.tied_head = model.tie_embeddings;
  parts.depth_scaled_init = !llama;
  parts.heads = model.n_head;
  parts.kv_heads = model.kv_heads();
  parts.head_dim = model.head_dim();
  parts.mlp_width = model.mlp_width();
  parts.norm_eps = llama ? model.norm_epsilon() : 1e-5;
  parts.hf_names_ = llama;
  return parts;
}

std::string ModelParts::name(Role role, int64_t layer, int64_t expert) const {
  const std::string i = std::to_string(layer), e = std::to_string(expert);
  auto missing = [&]() -> std::string {
    throw std::invalid_argument("tensor role " + std::to_string(static_cast<int>(role)) + " is not a part of this model");
  };
  if (!hf_names_) {
    // nanoGPT's names, as keel has always saved GPT-2.
    const std::string h = "h." + i + ".", mlp = expert >= 0 ? h + "moe.experts." + e + "." : h + "mlp.";
    switch (role) {
      case Role::kTokenEmbedding: return "wte";
      case Role::kPositionEmbedding: return "wpe";
      case Role::kFinalNorm: return "ln_f.weight";
      case Role::kFinalNormBias: return "ln_f.bias";
      case Role::kHead: return "lm_head.weight";
      case Role::kNorm1: return h + "ln_1.weight";
      case Role::kNorm1Bias: return h + "ln_1.bias";
      case Role::kQkv: return h + "attn.c_attn.weight";
      case Role::kQkvBias: return h + "attn.c_attn.bias";
      case Role::kAttentionOut: return h + "attn.c_proj.weight";
      case Role::kAttentionOutBias: return h + "attn.c_proj.bias";
      case Role::kNorm2: return h + "ln_2.weight";
      case Role::kNorm2Bias: return h + "ln_2.bias";
      case Role::kRouter: return h + "moe.router.weight";
      case Role::kMlpIn: return mlp + "c_fc.weight";
      case Role::kMlpInBias: return mlp + "c_fc.bias";
      case Role::kMlpOut: return mlp + "c_proj.weight";
      case Role::kMlpOutBias: return mlp + "c_proj.bias";
      case Role::kKeys:
      case Role::kValues:
      case Role::kMlpUp: return missing();
    }
    return missing();
  }
  // Hugging Face's LlamaForCausalLM names, and MixtralForCausalLM's for
  // experts (w1 the gate, w3 the up, w2 the down projection).
  const std::string h = "model.layers." + i + ".", x = h + "block_sparse_moe.experts." + e + ".";
  const bool in_expert = expert >= 0;
  switch (role) {
    case Role::kTokenEmbedding: return "model.embed_tokens.weight";
    case Role::kFinalNorm: return "model.norm.weight";
    case Role::kHead: return "lm_head.weight";
    case Role::kNorm1: return h + "input_layernorm.weight";
    case Role::kQkv: return h + "self_attn.q_proj.weight";
    case Role::kKeys: return h + "self_attn.k_proj.weight";
    case Role::kValues: return h + "self_attn.v_proj.weight";
    case Role::kAttentionOut: return h + "self_attn.o_proj.weight";
    case Role::kNorm2: return h + "post_attention_layernorm.weight";
    case Role::kRouter: return h + "block_sparse_moe.gate.weight";
    case Role::kMlpIn: return in_expert ? x + "w1.weight" : h + "mlp.gate_proj.weight";
    case Role::kMlpUp: return in_expert ? x + "w3.weight" : h + "mlp.up_proj.weight";
    case Role::kMlpOut: return in_expert ? x + "w2.weight" : h + "mlp.down_proj.weight";
    default: return missing();
  }
}

}  // namespace keel::trainer
