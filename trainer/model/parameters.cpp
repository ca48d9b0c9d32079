#include "trainer/model/parameters.h"

#include "common/counter_rng.h"

#include <cmath>
#include <stdexcept>

namespace keel::trainer {

ParameterTable::ParameterTable(const common::ModelConfig& m) {
  const int64_t C = m.n_embd;
  // GPT-2 scales the init of every projection into the residual stream by
  // 1/sqrt(2L) so the stream's variance does not grow with depth.
  const float proj_std = 0.02f / std::sqrt(2.0f * static_cast<float>(m.n_layer));
  auto linear = [&](const std::string& prefix, int64_t out, int64_t in, float std) {
    add(prefix + ".weight", {out, in}, InitKind::kNormal, std);
    add(prefix + ".bias", {out}, InitKind::kZeros);
  };
  auto layernorm = [&](const std::string& prefix) {
    add(prefix + ".weight", {C}, InitKind::kOnes);
    add(prefix + ".bias", {C}, InitKind::kZeros);
  };

  add("wte", {m.padded_vocab(), C}, InitKind::kNormal);
  add("wpe", {m.seq_len, C}, InitKind::kNormal);
  for (int64_t i = 0; i < m.n_layer; ++i) {
    const std::string h = "h." + std::to_string(i);
    layernorm(h + ".ln_1");
    linear(h + ".attn.c_attn", 3 * C, C, 0.02f);
    linear(h + ".attn.c_proj", C, C, proj_std);
    layernorm(h + ".ln_2");
    if (m.is_moe_layer(i)) {
      add(h + ".moe.router.weight", {m.n_expert, C}, InitKind::kNormal);
      for (int64_t e = 0; e < m.n_expert; ++e) {
        const std::string expert = h + ".moe.experts." + std::to_string(e);
        linear(expert + ".c_fc", 4 * C, C, 0.02f);
        linear(expert + ".c_proj", C, 4 * C, proj_std);
      }
    } else {
      linear(h + ".mlp.c_fc", 4 * C, C, 0.02f);
      linear(h + ".mlp.c_proj", C, 4 * C, proj_std);
    }
  }
  layernorm("ln_f");
}

void ParameterTable::add(std::string name, std::vector<int64_t> shape, InitKind init, float init_std) {
  size_t numel = 1;
  for (int64_t d : shape) numel *= static_cast<size_t>(d);
  // Every tensor starts on a 16-float boundary so kernels see aligned rows.
  specs_.push_back(ParamSpec{std::move(name), std::move(shape), init, init_std, total_, numel});
  total_ += (numel + 15) / 16 * 16;
}

const ParamSpec& ParameterTable::find(const std::string& name) const {
  for (const auto& spec : specs_) {
    if (spec.name == name) return spec;
  }
  throw std::out_of_range("the model has no tensor named '" + name + "'");
}

size_t ParameterTable::parameter_count() const {
  size_t count = 0;
  for (const auto& spec : specs_) count += spec.numel;
  return count;
}

void init_parameters(const ParameterTable& table, uint64_t seed, float* out) {
  for (const auto& spec : table.specs()) {
    float* p = out + spec.offset;
    switch (spec.init) {
      case InitKind::kZeros:
        std::fill(p, p + spec.numel, 0.0f);
        break;
      case InitKind::kOnes:
        std::fill(p, p + spec.numel, 1.0f);
        break;
      case InitKind::kNormal: {
        const uint64_t key = common::stream_key(seed, spec.name);
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < spec.numel; ++i) {
          p[i] = static_cast<float>(spec.init_std * common::counter_normal(key, i));
        }
        break;
      }
    }
  }
}

}  // namespace keel::trainer
