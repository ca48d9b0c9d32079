#include "trainer/model/rotary_table.h"

#include <cmath>
#include <numbers>

namespace keel::trainer {

std::vector<double> rotary_frequencies(const common::ModelConfig& model) {
  const int64_t d = model.n_embd / model.n_head;
  std::vector<double> f(static_cast<size_t>(d / 2));
  for (int64_t j = 0; j < d / 2; ++j) {
    const double exponent = static_cast<double>(2 * j) / static_cast<double>(d);
    f[static_cast<size_t>(j)] = 1.0 / std::pow(model.rotary_base(), exponent);
  }
  if (model.rope_scaling_factor <= 0) return f;
  const double factor = model.rope_scaling_factor;
  const double low = model.rope_low_freq();
  const double high = model.rope_high_freq();
  const double context = static_cast<double>(model.rope_context());
  for (double& freq : f) {
    // Both bounds of the band belong to the blend, where s is 0 and 1.
    const double wavelength = 2.0 * std::numbers::pi / freq;
    if (wavelength < context / high) continue;
    if (wavelength > context / low) {
      freq /= factor;
      continue;
    }
    const double smooth = (context / wavelength - low) / (high - low);
    freq = (1.0 - smooth) * freq / factor + smooth * freq;
  }
  return f;
}

RotaryTable rotary_table(const common::ModelConfig& model) {
  const std::vector<double> f = rotary_frequencies(model);
  RotaryTable t;
  t.cos.resize(static_cast<size_t>(model.seq_len) * f.size());
  t.sin.resize(t.cos.size());
  for (int64_t p = 0; p < model.seq_len; ++p) {
    for (size_t j = 0; j < f.size(); ++j) {
      const double angle = static_cast<double>(p) * f[j];
      t.cos[static_cast<size_t>(p) * f.size() + j] = static_cast<float>(std::cos(angle));
      t.sin[static_cast<size_t>(p) * f.size() + j] = static_cast<float>(std::sin(angle));
    }
  }
  return t;
}

}  // namespace keel::trainer
