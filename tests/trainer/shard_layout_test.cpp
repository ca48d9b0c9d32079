#include "trainer/kernels/cpu_backend.h"
#include "trainer/parallel/shard_layout.h"

#include <doctest/doctest.h>

#include <numeric>
#include <vector>

using keel::trainer::CpuBackend;
using keel::trainer::ParameterTable;
using keel::trainer::ShardLayout;

namespace {

keel::common::ModelConfig model_with_uneven_rows() {
  keel::common::ModelConfig m;
  m.vocab_size = 50;  // wte has 128 rows
  m.seq_len = 5;      // wpe has 5 rows: ranks of a group of 4 own 2, 2, 1 and 0
  m.n_layer = 1;
  m.n_head = 2;
  m.n_embd = 6;
  return m;
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("dim-0 shards cover every tensor exactly once as rectangular blocks") {
    ParameterTable table(model_with_uneven_rows());
    for (int size : {1, 2, 3, 4, 7}) {
      CAPTURE(size);
      ShardLayout shards(table, size);
      for (size_t t = 0; t < table.specs().size(); ++t) {
        const auto& spec = table.specs()[t];
        const size_t row = spec.numel / static_cast<size_t>(spec.shape[0]);
        size_t next = 0;
        for (int r = 0; r < size; ++r) {
          if (shards.shard_numel(t, r) == 0) continue;
          CHECK(shards.shard_begin(t, r) == next);
          CHECK(shards.shard_begin(t, r) % row == 0);
          CHECK(shards.shard_numel(t, r) % row == 0);
          next += shards.shard_numel(t, r);
        }
        CHECK(next == spec.numel);
      }
    }
    ShardLayout four(table, 4);
    const size_t wpe = 1;  // table order: wte, wpe, ...
    CHECK(four.shard_numel(wpe, 0) == 2 * 6);
    CHECK(four.shard_numel(wpe, 2) == 1 * 6);
    CHECK(four.shard_numel(wpe, 3) == 0);
  }

  TEST_CASE("packing every rank's shards and unpacking the gathered blocks restores the tensors") {
    ParameterTable table(model_with_uneven_rows());
    CpuBackend backend(1);
    const int size = 4;
    ShardLayout shards(table, size);
    std::vector<float> original(table.total());
    std::iota(original.begin(), original.end(), 1.0f);
    const size_t tensors = shards.tensor_count();
    const size_t block = shards.packed_numel(0, tensors);
    std::vector<float> gathered(block * size, -1.0f);
    for (int r = 0; r < size; ++r) shards.pack(backend, original.data(), r, 0, tensors, gathered.data() + r * block);
    std::vector<float> restored(table.total(), 0.0f);
    shards.unpack(backend, gathered.data(), 0, tensors, restored.data());
    for (const auto& spec : table.specs()) {
      CAPTURE(spec.name);
      CHECK(std::equal(restored.begin() + spec.offset, restored.begin() + spec.offset + spec.numel,
                       original.begin() + spec.offset));
    }
    // A sub-range packs only its tensors.
    CHECK(shards.packed_numel(1, 2) == 2 * 6);
  }
}
