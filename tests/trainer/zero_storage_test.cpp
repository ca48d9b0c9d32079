// ZeroStorage's collectives in flight: a rank that fails mid-step must not
// leave its DP group's thread writing into freed buffers. And its bf16 copy
// of the weights for the GEMMs: never stale, and rounded once per change.
#include "common/config.h"
#include "common/error.h"
#include "trainer/comm/gloo_communicator.h"
#include "trainer/kernels/backend_wrapper.h"
#include "trainer/kernels/cpu_backend.h"
#include "trainer/optim/adamw.h"
#include "trainer/params/parameters.h"
#include "trainer/parallel/zero_storage.h"

#include "tests/support/failure.h"
#include "tests/support/memory_store.h"

#include <doctest/doctest.h>

#include <chrono>
#include <latch>
#include <optional>
#include <thread>
#include <vector>

namespace {

using namespace keel::trainer;
using namespace std::chrono_literals;
using keel::common::ErrorCode;
using Clock = std::chrono::steady_clock;

// A CPU backend whose GEMMs take bf16, counting the arrays it rounds.
class CountingRounds : public BackendWrapper {
 public:
  CountingRounds() : BackendWrapper(cpu_) {}
  void round_to_bf16(bf16* out, const float* in, size_t n) override {
    ++rounds;
    cpu_.round_to_bf16(out, in, n);
  }
  int rounds = 0;

 private:
  CpuBackend cpu_{1, DType::kBF16};
};

// Where the GEMM copy of any unit differs from its float32 parameters
// rounded: "" when none does. Acquires every unit, in forward's order.
std::string stale_gemm_copy(ZeroStorage& storage, const ParameterTable& table) {
  for (int u = 0; u < table.unit_count(); ++u) {
    const UnitParameters p = storage.acquire_parameters(u);
    if (p.gemm == nullptr) return "unit " + std::to_string(u) + " has no GEMM copy";
    for (size_t i = 0; i < table.unit_end(u) - table.unit_begin(u); ++i) {
      if (p.gemm[i].bits != to_bf16(p.f32[i]).bits) {
        return "unit " + std::to_string(u) + " element " + std::to_string(i) + ": " + std::to_string(p.f32[i]) +
               " but the copy holds " + std::to_string(to_float(p.gemm[i]));
      }
    }
  }
  return "";
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("the GEMMs' bf16 copy of the weights follows every change of the parameters at ZeRO 0 to 3") {
    const keel::common::ModelConfig model{.vocab_size = 64, .seq_len = 8, .n_layer = 2, .n_head = 2, .n_embd = 16};
    const ParameterTable table(model, 0, 1);
    for (int stage = 0; stage <= 3; ++stage) {
      CAPTURE(stage);
      keel::test::MemoryStore store;
      // Each check's result on both DP ranks, by rank.
      std::vector<std::string> after_init(2), after_update(2), after_write(2), after_adamw(2);
      std::vector<int> rounds_init(2), rounds_backward(2), rounds_adamw(2), rounds_after_save(2);
      auto rank = [&](int r) {
        GlooCommunicator comm(store, "dp", r, 2, 60s, nullptr);
        CountingRounds backend;
        ZeroStorage storage(backend, table, stage, ReduceGroups{&comm, &comm});
        const auto memory = keel::trainer::lay_out(backend, storage);
        storage.init(7);
        after_init[r] = stale_gemm_copy(storage, table);
        rounds_init[r] = backend.rounds;
        // Backward acquires the units again, top down: nothing changed, so
        // nothing is rounded again below ZeRO-3 (where only the gathers are).
        for (int u = table.unit_count(); u-- > 0;) storage.acquire_parameters(u);
        rounds_backward[r] = backend.rounds - rounds_init[r];
        // The optimizer's write: every owned element moves by more than a
        // bf16 step, then the update is published.
        for (size_t t = 0; t < table.specs().size(); ++t) {
          float* owned = storage.owned_parameters(t);
          for (size_t i = 0; i < storage.owned_numel(t); ++i) owned[i] = owned[i] * 1.5f + 0.25f;
        }
        storage.publish_parameters();
        after_update[r] = stale_gemm_copy(storage, table);
        // A write through params() (a checkpoint load, a flipped bit) with no publish.
        if (stage < 3) {
          float* whole = storage.params();
          for (size_t i = 0; i < table.total(); i += 3) whole[i] = -whole[i] - 1.0f;
          after_write[r] = stale_gemm_copy(storage, table);
        }
        // At stage 0 AdamW writes the copy as it updates: nothing is rounded apart.
        if (stage == 0) {
          AdamW optimizer(backend, table, keel::common::TrainConfig{});
          const auto state = keel::trainer::lay_out(backend, optimizer);
          float* grads = storage.grads();
          for (size_t i = 0; i < table.total(); ++i) grads[i] = 0.01f * static_cast<float>(i % 7) - 0.03f;
          std::vector<AdamW::Part> parts;
          for (size_t t = 0; t < table.specs().size(); ++t) {
            parts.push_back({t, storage.owned_parameters(t), storage.owned_gradients(t), storage.owned_gemm_copy(t)});
          }
          const int before = backend.rounds;
          optimizer.update(parts, 0.05f, 1.0f, 0);
          storage.publish_parameters(/*gemm_copy_written=*/true);
          after_adamw[r] = stale_gemm_copy(storage, table);
          rounds_adamw[r] = backend.rounds - before;
          // A save reads the parameters and leaves the copy current.
          const int before_save = backend.rounds;
          storage.params_for_io();
          for (size_t t = 0; t < table.specs().size(); ++t) storage.owned_parameters_for_io(t);
          for (int u = 0; u < table.unit_count(); ++u) storage.acquire_parameters(u);
          rounds_after_save[r] = backend.rounds - before_save;
        }
      };
      std::thread peer(rank, 1);
      rank(0);
      peer.join();
      for (int r = 0; r < 2; ++r) {
        CAPTURE(r);
        CHECK_MESSAGE(after_init[r].empty(), after_init[r]);
        CHECK_MESSAGE(after_update[r].empty(), after_update[r]);
        CHECK_MESSAGE(after_write[r].empty(), after_write[r]);
        CHECK_MESSAGE(after_adamw[r].empty(), after_adamw[r]);
        CHECK(rounds_adamw[r] == 0);
        CHECK(rounds_after_save[r] == 0);
        // Once per unit, not once per GEMM (at ZeRO-3 once per gather).
        CHECK(rounds_init[r] == table.unit_count());
        if (stage < 3) CHECK(rounds_backward[r] == 0);
      }
    }
  }

  TEST_CASE("a storage destroyed with a gradient sum in flight aborts its group instead of waiting it out") {
    const keel::common::ModelConfig model{.vocab_size = 64, .seq_len = 8, .n_layer = 2, .n_head = 2, .n_embd = 16};
    const ParameterTable table(model, 0, 1);
    keel::test::MemoryStore store;
    std::latch rank0_done(1);
    Clock::duration destroy_took{};
    std::optional<keel::test::Failure> later_call;
    std::thread peer([&] {
      // Joins the group but never reaches the reduce-scatter.
      GlooCommunicator comm(store, "dp", 1, 2, 60s, nullptr);
      rank0_done.wait();
    });
    {
      GlooCommunicator comm(store, "dp", 0, 2, 60s, nullptr);
      CpuBackend backend(1);
      std::optional<ZeroStorage> storage(std::in_place, backend, table, 2, ReduceGroups{&comm, &comm});
      const auto memory = keel::trainer::lay_out(backend, *storage);
      storage->zero_gradients();
      storage->unit_gradients(1);
      storage->gradients_ready(1);  // starts the unit's reduce-scatter, which the peer never joins
      const auto start = Clock::now();
      storage.reset();
      destroy_took = Clock::now() - start;
      // The group was aborted: a later call fails at once.
      std::vector<float> data(4, 1.0f);
      later_call = keel::test::failure_of([&] { comm.all_reduce(data.data(), data.size()); });
      rank0_done.count_down();
    }
    peer.join();
    CHECK(destroy_took < 30s);
    REQUIRE(later_call.has_value());
    CHECK_MESSAGE(later_call->code == ErrorCode::kCollectiveHang, keel::test::describe(*later_call));
    CHECK(later_call->message.find("aborted") != std::string::npos);
    CHECK(later_call->elapsed < 30s);
  }
}
