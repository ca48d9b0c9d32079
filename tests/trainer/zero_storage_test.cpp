// ZeroStorage's collectives in flight: a rank that fails mid-step must not
// leave its DP group's thread writing into freed buffers.
#include "common/config.h"
#include "common/error.h"
#include "trainer/comm/gloo_communicator.h"
#include "trainer/kernels/cpu_backend.h"
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

}  // namespace

TEST_SUITE("unit") {
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
