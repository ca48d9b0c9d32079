// A piece: the rectangular block of one global tensor that one rank file
// holds as one contiguous dataset (docs/architecture.md "Checkpoints").
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace keel::checkpoint {

struct Piece {
  std::string group;                  // "model", "master", "optim/exp_avg" or "optim/exp_avg_sq"
  std::string global_name;            // e.g. "h.0.attn.c_attn.weight"
  std::vector<int64_t> global_shape;  // 1-D or 2-D
  int64_t row = 0;                    // where the block starts in the global tensor
  int64_t col = 0;                    // (0 for 1-D tensors)
  int64_t rows = 0;                   // the block's size; cols = 1 for 1-D tensors
  int64_t cols = 1;

  size_t numel() const { return static_cast<size_t>(rows * cols); }
  size_t bytes() const { return numel() * sizeof(float); }
  // "/model/wte" : the tensor's path in index.h5.
  std::string tensor_path() const { return "/" + group + "/" + global_name; }
  // The dataset's path in a rank file: the tensor path plus the block's
  // origin, so that a rank may hold several blocks of one tensor.
  std::string dataset_path() const {
    return tensor_path() + "@" + std::to_string(row) + "," + std::to_string(col);
  }
  bool operator==(const Piece&) const = default;
};

// The first non-finite value of `n`, if any: no checkpoint or snapshot is
// kept of non-finite state. Branch-free over the whole run, so the common
// all-finite case goes at memory speed; the value is looked for only when
// there is one.
inline std::optional<float> first_non_finite(const float* values, size_t n) {
  bool finite = true;
  for (size_t k = 0; k < n; ++k) finite &= std::isfinite(values[k]);
  if (finite) return std::nullopt;
  for (size_t k = 0; k < n; ++k) {
    if (!std::isfinite(values[k])) return values[k];
  }
  return std::nullopt;
}

}  // namespace keel::checkpoint
