#include "trainer/params/model_parts.h"

#include <fmt/format.h>

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

namespace {

// The names of each role's tensor, by family and for a block's MLP or an
// expert's ({i}: the layer, {e}: the expert; empty: no such tensor).
// GPT-2's are nanoGPT's, as keel has always saved them; Llama's are
// Hugging Face's LlamaForCausalLM names, and MixtralForCausalLM's for
// experts (w1 the gate, w3 the up, w2 the down projection).
struct RoleNames {
  ModelParts::Role role;
  const char* gpt2;
  const char* gpt2_expert;
  const char* llama;
  const char* llama_expert;
};
using Role = ModelParts::Role;
constexpr RoleNames kNames[] = {
    {Role::kTokenEmbedding, "wte", "", "model.embed_tokens.weight", ""},
    {Role::kPositionEmbedding, "wpe", "", "", ""},
    {Role::kFinalNorm, "ln_f.weight", "", "model.norm.weight", ""},
    {Role::kFinalNormBias, "ln_f.bias", "", "", ""},
    {Role::kHead, "lm_head.weight", "", "lm_head.weight", ""},
    {Role::kNorm1, "h.{i}.ln_1.weight", "", "model.layers.{i}.input_layernorm.weight", ""},
    {Role::kNorm1Bias, "h.{i}.ln_1.bias", "", "", ""},
    {Role::kQkv, "h.{i}.attn.c_attn.weight", "", "model.layers.{i}.self_attn.q_proj.weight", ""},
    {Role::kQkvBias, "h.{i}.attn.c_attn.bias", "", "", ""},
    {Role::kKeys, "", "", "model.layers.{i}.self_attn.k_proj.weight", ""},
    {Role::kValues, "", "", "model.layers.{i}.self_attn.v_proj.weight", ""},
    {Role::kAttentionOut, "h.{i}.attn.c_proj.weight", "", "model.layers.{i}.self_attn.o_proj.weight", ""},
    {Role::kAttentionOutBias, "h.{i}.attn.c_proj.bias", "", "", ""},
    {Role::kNorm2, "h.{i}.ln_2.weight", "", "model.layers.{i}.post_attention_layernorm.weight", ""},
    {Role::kNorm2Bias, "h.{i}.ln_2.bias", "", "", ""},
    {Role::kRouter, "h.{i}.moe.router.weight", "", "model.layers.{i}.block_sparse_moe.gate.weight", ""},
    {Role::kMlpIn, "h.{i}.mlp.c_fc.weight", "h.{i}.moe.experts.{e}.c_fc.weight",
     "model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight"},
    {Role::kMlpInBias, "h.{i}.mlp.c_fc.bias", "h.{i}.moe.experts.{e}.c_fc.bias", "", ""},
    {Role::kMlpUp, "", "", "model.layers.{i}.mlp.up_proj.weight",
     "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight"},
    {Role::kMlpOut, "h.{i}.mlp.c_proj.weight", "h.{i}.moe.experts.{e}.c_proj.weight",
     "model.layers.{i}.mlp.down_proj.weight", "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight"},
    {Role::kMlpOutBias, "h.{i}.mlp.c_proj.bias", "h.{i}.moe.experts.{e}.c_proj.bias", "", ""},
};

}  // namespace

std::string ModelParts::name(Role role, int64_t layer, int64_t expert) const {
  for (const RoleNames& names : kNames) {
    if (names.role != role) continue;
    const bool in_expert = expert >= 0;
    const char* pattern = hf_names_ ? (in_expert ? names.llama_expert : names.llama)
                                    : (in_expert ? names.gpt2_expert : names.gpt2);
    if (*pattern == '\0') break;
    return fmt::format(fmt::runtime(pattern), fmt::arg("i", layer), fmt::arg("e", expert));
  }
  throw std::invalid_argument(fmt::format("this model has no tensor of role {} (layer {}, expert {})",
                                          static_cast<int>(role), layer, expert));
}

}  // namespace keel::trainer
