// The angles of rotary positions (docs/architecture.md "Model"): for every
// position of a sequence and every channel pair of a head, the cosine and
// sine the rotary kernels turn that pair by (backend_kernels.def). Made
// once on the host in double precision, then rounded, so both backends
// read the same table and a long position loses no bits to float32
// products of position and frequency.
#pragma once

#include "common/config.h"

#include <vector>

namespace keel::trainer {

struct RotaryTable {
  std::vector<float> cos, sin;  // [positions, head_dim / 2]
};

// inv_freq[j] = rope_theta^(-2j / d), with Llama 3.1's scaling where
// model.rope_scaling_factor is set: by wavelength w = 2 pi / f against the
// original context L, f stays for w < L / high_freq_factor, becomes
// f / factor for w > L / low_freq_factor, and between them blends the two
// with s = (L / w - low) / (high - low): (1 - s) f / factor + s f
// (Hugging Face's _compute_llama3_parameters, Meta's apply_scaling).
std::vector<double> rotary_frequencies(const common::ModelConfig& model);

// The table for positions [0, model.seq_len).
RotaryTable rotary_table(const common::ModelConfig& model);

}  // namespace keel::trainer
