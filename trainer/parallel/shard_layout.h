// How every tensor is split over the group its gradient is reduced in
// (docs/architecture.md "Parallel layout and communication", FSDP2 style):
// along dim 0, rank q of the tensor's group of `size` ranks owning rows
// [q·R, min((q+1)·R, rows)) with R = ceil(rows / size), so each shard is a
// rectangular block of the global tensor (a rank may own no rows of a
// small tensor). Most tensors split over dp x cp; with expert parallelism
// the experts split over the smaller expert-DP group.
//
// Collectives need equal blocks per rank, so shards travel "packed": for a
// range of tensors of one group, a rank's block is its shard of each
// tensor in table order, each padded to R rows. ZeRO-1 all-gathers the packed parameters of
// every tensor; ZeRO-2 reduce-scatters packed gradients; ZeRO-3 gathers one
// block's tensors at a time: all use the same packing.
#pragma once

#include "trainer/kernels/backend.h"
#include "trainer/params/parameters.h"

#include <cstddef>
#include <functional>
#include <vector>

namespace keel::trainer {

class ShardLayout {
 public:
  // Every tensor split over `size` ranks.
  ShardLayout(const ParameterTable& table, int size);
  // Tensor t split over group_size(table.specs()[t]) ranks.
  ShardLayout(const ParameterTable& table, const std::function<int(const ParamSpec&)>& group_size);

  // The size of tensor t's group.
  int size(size_t t) const { return tensors_[t].size; }
  size_t tensor_count() const { return tensors_.size(); }

  // Elements of tensor `t` that rank `rank` owns, and where they start
  // within the tensor (row-major, so the shard is contiguous).
  size_t shard_numel(size_t t, int rank) const;
  size_t shard_begin(size_t t, int rank) const;

  // Elements of one rank's packed block for tensors [first, last).
  size_t packed_numel(size_t first, size_t last) const;

  // The ranges pack and unpack take below hold tensors of one group size.
  // Copies rank `rank`'s shards of tensors [first, last) out of `flat`
  // (table layout, its first float being element `origin` of the flat
  // buffer: a unit's buffer passes the unit's begin) into `packed`
  // (packed_numel floats; the padding is zeroed).
  void pack(Backend& backend, const float* flat, int rank, size_t first, size_t last, float* packed,
            size_t origin = 0) const;
  // Copies every rank's packed block (size() blocks back to back, as
  // all_gather returns them) into the tensors [first, last) of `flat`.
  void unpack(Backend& backend, const float* gathered, size_t first, size_t last, float* flat,
              size_t origin = 0) const;

 private:
  struct Tensor {
    size_t offset;         // in the flat buffer
    size_t rows;           // dim 0
    size_t row_numel;      // elements per row
    size_t rows_per_rank;  // R
    int size;              // of its group
  };
  std::vector<Tensor> tensors_;
};

}  // namespace keel::trainer
