#include "trainer/parallel/shard_layout.h"

#include <algorithm>

namespace keel::trainer {

ShardLayout::ShardLayout(const ParameterTable& table, int size)
    : ShardLayout(table, [size](const ParamSpec&) { return size; }) {}

ShardLayout::ShardLayout(const ParameterTable& table, const std::function<int(const ParamSpec&)>& group_size) {
  for (const ParamSpec& spec : table.specs()) {
    const size_t rows = static_cast<size_t>(spec.shape[0]);
    const size_t row_numel = spec.numel / rows;
    const int size = group_size(spec);
    tensors_.push_back(Tensor{spec.offset, rows, row_numel, (rows + size - 1) / size, size});
  }
}

size_t ShardLayout::shard_begin(size_t t, int rank) const {
  const Tensor& x = tensors_[t];
  return std::min(x.rows, static_cast<size_t>(rank) * x.rows_per_rank) * x.row_numel;
}

size_t ShardLayout::shard_numel(size_t t, int rank) const {
  const Tensor& x = tensors_[t];
  const size_t begin = std::min(x.rows, static_cast<size_t>(rank) * x.rows_per_rank);
  const size_t end = std::min(x.rows, begin + x.rows_per_rank);
  return (end - begin) * x.row_numel;
}

size_t ShardLayout::packed_numel(size_t first, size_t last) const {
  size_t numel = 0;
  for (size_t t = first; t < last; ++t) numel += tensors_[t].rows_per_rank * tensors_[t].row_numel;
  return numel;
}

void ShardLayout::pack(Backend& backend, const float* flat, int rank, size_t first, size_t last, float* packed,
                       size_t origin) const {
  for (size_t t = first; t < last; ++t) {
    const Tensor& x = tensors_[t];
    const size_t padded = x.rows_per_rank * x.row_numel;
    const size_t owned = shard_numel(t, rank);
    backend.copy(packed, flat + (x.offset - origin) + shard_begin(t, rank), owned * sizeof(float));
    backend.zero(packed + owned, (padded - owned) * sizeof(float));
    packed += padded;
  }
}

void ShardLayout::unpack(Backend& backend, const float* gathered, size_t first, size_t last, float* flat,
                         size_t origin) const {
  const size_t block = packed_numel(first, last);
  for (int rank = 0; first < last && rank < tensors_[first].size; ++rank) {
    const float* packed = gathered + static_cast<size_t>(rank) * block;
    for (size_t t = first; t < last; ++t) {
      const Tensor& x = tensors_[t];
      backend.copy(flat + (x.offset - origin) + shard_begin(t, rank), packed, shard_numel(t, rank) * sizeof(float));
      packed += x.rows_per_rank * x.row_numel;
    }
  }
}

}  // namespace keel::trainer
