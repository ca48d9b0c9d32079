// The arena (trainer/kernels/arena.h): one allocation for a rank's
// parameters, gradients, optimizer state and activations, planned before
// any of it is used, and none in a training step, which on a GPU means no
// cudaMalloc in the step.
#include "common/counter_rng.h"
#include "trainer/kernels/arena.h"
#include "trainer/kernels/backend_wrapper.h"
#include "trainer/kernels/cpu_backend.h"
#include "trainer/model/gpt.h"
#include "trainer/optim/adamw.h"
#include "trainer/parallel/zero_storage.h"

#include <doctest/doctest.h>

#include <cstdint>
#include <set>
#include <vector>

using keel::trainer::Arena;
using keel::trainer::ArenaArray;
using keel::trainer::CpuBackend;

namespace {

// Counts what the code under test allocates.
class CountingBackend : public keel::trainer::BackendWrapper {
 public:
  using BackendWrapper::BackendWrapper;
  void* alloc(size_t bytes) override {
    ++allocations;
    return BackendWrapper::alloc(bytes);
  }
  int allocations = 0;
};

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("an arena places its arrays apart and aligned in one zeroed allocation") {
    CpuBackend cpu(1);
    CountingBackend backend(cpu);
    ArenaArray<float> a, b, empty;
    ArenaArray<int32_t> c;
    Arena arena(backend, [&](Arena& arena) {
      a = arena.take<float>(3);
      empty = arena.take<float>(0);
      c = arena.take<int32_t>(100);
      b = arena.take<float>(65);
    });
    CHECK(backend.allocations == 1);
    CHECK(arena.bytes() == 5 * Arena::kAlign);  // 12 bytes, 400 bytes and 260 bytes, each rounded up
    CHECK(empty.size() == 0);
    std::set<uintptr_t> starts;
    for (const void* p : {static_cast<const void*>(a.data()), static_cast<const void*>(b.data()),
                          static_cast<const void*>(c.data())}) {
      CHECK(reinterpret_cast<uintptr_t>(p) % Arena::kAlign == 0);
      starts.insert(reinterpret_cast<uintptr_t>(p));
    }
    CHECK(starts.size() == 3);
    CHECK(reinterpret_cast<uintptr_t>(b.data()) - reinterpret_cast<uintptr_t>(a.data()) == 3 * Arena::kAlign);
    for (size_t i = 0; i < b.size(); ++i) CHECK(b.data()[i] == 0.0f);
    a.data()[2] = 1.0f;
    a.zero();
    CHECK(a.data()[2] == 0.0f);
  }

  TEST_CASE("an arena refuses a description that differs between planning and placing") {
    CpuBackend cpu(1);
    int calls = 0;
    ArenaArray<float> a;
    CHECK_THROWS_AS(Arena(cpu, [&](Arena& arena) { a = arena.take<float>(++calls * 100); }), keel::common::Error);
  }

  TEST_CASE("storage and optimizer state and activations are one allocation and a training step allocates nothing") {
    keel::common::ModelConfig m;
    m.vocab_size = 50;
    m.seq_len = 8;
    m.n_layer = 2;
    m.n_head = 2;
    m.n_embd = 16;
    m.n_expert = 4;
    m.moe_every = 2;
    keel::common::TrainConfig t;
    CpuBackend cpu(1);
    CountingBackend backend(cpu);
    keel::trainer::ParameterTable table(m);
    keel::trainer::ZeroStorage storage(backend, table);
    keel::trainer::Gpt gpt(m, backend, 2, storage);
    keel::trainer::AdamW optimizer(backend, table, t);
    CHECK(backend.allocations == 0);  // planned, not placed
    const auto memory = keel::trainer::lay_out(backend, storage, optimizer, gpt);
    storage.init(3);
    CHECK(backend.allocations == 1);
    CHECK(memory->bytes() >= storage.parameter_bytes() + storage.gradient_bytes() + optimizer.state_bytes());
    std::vector<int32_t> tokens(16);
    for (size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = static_cast<int32_t>(keel::common::counter_uniform_below(9, i, 50));
    }
    for (int step = 0; step < 2; ++step) {
      storage.zero_gradients();
      gpt.forward(tokens.data(), tokens.data(), 2);
      gpt.backward(1.0f);
      std::vector<keel::trainer::AdamW::Part> parts;
      for (size_t i = 0; i < table.specs().size(); ++i) {
        parts.push_back({i, storage.owned_parameters(i), storage.owned_gradients(i)});
      }
      optimizer.update(parts, 1e-3f, 1.0f, step);
    }
    CHECK(backend.allocations == 1);
  }
}
