#include "interop/hf_names.h"

#include "common/error.h"
#include "trainer/params/parameters.h"

#include <fmt/format.h>

#include <string_view>

namespace keel::interop {
namespace {

using Role = trainer::ModelParts::Role;

// GPT2LMHeadModel's name of each role ({i}: the block), and whether it is
// a Conv1D weight, stored [in, out].
struct Gpt2Name {
  Role role;
  const char* name;
  bool conv1d = false;
};
constexpr Gpt2Name kGpt2Names[] = {
    {Role::kTokenEmbedding, "transformer.wte.weight"},
    {Role::kPositionEmbedding, "transformer.wpe.weight"},
    {Role::kFinalNorm, "transformer.ln_f.weight"},
    {Role::kFinalNormBias, "transformer.ln_f.bias"},
    {Role::kHead, "lm_head.weight"},
    {Role::kNorm1, "transformer.h.{i}.ln_1.weight"},
    {Role::kNorm1Bias, "transformer.h.{i}.ln_1.bias"},
    {Role::kQkv, "transformer.h.{i}.attn.c_attn.weight", true},
    {Role::kQkvBias, "transformer.h.{i}.attn.c_attn.bias"},
    {Role::kAttentionOut, "transformer.h.{i}.attn.c_proj.weight", true},
    {Role::kAttentionOutBias, "transformer.h.{i}.attn.c_proj.bias"},
    {Role::kNorm2, "transformer.h.{i}.ln_2.weight"},
    {Role::kNorm2Bias, "transformer.h.{i}.ln_2.bias"},
    {Role::kMlpIn, "transformer.h.{i}.mlp.c_fc.weight", true},
    {Role::kMlpInBias, "transformer.h.{i}.mlp.c_fc.bias"},
    {Role::kMlpOut, "transformer.h.{i}.mlp.c_proj.weight", true},
    {Role::kMlpOutBias, "transformer.h.{i}.mlp.c_proj.bias"},
};

const Gpt2Name& gpt2_name(Role role) {
  for (const auto& n : kGpt2Names) {
    if (n.role == role) return n;
  }
  throw std::logic_error(fmt::format("GPT-2 has no Hugging Face tensor of role {}", static_cast<int>(role)));
}

const char* torch_dtype(TensorDtype dtype) { return dtype == TensorDtype::kBF16 ? "bfloat16" : "float32"; }

}  // namespace

std::vector<HfTensor> hf_tensors(const common::ModelConfig& model) {
  if (model.n_expert > 0) {
    throw common::Error(common::ErrorCode::kBadConfig,
                        "this model has expert layers (model.n_expert > 0); keel does not yet map them onto a Hugging "
                        "Face class, so it exports dense models only");
  }
  const trainer::ParameterTable table(model);
  const bool llama = model.llama();
  std::vector<HfTensor> out;
  for (const auto& spec : table.specs()) {
    HfTensor t;
    t.keel_name = spec.name;
    t.keel_shape = spec.global_shape;
    if (llama) {
      t.name = spec.name;
    } else {
      const Gpt2Name& n = gpt2_name(spec.role);
      t.name = fmt::format(fmt::runtime(n.name), fmt::arg("i", spec.layer));
      t.transposed = n.conv1d;
    }
    t.shape = spec.global_shape;
    const bool vocabulary = spec.role == Role::kTokenEmbedding || spec.role == Role::kHead;
    if (vocabulary) t.shape[0] = model.vocab_size;
    if (t.transposed) std::swap(t.shape[0], t.shape[1]);
    out.push_back(std::move(t));
  }
  return out;
}

nlohmann::json hf_config(const common::ModelConfig& model, TensorDtype dtype) {
  if (model.llama()) {
    nlohmann::json rope_scaling = nullptr;
    if (model.rope_scaling_factor > 0) {
      rope_scaling = {{"rope_type", "llama3"},
                      {"factor", model.rope_scaling_factor},
                      {"low_freq_factor", model.rope_low_freq()},
                      {"high_freq_factor", model.rope_high_freq()},
                      {"original_max_position_embeddings", model.rope_context()}};
    }
    return {{"architectures", {"LlamaForCausalLM"}},
            {"model_type", "llama"},
            {"vocab_size", model.vocab_size},
            {"hidden_size", model.n_embd},
            {"intermediate_size", model.mlp_width()},
            {"num_hidden_layers", model.n_layer},
            {"num_attention_heads", model.n_head},
            {"num_key_value_heads", model.kv_heads()},
            {"head_dim", model.head_dim()},
            {"max_position_embeddings", model.seq_len},
            {"rms_norm_eps", model.norm_epsilon()},
            {"rope_theta", model.rotary_base()},
            {"rope_scaling", rope_scaling},
            {"hidden_act", "silu"},
            {"attention_bias", false},
            {"mlp_bias", false},
            {"attention_dropout", 0.0},
            {"initializer_range", 0.02},
            {"tie_word_embeddings", model.tie_embeddings},
            {"torch_dtype", torch_dtype(dtype)},
            {"use_cache", true}};
  }
  nlohmann::json config = {{"architectures", {"GPT2LMHeadModel"}},
                           {"model_type", "gpt2"},
                           {"vocab_size", model.vocab_size},
                           {"n_positions", model.seq_len},
                           {"n_ctx", model.seq_len},
                           {"n_embd", model.n_embd},
                           {"n_layer", model.n_layer},
                           {"n_head", model.n_head},
                           {"n_inner", model.mlp_width()},
                           {"activation_function", "gelu_new"},  // the tanh form keel computes (kernels/gelu.h)
                           {"layer_norm_epsilon", 1e-5},
                           {"resid_pdrop", 0.0},
                           {"embd_pdrop", 0.0},
                           {"attn_pdrop", 0.0},
                           {"scale_attn_weights", true},
                           {"initializer_range", 0.02},
                           {"tie_word_embeddings", model.tie_embeddings},
                           {"torch_dtype", torch_dtype(dtype)},
                           {"use_cache", true}};
  // GPT-2's tokenizer ends every document with token 50256.
  if (model.vocab_size == 50257) config["bos_token_id"] = config["eos_token_id"] = 50256;
  return config;
}

bool hf_buffer(const std::string& name) {
  const std::string_view n = name;
  return n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias") || n.ends_with("rotary_emb.inv_freq");
}

}  // namespace keel::interop
