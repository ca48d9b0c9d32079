// NcclCommunicator on this machine's GPU. NCCL refuses two ranks on one
// device, so the group tests run at world size 1, where every collective is
// a copy (or nothing) and send/recv have no peer; multi-rank parity is
// proven on the CPU path (gloo_communicator_test.cpp). The rendezvous and
// argument tests need no device and run everywhere nvcc is.
#ifdef KEEL_HAVE_CUDA

#include "common/error.h"
#include "trainer/comm/flight_recorder.h"
#include "trainer/comm/nccl_communicator.h"
#include "trainer/kernels/cuda/cuda_backend.h"

#include "tests/support/failure.h"
#include "tests/trainer/cuda_fixture.h"
#include "tests/support/memory_store.h"

#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace {

using keel::common::Error;
using keel::common::ErrorCode;
using keel::test::MemoryStore;
using namespace keel::trainer;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using Vec = std::vector<float>;

constexpr auto kTimeout = 10000ms;  // healthy groups: never reached
constexpr int kDevice = 0;

using keel::test::device_or_skip;
using keel::test::DeviceVec;

// Integers that are exact in float, so results compare with ==.
Vec pattern(size_t count, int salt) {
  Vec v(count);
  for (size_t i = 0; i < count; ++i) v[i] = static_cast<float>(salt * 1000 + static_cast<int>(i % 997));
  return v;
}

const std::vector<size_t> kCounts = {1, 5, 1000, 70001};

// How a call failed: its code (none if it did not fail), message and how
// long it took.
using keel::test::contains;
using keel::test::describe;
using keel::test::Failure;
using keel::test::failure_of;

// Holds a stream until `open` turns true: queued on the communicator's
// stream, it keeps the next collective from completing for as long as the
// test likes.
void CUDART_CB hold_until_open(void* open) {
  while (!static_cast<std::atomic<bool>*>(open)->load()) std::this_thread::sleep_for(1ms);
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("nccl version string names a library with abort and non-blocking communicators") {
    const std::string version = nccl_version_string();
    int major = 0, minor = 0, patch = 0;
    REQUIRE_MESSAGE(std::sscanf(version.c_str(), "%d.%d.%d", &major, &minor, &patch) == 3, version);
    MESSAGE("NCCL " << version);
    CHECK((major > 2 || (major == 2 && minor >= 28)));
  }

  TEST_CASE("nccl rank whose unique id never arrives raises a peer failure within its timeout") {
    MemoryStore store;
    const auto timeout = 300ms;
    const Failure f = failure_of([&] { NcclCommunicator comm(store, "lonely", 1, 2, kDevice, timeout, nullptr); });
    CHECK_MESSAGE(f.code == ErrorCode::kPeerFailure, describe(f));
    CHECK(contains(f.message, "group 'lonely' rank 1 of 2"));
    CHECK(contains(f.message, "nccl/lonely/id"));
    CHECK(f.elapsed >= timeout - 50ms);
    CHECK(f.elapsed < timeout + 2s);
  }

  TEST_CASE("nccl rank that finds a malformed unique id raises a peer failure") {
    MemoryStore store;
    store.set("nccl/garbled/id", "not an id");
    const Failure f = failure_of([&] { NcclCommunicator comm(store, "garbled", 1, 2, kDevice, kTimeout, nullptr); });
    CHECK_MESSAGE(f.code == ErrorCode::kPeerFailure, describe(f));
    CHECK(contains(f.message, "9 bytes"));
  }

  TEST_CASE("nccl constructor refuses a bad timeout or device before touching the store") {
    MemoryStore store;
    CHECK(failure_of([&] { NcclCommunicator c(store, "bad", 0, 1, kDevice, 0ms, nullptr); }).code ==
          ErrorCode::kInternal);
    CHECK(failure_of([&] { NcclCommunicator c(store, "bad", 0, 1, -1, kTimeout, nullptr); }).code ==
          ErrorCode::kInternal);
    CHECK(failure_of([&] { NcclCommunicator c(store, "bad", 2, 2, kDevice, kTimeout, nullptr); }).code ==
          ErrorCode::kInternal);
    CHECK_FALSE(store.get("nccl/bad/id").has_value());
  }
}

TEST_SUITE("gpu") {
  TEST_CASE("nccl collectives at world size one give every rank its own data back") {
    if (!device_or_skip()) return;
    MemoryStore store;
    NcclCommunicator comm(store, "solo", 0, 1, kDevice, kTimeout, nullptr);
    for (size_t count : kCounts) {
      CAPTURE(count);
      const Vec in = pattern(count, 1);

      DeviceVec reduced(in);
      comm.all_reduce(reduced.get(), count);
      CHECK(reduced.to_host() == in);

      // The step's scalars are host memory: staged through the device.
      Vec on_host = in;
      comm.all_reduce(on_host.data(), count);
      CHECK(on_host == in);

      DeviceVec scatter_in(in), scatter_out(Vec(count, -1.0f));
      comm.reduce_scatter(scatter_in.get(), scatter_out.get(), count);
      CHECK(scatter_out.to_host() == in);
      CHECK(scatter_in.to_host() == in);

      DeviceVec gather_in(in), gather_out(Vec(count, -1.0f));
      comm.all_gather(gather_in.get(), gather_out.get(), count);
      CHECK(gather_out.to_host() == in);

      DeviceVec broadcast(in);
      comm.broadcast(broadcast.get(), count, 0);
      CHECK(broadcast.to_host() == in);

      DeviceVec exchange_in(in), exchange_out(Vec(count, -1.0f));
      comm.all_to_all(exchange_in.get(), exchange_out.get(), count);
      CHECK(exchange_out.to_host() == in);

      DeviceVec exchange_v(Vec(count, -1.0f));
      comm.all_to_all_v(exchange_in.get(), {count}, exchange_v.get(), {count});
      CHECK(exchange_v.to_host() == in);
    }
    DeviceVec untouched(Vec(3, 7.0f));
    comm.all_reduce(untouched.get(), 0);
    comm.barrier();
    CHECK(untouched.to_host() == Vec(3, 7.0f));
  }

  TEST_CASE("nccl carries bfloat16 and counts its payload in two-byte elements") {
    if (!device_or_skip()) return;
    MemoryStore store;
    NcclCommunicator comm(store, "solo-bf16", 0, 1, kDevice, kTimeout, nullptr);
    std::vector<bf16> in(1001);
    for (size_t i = 0; i < in.size(); ++i) in[i] = to_bf16(static_cast<float>(i % 251) - 125.0f);
    auto bits = [](const std::vector<bf16>& v) {
      std::vector<uint16_t> out;
      for (const bf16 x : v) out.push_back(x.bits);
      return out;
    };
    DeviceVec<bf16> reduced(in);
    comm.all_reduce(reduced.get(), in.size());
    CHECK(bits(reduced.to_host()) == bits(in));
    DeviceVec<bf16> gather_in(in), gather_out(std::vector<bf16>(in.size()));
    comm.all_gather(gather_in.get(), gather_out.get(), in.size());
    CHECK(bits(gather_out.to_host()) == bits(in));
    CHECK(comm.stats().bytes_of(CollectiveOp::kAllReduce) == 2 * in.size());
    CHECK(comm.stats().bytes_of(CollectiveOp::kAllGather) == 2 * in.size());
  }

  TEST_CASE("nccl send and recv to itself are refused before they reach the device") {
    // At world size 1 the only rank is the caller, and communicator.cpp
    // refuses a rank as its own peer: point to point cannot run here.
    if (!device_or_skip()) return;
    MemoryStore store;
    auto recorder = std::make_shared<FlightRecorder>();
    NcclCommunicator comm(store, "p2p", 0, 1, kDevice, kTimeout, recorder);
    DeviceVec data(Vec(4, 1.0f));
    CHECK(failure_of([&] { comm.send(data.get(), 4, 0); }).code == ErrorCode::kInternal);
    CHECK(failure_of([&] { comm.recv(data.get(), 4, 0); }).code == ErrorCode::kInternal);
    CHECK(recorder->snapshot().empty());
    comm.barrier();
    REQUIRE(recorder->snapshot().size() == 1);
    CHECK(recorder->snapshot()[0].seq == 0);
  }

  TEST_CASE("nccl byte counters and sequence numbers follow the base class") {
    if (!device_or_skip()) return;
    MemoryStore store;
    auto recorder = std::make_shared<FlightRecorder>();
    NcclCommunicator comm(store, "counted", 0, 1, kDevice, kTimeout, recorder);
    DeviceVec a(pattern(10, 1)), b(pattern(10, 2));
    comm.all_reduce(a.get(), 10);
    comm.all_reduce(a.get(), 10);
    comm.reduce_scatter(a.get(), b.get(), 4);
    comm.all_gather(a.get(), b.get(), 5);
    comm.broadcast(a.get(), 6, 0);
    comm.all_to_all(a.get(), b.get(), 2);
    comm.barrier();
    comm.all_reduce(a.get(), 3);

    const uint64_t f = sizeof(float);
    const CommStats& s = comm.stats();
    CHECK(s.calls_of(CollectiveOp::kAllReduce) == 3);
    CHECK(s.bytes_of(CollectiveOp::kAllReduce) == (10 + 10 + 3) * f);
    CHECK(s.bytes_of(CollectiveOp::kReduceScatter) == 4 * f);
    CHECK(s.bytes_of(CollectiveOp::kAllGather) == 5 * f);
    CHECK(s.bytes_of(CollectiveOp::kBroadcast) == 6 * f);
    CHECK(s.bytes_of(CollectiveOp::kAllToAll) == 2 * f);
    CHECK(s.calls_of(CollectiveOp::kBarrier) == 1);
    CHECK(s.bytes_of(CollectiveOp::kBarrier) == 0);
    CHECK(s.calls_of(CollectiveOp::kSend) == 0);

    const std::vector<std::string> ops = {"all_reduce", "all_reduce", "reduce_scatter", "all_gather",
                                          "broadcast",  "all_to_all", "barrier",        "all_reduce"};
    const std::vector<uint64_t> bytes = {10 * f, 10 * f, 4 * f, 5 * f, 6 * f, 2 * f, 0, 3 * f};
    const std::vector<int> peers = {-1, -1, -1, -1, 0, -1, -1, -1};
    const auto entries = recorder->snapshot();
    REQUIRE(entries.size() == ops.size());
    for (size_t i = 0; i < entries.size(); ++i) {
      CAPTURE(i);
      CHECK(entries[i].group == "counted");
      CHECK(entries[i].seq == static_cast<int64_t>(i));
      CHECK(entries[i].op == ops[i]);
      CHECK(entries[i].bytes == bytes[i]);
      CHECK(entries[i].peer == peers[i]);
      CHECK(entries[i].state == FlightState::kDone);
    }
  }

  TEST_CASE("nccl abort fails a blocked call and every later call at once") {
    if (!device_or_skip()) return;
    MemoryStore store;
    auto recorder = std::make_shared<FlightRecorder>();
    NcclCommunicator comm(store, "aborted", 0, 1, kDevice, kTimeout, recorder);
    DeviceVec data(pattern(1000, 1));
    comm.all_reduce(data.get(), 1000);

    std::atomic<bool> open{false};
    REQUIRE(cudaLaunchHostFunc(comm.stream(), hold_until_open, &open) == cudaSuccess);
    std::thread watchdog([&] {
      std::this_thread::sleep_for(200ms);
      comm.abort();
      comm.abort();  // idempotent
    });
    // NCCL's abort may wait for the kernels queued behind the held stream.
    std::thread opener([&] {
      std::this_thread::sleep_for(1s);
      open = true;
    });
    const Failure blocked = failure_of([&] { comm.all_reduce(data.get(), 1000); });
    watchdog.join();
    opener.join();
    cudaStreamSynchronize(comm.stream());  // the host function is done with `open`
    const Failure later = failure_of([&] { comm.barrier(); });

    CHECK_MESSAGE(blocked.code == ErrorCode::kCollectiveHang, describe(blocked));
    CHECK(contains(blocked.message, "group 'aborted' all_reduce seq 1"));
    CHECK(contains(blocked.message, "aborted"));
    CHECK(blocked.elapsed < 5s);
    CHECK_MESSAGE(later.code == ErrorCode::kCollectiveHang, describe(later));
    CHECK(later.elapsed < 1s);
    const auto entries = recorder->snapshot();
    REQUIRE(entries.size() == 3);
    CHECK(entries[1].state == FlightState::kFailed);
    CHECK(entries[2].op == "barrier");
    CHECK(entries[2].state == FlightState::kFailed);
  }

  TEST_CASE("nccl call that outlives its timeout aborts the communicator and raises a hang") {
    if (!device_or_skip()) return;
    MemoryStore store;
    // Long enough for NCCL's initialisation in a fresh process too.
    const auto timeout = 5000ms;
    NcclCommunicator comm(store, "stalled", 0, 1, kDevice, timeout, nullptr);
    DeviceVec data(pattern(1000, 1));

    std::atomic<bool> open{false};
    REQUIRE(cudaLaunchHostFunc(comm.stream(), hold_until_open, &open) == cudaSuccess);
    std::thread opener([&] {
      std::this_thread::sleep_for(timeout + 500ms);
      open = true;
    });
    const Failure stalled = failure_of([&] { comm.all_reduce(data.get(), 1000); });
    opener.join();
    cudaStreamSynchronize(comm.stream());
    const Failure later = failure_of([&] { comm.all_gather(data.get(), data.get(), 1000); });

    CHECK_MESSAGE(stalled.code == ErrorCode::kCollectiveHang, describe(stalled));
    CHECK(contains(stalled.message, "group 'stalled' all_reduce seq 0"));
    CHECK(contains(stalled.message, "timed out"));
    CHECK(stalled.elapsed >= timeout - 100ms);
    CHECK(stalled.elapsed < timeout + 5s);
    CHECK_MESSAGE(later.code == ErrorCode::kCollectiveHang, describe(later));
    CHECK(contains(later.message, "unusable"));
    CHECK(later.elapsed < 1s);
  }

  TEST_CASE("nccl communicators of two groups share one store") {
    if (!device_or_skip()) return;
    MemoryStore store;
    auto recorder = std::make_shared<FlightRecorder>();
    NcclCommunicator dp(store, "dp", 0, 1, kDevice, kTimeout, recorder);
    NcclCommunicator tp(store, "tp", 0, 1, kDevice, kTimeout, recorder);
    const auto dp_id = store.get("nccl/dp/id");
    const auto tp_id = store.get("nccl/tp/id");
    REQUIRE(dp_id.has_value());
    REQUIRE(tp_id.has_value());
    CHECK(dp_id->size() == 128);
    CHECK(*dp_id != *tp_id);

    const Vec in = pattern(1000, 3);
    DeviceVec a(in), b(in), gathered(Vec(1000, -1.0f));
    dp.all_reduce(a.get(), 1000);
    tp.all_gather(b.get(), gathered.get(), 1000);
    dp.barrier();
    tp.barrier();
    CHECK(a.to_host() == in);
    CHECK(gathered.to_host() == in);
    const auto entries = recorder->snapshot();
    REQUIRE(entries.size() == 4);
    CHECK(entries[0].group == "dp");
    CHECK(entries[1].group == "tp");
    CHECK(entries[2].seq == 1);
    CHECK(entries[3].seq == 1);
  }

  TEST_CASE("nccl refuses two ranks on one gpu with an internal error") {
    // docs/architecture.md "Parallel layout and communication": the reason NCCL runs at world size 1 on this machine.
    if (!device_or_skip()) return;
    MemoryStore store;
    std::vector<Failure> failures(2);
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < 2; ++rank) {
      ranks.emplace_back([&, rank] {
        failures[static_cast<size_t>(rank)] =
            failure_of([&] { NcclCommunicator comm(store, "twins", rank, 2, kDevice, kTimeout, nullptr); });
      });
    }
    for (auto& rank : ranks) rank.join();
    for (const auto& f : failures) {
      CHECK_MESSAGE(f.code == ErrorCode::kInternal, describe(f));
      CHECK(contains(f.message, "invalid usage"));
      CHECK(f.elapsed < kTimeout);
    }
  }
}

#endif  // KEEL_HAVE_CUDA
