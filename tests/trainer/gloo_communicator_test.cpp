// GlooCommunicator and the instrumented Communicator path: threads of one
// process act as ranks, each with its own communicator over loopback TCP,
// rendezvousing through an in-memory Store.
#include "common/error.h"
#include "store/store.h"
#include "trainer/comm/flight_recorder.h"
#include "trainer/comm/gloo_communicator.h"

#include "tests/support/failure.h"
#include "tests/support/memory_store.h"
#include "tests/support/thread_ranks.h"
#include "tests/support/temp_dir.h"
#include "tests/support/wait.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <array>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <latch>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <thread>
#include <vector>

namespace {

namespace fs = std::filesystem;
using keel::common::Error;
using keel::common::ErrorCode;
using keel::test::MemoryStore;
using keel::test::run_ranks;
using keel::test::TempDir;
using namespace keel::trainer;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr auto kTimeout = 10000ms;       // healthy groups: never reached
constexpr auto kFailureTimeout = 1500ms;  // groups whose failure is the point

// Waits until `recorder` holds `calls` calls and the newest is in flight:
// its rank is inside that call. False when that never happens.
bool await_in_flight(const FlightRecorder& recorder, size_t calls) {
  return keel::test::wait_until(
      [&] {
        const auto entries = recorder.snapshot();
        return entries.size() == calls && entries.back().state == FlightState::kInFlight;
      },
      30);
}

void require_no_errors(const std::vector<std::exception_ptr>& errors) {
  for (size_t rank = 0; rank < errors.size(); ++rank) {
    if (!errors[rank]) continue;
    try {
      std::rethrow_exception(errors[rank]);
    } catch (const std::exception& e) {
      FAIL("rank " << rank << " threw: " << e.what());
    }
  }
}

// One healthy group of `size` ranks: body(comm) on every rank. A rank keeps
// its communicator until every rank is done, because closing its sockets
// while a peer still finishes the last call would fail that peer.
void run_group(MemoryStore& store, const std::string& name, int size,
               const std::function<void(GlooCommunicator&)>& body,
               const std::vector<std::shared_ptr<FlightRecorder>>& recorders = {}) {
  std::barrier done(size);
  require_no_errors(run_ranks(size, [&](int rank) {
    std::exception_ptr error;
    {
      std::unique_ptr<GlooCommunicator> comm;
      try {
        auto recorder = recorders.empty() ? nullptr : recorders[static_cast<size_t>(rank)];
        comm = std::make_unique<GlooCommunicator>(store, name, rank, size, kTimeout, recorder);
        body(*comm);
      } catch (...) {
        error = std::current_exception();
      }
      done.arrive_and_wait();
    }
    if (error) std::rethrow_exception(error);
  }));
}

// Integers small enough that every sum below is exact in float, so results
// can be compared with ==.
float value(int rank, size_t i) { return static_cast<float>((rank + 1) * 1000 + static_cast<int>(i % 997)); }

const std::vector<size_t> kCounts = {1, 5, 1000, 70001};

// How a call failed: its code (none if it did not fail), message and how
// long it took.
using keel::test::contains;
using keel::test::describe;
using keel::test::Failure;
using keel::test::failure_of;

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("a group bound to an address that is not this node's is a config error naming KEEL_BIND_ADDRESS") {
    MemoryStore store;
    try {
      // 192.0.2.0/24 is TEST-NET-1: never an address of this machine.
      GlooCommunicator comm(store, "unbindable", 0, 1, kTimeout, nullptr, "", "192.0.2.1");
      FAIL("a group bound an address of another machine");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kBadConfig);
      CHECK(std::string(e.what()).find("'192.0.2.1' (KEEL_BIND_ADDRESS)") != std::string::npos);
    }
  }

  TEST_CASE("all_reduce sums every rank's buffer for world sizes one to four") {
    for (int size = 1; size <= 4; ++size) {
      CAPTURE(size);
      MemoryStore store;
      std::vector<std::vector<std::vector<float>>> results(static_cast<size_t>(size));
      run_group(store, "dp", size, [&](GlooCommunicator& comm) {
        for (size_t count : kCounts) {
          std::vector<float> data(count);
          for (size_t i = 0; i < count; ++i) data[i] = value(comm.rank(), i);
          comm.all_reduce(data.data(), count);
          results[static_cast<size_t>(comm.rank())].push_back(std::move(data));
        }
      });
      for (int rank = 0; rank < size; ++rank) {
        for (size_t c = 0; c < kCounts.size(); ++c) {
          const auto& got = results[static_cast<size_t>(rank)][c];
          size_t wrong = 0;
          for (size_t i = 0; i < got.size(); ++i) {
            float expect = 0;
            for (int q = 0; q < size; ++q) expect += value(q, i);
            wrong += got[i] != expect;
          }
          CHECK_MESSAGE(wrong == 0, "rank " << rank << " count " << kCounts[c]);
        }
      }
    }
  }

  TEST_CASE("reduce_scatter gives each rank the sum of its own block for world sizes one to four") {
    for (int size = 1; size <= 4; ++size) {
      CAPTURE(size);
      MemoryStore store;
      std::vector<std::vector<std::vector<float>>> results(static_cast<size_t>(size));
      std::vector<int> inputs_changed(static_cast<size_t>(size), 0);
      run_group(store, "dp", size, [&](GlooCommunicator& comm) {
        for (size_t count : kCounts) {
          std::vector<float> in(static_cast<size_t>(size) * count);
          for (size_t i = 0; i < in.size(); ++i) in[i] = value(comm.rank(), i);
          const std::vector<float> original = in;
          std::vector<float> out(count, -1.0f);
          comm.reduce_scatter(in.data(), out.data(), count);
          inputs_changed[static_cast<size_t>(comm.rank())] += in != original;
          results[static_cast<size_t>(comm.rank())].push_back(std::move(out));
        }
      });
      for (int rank = 0; rank < size; ++rank) {
        CHECK(inputs_changed[static_cast<size_t>(rank)] == 0);
        for (size_t c = 0; c < kCounts.size(); ++c) {
          const size_t count = kCounts[c];
          const auto& got = results[static_cast<size_t>(rank)][c];
          size_t wrong = 0;
          for (size_t j = 0; j < count; ++j) {
            float expect = 0;
            for (int q = 0; q < size; ++q) expect += value(q, static_cast<size_t>(rank) * count + j);
            wrong += got[j] != expect;
          }
          CHECK_MESSAGE(wrong == 0, "rank " << rank << " count " << count);
        }
      }
    }
  }

  TEST_CASE("all_gather puts block r from rank r on every rank for world sizes one to four") {
    for (int size = 1; size <= 4; ++size) {
      CAPTURE(size);
      MemoryStore store;
      std::vector<std::vector<std::vector<float>>> results(static_cast<size_t>(size));
      run_group(store, "tp", size, [&](GlooCommunicator& comm) {
        for (size_t count : kCounts) {
          std::vector<float> in(count);
          for (size_t i = 0; i < count; ++i) in[i] = value(comm.rank(), i);
          std::vector<float> out(static_cast<size_t>(size) * count, -1.0f);
          comm.all_gather(in.data(), out.data(), count);
          results[static_cast<size_t>(comm.rank())].push_back(std::move(out));
        }
      });
      for (int rank = 0; rank < size; ++rank) {
        for (size_t c = 0; c < kCounts.size(); ++c) {
          const size_t count = kCounts[c];
          std::vector<float> expect;
          for (int q = 0; q < size; ++q) {
            for (size_t i = 0; i < count; ++i) expect.push_back(value(q, i));
          }
          CHECK_MESSAGE(results[static_cast<size_t>(rank)][c] == expect, "rank " << rank << " count " << count);
        }
      }
    }
  }

  TEST_CASE("broadcast copies the root's buffer to every rank for every root of world sizes one to four") {
    for (int size = 1; size <= 4; ++size) {
      CAPTURE(size);
      MemoryStore store;
      std::vector<std::vector<std::vector<float>>> results(static_cast<size_t>(size));
      run_group(store, "pp", size, [&](GlooCommunicator& comm) {
        for (int root = 0; root < size; ++root) {
          const size_t count = 1000 + static_cast<size_t>(root);
          std::vector<float> data(count);
          for (size_t i = 0; i < count; ++i) data[i] = value(comm.rank(), i);
          comm.broadcast(data.data(), count, root);
          results[static_cast<size_t>(comm.rank())].push_back(std::move(data));
        }
      });
      for (int rank = 0; rank < size; ++rank) {
        for (int root = 0; root < size; ++root) {
          std::vector<float> expect(1000 + static_cast<size_t>(root));
          for (size_t i = 0; i < expect.size(); ++i) expect[i] = value(root, i);
          CHECK_MESSAGE(results[static_cast<size_t>(rank)][static_cast<size_t>(root)] == expect,
                        "rank " << rank << " root " << root);
        }
      }
    }
  }

  TEST_CASE("send and recv deliver every message between every pair of ranks for world sizes two to four") {
    for (int size = 2; size <= 4; ++size) {
      CAPTURE(size);
      MemoryStore store;
      // received[to][from]: the messages `to` got from `from`, in order.
      std::vector<std::vector<std::vector<std::vector<float>>>> received(
          static_cast<size_t>(size), std::vector<std::vector<std::vector<float>>>(static_cast<size_t>(size)));
      auto message = [](int from, int to, int k) {
        std::vector<float> m(static_cast<size_t>(10 + k));
        for (size_t i = 0; i < m.size(); ++i) {
          m[i] = static_cast<float>(from * 100000 + to * 1000 + k * 100) + static_cast<float>(i);
        }
        return m;
      };
      run_group(store, "pp", size, [&](GlooCommunicator& comm) {
        // Every pair in one global order, lower rank sending first, so the
        // rendezvous sends cannot deadlock; two messages each way exercise
        // the per-pair ordering.
        const int me = comm.rank();
        for (int a = 0; a < size; ++a) {
          for (int b = a + 1; b < size; ++b) {
            if (me != a && me != b) continue;
            const int other = me == a ? b : a;
            for (int k = 0; k < 2; ++k) {
              for (int from : {a, b}) {
                if (from == me) {
                  auto m = message(me, other, k);
                  comm.send(m.data(), m.size(), other);
                } else {
                  std::vector<float> m(static_cast<size_t>(10 + k), -1.0f);
                  comm.recv(m.data(), m.size(), other);
                  received[static_cast<size_t>(me)][static_cast<size_t>(other)].push_back(std::move(m));
                }
              }
            }
          }
        }
      });
      for (int to = 0; to < size; ++to) {
        for (int from = 0; from < size; ++from) {
          if (from == to) continue;
          const auto& got = received[static_cast<size_t>(to)][static_cast<size_t>(from)];
          REQUIRE(got.size() == 2);
          for (int k = 0; k < 2; ++k) CHECK(got[static_cast<size_t>(k)] == message(from, to, k));
        }
      }
    }
  }

  TEST_CASE("exchanges around a ring deliver every message where every rank sends before it receives") {
    // Every rank sends to both neighbours and receives from both in one
    // exchange, twice (the second started and waited for), then ranks 0
    // and 1 trade once more with plain send and recv: the messages pair up
    // in issue order across all three. As blocking sends first on every
    // rank, the ring would wait for ever.
    MemoryStore store;
    const int size = 4;
    const size_t count = 1000;
    auto message = [&](int from, int to, int k) {
      std::vector<float> m(count);
      for (size_t i = 0; i < count; ++i) m[i] = static_cast<float>(from * 100000 + to * 1000 + k * 100 + i % 100);
      return m;
    };
    // got[rank][k]: what `rank` received from its previous and next neighbour in round k.
    std::vector<std::vector<std::array<std::vector<float>, 2>>> got(size);
    std::vector<std::vector<float>> plain(size);
    std::vector<CommStats> stats(size);
    std::vector<std::shared_ptr<FlightRecorder>> recorders;
    for (int rank = 0; rank < size; ++rank) recorders.push_back(std::make_shared<FlightRecorder>());
    run_group(
        store, "ring", size,
        [&](GlooCommunicator& comm) {
          const int me = comm.rank(), prev = (me + size - 1) % size, next = (me + 1) % size;
          for (int k = 0; k < 2; ++k) {
            const auto to_next = message(me, next, k), to_prev = message(me, prev, k);
            std::array<std::vector<float>, 2> in = {std::vector<float>(count, -1.0f), std::vector<float>(count, -1.0f)};
            std::vector<Communicator::Send> sends = {{to_next.data(), count, next}, {to_prev.data(), count, prev}};
            std::vector<Communicator::Recv> recvs = {{in[0].data(), count, prev}, {in[1].data(), count, next}};
            if (k == 0) {
              comm.exchange(sends, recvs);
            } else {
              CommWork work = comm.start_exchange(sends, recvs);
              work.wait();
            }
            got[static_cast<size_t>(me)].push_back(std::move(in));
          }
          if (me < 2) {
            auto out = message(me, 1 - me, 2);
            std::vector<float> in(count, -1.0f);
            if (me == 0) {
              comm.send(out.data(), count, 1);
              comm.recv(in.data(), count, 1);
            } else {
              comm.recv(in.data(), count, 0);
              comm.send(out.data(), count, 0);
            }
            plain[static_cast<size_t>(me)] = std::move(in);
          }
          stats[static_cast<size_t>(me)] = comm.stats();
        },
        recorders);
    for (int rank = 0; rank < size; ++rank) {
      CAPTURE(rank);
      const int prev = (rank + size - 1) % size, next = (rank + 1) % size;
      REQUIRE(got[static_cast<size_t>(rank)].size() == 2);
      for (int k = 0; k < 2; ++k) {
        CAPTURE(k);
        CHECK(got[static_cast<size_t>(rank)][static_cast<size_t>(k)][0] == message(prev, rank, k));
        CHECK(got[static_cast<size_t>(rank)][static_cast<size_t>(k)][1] == message(next, rank, k));
      }
      if (rank < 2) CHECK(plain[static_cast<size_t>(rank)] == message(1 - rank, rank, 2));
      const CommStats& s = stats[static_cast<size_t>(rank)];
      CHECK(s.calls_of(CollectiveOp::kExchange) == 2);
      CHECK(s.bytes_of(CollectiveOp::kExchange) == 2 * 2 * count * sizeof(float));  // what it sent
      const auto entries = recorders[static_cast<size_t>(rank)]->snapshot();
      REQUIRE(entries.size() == (rank < 2 ? 4u : 2u));
      CHECK(entries[0].op == "exchange");
      CHECK(entries[0].peer == -1);
    }
  }

  TEST_CASE("an exchange refuses a transfer with itself or outside the group before it takes a number") {
    MemoryStore store;
    auto recorder = std::make_shared<FlightRecorder>();
    GlooCommunicator comm(store, "solo-exchange", 0, 1, kTimeout, recorder);
    std::vector<float> data(4, 1.0f);
    CHECK(failure_of([&] { comm.exchange({{data.data(), 4, 0}}, {}); }).code == ErrorCode::kInternal);
    CHECK(failure_of([&] { comm.exchange({}, {{data.data(), 4, 3}}); }).code == ErrorCode::kInternal);
    CHECK(failure_of([&] { comm.exchange({}, {{nullptr, 4, 0}}); }).code == ErrorCode::kInternal);
    CHECK(recorder->snapshot().empty());
  }

  TEST_CASE("all_to_all delivers block r of every rank to rank r for world sizes one to four") {
    for (int size = 1; size <= 4; ++size) {
      CAPTURE(size);
      MemoryStore store;
      const size_t count = 333;
      // Element i of the block rank s sends to rank d.
      auto element = [](int s, int d, size_t i) {
        return static_cast<float>(s * 10000 + d * 1000) + static_cast<float>(i);
      };
      std::vector<std::vector<float>> results(static_cast<size_t>(size));
      run_group(store, "ep", size, [&](GlooCommunicator& comm) {
        std::vector<float> in(static_cast<size_t>(size) * count);
        for (int d = 0; d < size; ++d) {
          for (size_t i = 0; i < count; ++i) in[static_cast<size_t>(d) * count + i] = element(comm.rank(), d, i);
        }
        std::vector<float> out(in.size(), -1.0f);
        comm.all_to_all(in.data(), out.data(), count);
        results[static_cast<size_t>(comm.rank())] = std::move(out);
      });
      for (int rank = 0; rank < size; ++rank) {
        std::vector<float> expect;
        for (int s = 0; s < size; ++s) {
          for (size_t i = 0; i < count; ++i) expect.push_back(element(s, rank, i));
        }
        CHECK_MESSAGE(results[static_cast<size_t>(rank)] == expect, "rank " << rank);
      }
    }
  }

  TEST_CASE("all_to_all_v delivers blocks of uneven and empty sizes for world sizes one to four") {
    // Rank s sends (s + 2d) % 3 elements to rank d: some blocks are empty,
    // and a rank of a two-rank group sends and receives nothing at all.
    auto count_of = [](int s, int d) { return static_cast<size_t>((s + 2 * d) % 3); };
    auto element = [](int s, int d, size_t i) {
      return static_cast<float>(s * 10000 + d * 1000) + static_cast<float>(i);
    };
    for (int size = 1; size <= 4; ++size) {
      CAPTURE(size);
      MemoryStore store;
      std::vector<std::vector<float>> results(static_cast<size_t>(size));
      std::vector<uint64_t> bytes(static_cast<size_t>(size));
      run_group(store, "ep", size, [&](GlooCommunicator& comm) {
        std::vector<size_t> send_counts, recv_counts;
        std::vector<float> in;
        for (int d = 0; d < size; ++d) {
          send_counts.push_back(count_of(comm.rank(), d));
          recv_counts.push_back(count_of(d, comm.rank()));
          for (size_t i = 0; i < send_counts.back(); ++i) in.push_back(element(comm.rank(), d, i));
        }
        std::vector<float> out(std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0}), -1.0f);
        comm.all_to_all_v(in.empty() ? nullptr : in.data(), send_counts, out.empty() ? nullptr : out.data(),
                          recv_counts);
        results[static_cast<size_t>(comm.rank())] = std::move(out);
        bytes[static_cast<size_t>(comm.rank())] = comm.stats().bytes_of(CollectiveOp::kAllToAll);
      });
      for (int rank = 0; rank < size; ++rank) {
        CAPTURE(rank);
        std::vector<float> expect;
        uint64_t sent = 0;
        for (int s = 0; s < size; ++s) {
          for (size_t i = 0; i < count_of(s, rank); ++i) expect.push_back(element(s, rank, i));
          sent += count_of(rank, s) * sizeof(float);
        }
        CHECK(results[static_cast<size_t>(rank)] == expect);
        CHECK(bytes[static_cast<size_t>(rank)] == sent);
      }
    }
  }

  TEST_CASE("all_to_all_v refuses counts that do not fit the group before any rank waits") {
    MemoryStore store;
    std::vector<std::string> errors(2);
    run_group(store, "ep", 2, [&](GlooCommunicator& comm) {
      std::vector<float> data(4, 1.0f);
      const std::vector<size_t> three = {1, 1, 1}, two = {1, 1}, other_self = {2, 2};
      const auto short_counts = keel::test::failure_of([&] { comm.all_to_all_v(data.data(), three, data.data(), two); });
      const auto self_mismatch =
          keel::test::failure_of([&] { comm.all_to_all_v(data.data(), two, data.data(), other_self); });
      CHECK(short_counts.code == ErrorCode::kInternal);
      CHECK(self_mismatch.code == ErrorCode::kInternal);
      errors[static_cast<size_t>(comm.rank())] = short_counts.message + " | " + self_mismatch.message;
      CHECK(comm.stats().calls_of(CollectiveOp::kAllToAll) == 0);
      comm.all_to_all_v(data.data(), two, data.data() + 2, two);  // the group still works
    });
    CHECK(keel::test::contains(errors[0], "3 send and 2 receive counts for 2 ranks"));
    CHECK(keel::test::contains(errors[1], "rank 1 sends itself 1 elements but expects 2"));
  }

  TEST_CASE("barrier lets no rank through before every rank has arrived for world sizes one to four") {
    for (int size = 1; size <= 4; ++size) {
      CAPTURE(size);
      MemoryStore store;
      std::atomic<int> arrived{0};
      std::vector<int> seen(static_cast<size_t>(size));
      run_group(store, "world", size, [&](GlooCommunicator& comm) {
        std::this_thread::sleep_for(std::chrono::milliseconds(40 * comm.rank()));
        arrived.fetch_add(1);
        comm.barrier();
        seen[static_cast<size_t>(comm.rank())] = arrived.load();
      });
      for (int rank = 0; rank < size; ++rank) CHECK(seen[static_cast<size_t>(rank)] == size);
    }
  }

  TEST_CASE("operations on zero elements complete without touching the buffers") {
    MemoryStore store;
    std::vector<std::vector<float>> results(3);
    run_group(store, "empty", 3, [&](GlooCommunicator& comm) {
      comm.all_reduce(nullptr, 0);
      comm.reduce_scatter(nullptr, nullptr, 0);
      comm.all_gather(nullptr, nullptr, 0);
      comm.broadcast(nullptr, 0, 2);
      comm.all_to_all(nullptr, nullptr, 0);
      if (comm.rank() == 0) comm.send(nullptr, 0, 1);
      if (comm.rank() == 1) comm.recv(nullptr, 0, 0);
      std::vector<float> data(4, 1.0f);
      comm.all_reduce(data.data(), data.size());
      results[static_cast<size_t>(comm.rank())] = data;
    });
    for (const auto& data : results) CHECK(data == std::vector<float>(4, 3.0f));
  }

  TEST_CASE("all_reduce results are bit identical across two runs and across ranks") {
    for (int size : {3, 4}) {
      CAPTURE(size);
      // Values of mixed magnitude and sign, so the summation order matters.
      const size_t count = 600000;
      auto input = [&](int rank) {
        std::mt19937 gen(static_cast<uint32_t>(1234 + rank));
        std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
        std::uniform_int_distribution<int> exponent(-20, 20);
        std::vector<float> data(count);
        for (auto& x : data) x = std::ldexp(mantissa(gen), exponent(gen));
        return data;
      };
      std::vector<std::vector<std::vector<float>>> runs;
      for (int run = 0; run < 2; ++run) {
        MemoryStore store;
        std::vector<std::vector<float>> results(static_cast<size_t>(size));
        run_group(store, "dp", size, [&](GlooCommunicator& comm) {
          auto data = input(comm.rank());
          comm.all_reduce(data.data(), data.size());
          results[static_cast<size_t>(comm.rank())] = std::move(data);
        });
        runs.push_back(std::move(results));
      }
      for (int rank = 0; rank < size; ++rank) {
        const auto& first = runs[0][static_cast<size_t>(rank)];
        CHECK(std::memcmp(first.data(), runs[1][static_cast<size_t>(rank)].data(), count * sizeof(float)) == 0);
        CHECK(std::memcmp(first.data(), runs[0][0].data(), count * sizeof(float)) == 0);
      }
    }
  }

  TEST_CASE("two groups sharing one store and one recorder per rank do not collide") {
    MemoryStore store;
    const int size = 3;
    std::vector<std::shared_ptr<FlightRecorder>> recorders;
    for (int rank = 0; rank < size; ++rank) recorders.push_back(std::make_shared<FlightRecorder>());
    std::vector<std::vector<float>> alpha(size), beta(size);
    std::barrier done(size);
    require_no_errors(run_ranks(size, [&](int rank) {
      // Both groups use the same ranks, so without per-group key prefixes
      // the second would read the first one's addresses.
      GlooCommunicator a(store, "alpha", rank, size, kTimeout, recorders[static_cast<size_t>(rank)]);
      GlooCommunicator b(store, "beta", rank, size, kTimeout, recorders[static_cast<size_t>(rank)]);
      std::vector<float> x(100, static_cast<float>(rank + 1));
      std::vector<float> y(100, static_cast<float>(10 * (rank + 1)));
      a.all_reduce(x.data(), x.size());
      b.all_reduce(y.data(), y.size());
      a.all_reduce(x.data(), x.size());
      alpha[static_cast<size_t>(rank)] = x;
      beta[static_cast<size_t>(rank)] = y;
      done.arrive_and_wait();
    }));
    for (int rank = 0; rank < size; ++rank) {
      CHECK(alpha[static_cast<size_t>(rank)] == std::vector<float>(100, 18.0f));
      CHECK(beta[static_cast<size_t>(rank)] == std::vector<float>(100, 60.0f));
      auto entries = recorders[static_cast<size_t>(rank)]->snapshot();
      REQUIRE(entries.size() == 3);
      CHECK(entries[0].group == "alpha");
      CHECK(entries[0].seq == 0);
      CHECK(entries[1].group == "beta");
      CHECK(entries[1].seq == 0);
      CHECK(entries[2].group == "alpha");
      CHECK(entries[2].seq == 1);
    }
  }

  TEST_CASE("sequence numbers and byte counters follow the formulas of communicator.h") {
    MemoryStore store;
    const int size = 3;
    std::vector<std::shared_ptr<FlightRecorder>> recorders;
    for (int rank = 0; rank < size; ++rank) recorders.push_back(std::make_shared<FlightRecorder>());
    std::vector<CommStats> stats(size);
    std::vector<float> last(size);
    run_group(
        store, "mixed", size,
        [&](GlooCommunicator& comm) {
          std::vector<float> a(size * 10, 1.0f), b(size * 10, 0.0f);
          comm.all_reduce(a.data(), 10);
          comm.all_reduce(a.data(), 10);
          comm.reduce_scatter(a.data(), b.data(), 4);
          comm.all_gather(a.data(), b.data(), 5);
          comm.broadcast(a.data(), 6, 1);
          comm.all_to_all(a.data(), b.data(), 2);
          comm.barrier();
          // Only ranks 0 and 1 talk point to point: rank 2's group sequence
          // falls behind theirs, and the collective below must still match.
          if (comm.rank() == 0) comm.send(a.data(), 7, 1);
          if (comm.rank() == 1) comm.recv(b.data(), 7, 0);
          std::vector<float> one(3, 1.0f);
          comm.all_reduce(one.data(), one.size());
          last[static_cast<size_t>(comm.rank())] = one[0];
          stats[static_cast<size_t>(comm.rank())] = comm.stats();
        },
        recorders);
    const uint64_t f = sizeof(float);
    for (int rank = 0; rank < size; ++rank) {
      CAPTURE(rank);
      const CommStats& s = stats[static_cast<size_t>(rank)];
      CHECK(last[static_cast<size_t>(rank)] == 3.0f);
      CHECK(s.calls_of(CollectiveOp::kAllReduce) == 3);
      CHECK(s.bytes_of(CollectiveOp::kAllReduce) == (10 + 10 + 3) * f);
      CHECK(s.calls_of(CollectiveOp::kReduceScatter) == 1);
      CHECK(s.bytes_of(CollectiveOp::kReduceScatter) == size * 4 * f);
      CHECK(s.bytes_of(CollectiveOp::kAllGather) == 5 * f);
      CHECK(s.bytes_of(CollectiveOp::kBroadcast) == 6 * f);
      CHECK(s.bytes_of(CollectiveOp::kAllToAll) == size * 2 * f);
      CHECK(s.calls_of(CollectiveOp::kBarrier) == 1);
      CHECK(s.bytes_of(CollectiveOp::kBarrier) == 0);
      CHECK(s.calls_of(CollectiveOp::kSend) == (rank == 0 ? 1u : 0u));
      CHECK(s.bytes_of(CollectiveOp::kSend) == (rank == 0 ? 7 * f : 0));
      CHECK(s.calls_of(CollectiveOp::kRecv) == (rank == 1 ? 1u : 0u));
      CHECK(s.bytes_of(CollectiveOp::kRecv) == (rank == 1 ? 7 * f : 0));

      std::vector<std::string> ops = {"all_reduce", "all_reduce", "reduce_scatter", "all_gather",
                                      "broadcast",  "all_to_all", "barrier"};
      std::vector<uint64_t> bytes = {10 * f, 10 * f, size * 4 * f, 5 * f, 6 * f, size * 2 * f, 0};
      std::vector<int> peers = {-1, -1, -1, -1, 1, -1, -1};
      if (rank < 2) {
        ops.push_back(rank == 0 ? "send" : "recv");
        bytes.push_back(7 * f);
        peers.push_back(rank == 0 ? 1 : 0);
      }
      ops.push_back("all_reduce");
      bytes.push_back(3 * f);
      peers.push_back(-1);
      auto entries = recorders[static_cast<size_t>(rank)]->snapshot();
      REQUIRE(entries.size() == ops.size());
      for (size_t i = 0; i < entries.size(); ++i) {
        CAPTURE(i);
        CHECK(entries[i].group == "mixed");
        CHECK(entries[i].seq == static_cast<int64_t>(i));
        CHECK(entries[i].op == ops[i]);
        CHECK(entries[i].bytes == bytes[i]);
        CHECK(entries[i].peer == peers[i]);
        CHECK(entries[i].state == FlightState::kDone);
        CHECK(entries[i].end.has_value());
      }
    }
  }

  TEST_CASE("argument errors are internal errors that take no sequence number") {
    MemoryStore store;
    auto recorder = std::make_shared<FlightRecorder>();
    GlooCommunicator comm(store, "solo", 0, 1, kTimeout, recorder);
    std::vector<float> data(4, 1.0f);
    CHECK(failure_of([&] { comm.send(data.data(), 4, 1); }).code == ErrorCode::kInternal);
    CHECK(failure_of([&] { comm.recv(data.data(), 4, 0); }).code == ErrorCode::kInternal);
    CHECK(failure_of([&] { comm.broadcast(data.data(), 4, -1); }).code == ErrorCode::kInternal);
    CHECK(failure_of([&] { comm.all_reduce(nullptr, 4); }).code == ErrorCode::kInternal);
    // The CPU path is float32: a bfloat16 buffer, or in and out that
    // disagree, is the caller's bug.
    std::vector<bf16> half(4);
    const Failure refused = failure_of([&] { comm.all_reduce(half.data(), 4); });
    CHECK(refused.code == ErrorCode::kInternal);
    CHECK(contains(refused.message, "does not carry bf16"));
    CHECK(failure_of([&] { comm.all_gather(data.data(), half.data(), 4); }).code == ErrorCode::kInternal);
    CHECK(recorder->snapshot().empty());
    CHECK(comm.stats().calls_of(CollectiveOp::kSend) == 0);
    comm.all_reduce(data.data(), 4);
    auto entries = recorder->snapshot();
    REQUIRE(entries.size() == 1);
    CHECK(entries[0].seq == 0);
    CHECK(data == std::vector<float>(4, 1.0f));
  }

  TEST_CASE("the flight recorder keeps the last N calls in order with their states") {
    FlightRecorder recorder(4);
    std::vector<uint64_t> ids;
    for (int i = 0; i < 6; ++i) ids.push_back(recorder.begin("dp", i, "all_reduce", 64u * i, i % 2 ? 1 : -1));
    recorder.end(ids[0], FlightState::kDone);  // already out of the ring
    recorder.end(ids[2], FlightState::kDone);
    recorder.end(ids[3], FlightState::kFailed, "boom");
    recorder.end(ids[4], FlightState::kDone);
    auto entries = recorder.snapshot();
    REQUIRE(entries.size() == 4);
    for (size_t i = 0; i < 4; ++i) {
      CHECK(entries[i].id == ids[i + 2]);
      CHECK(entries[i].seq == static_cast<int64_t>(i + 2));
      CHECK(entries[i].bytes == 64u * (i + 2));
      CHECK(entries[i].peer == ((i + 2) % 2 ? 1 : -1));
    }
    CHECK(entries[0].state == FlightState::kDone);
    CHECK(entries[1].state == FlightState::kFailed);
    CHECK(entries[1].error == "boom");
    CHECK(entries[2].state == FlightState::kDone);
    CHECK(entries[3].state == FlightState::kInFlight);
    CHECK_FALSE(entries[3].end.has_value());
    CHECK(*entries[1].end >= entries[1].start);

    // Through a communicator: the ring holds the newest calls only.
    MemoryStore store;
    auto small = std::make_shared<FlightRecorder>(8);
    GlooCommunicator comm(store, "solo", 0, 1, kTimeout, small);
    for (int i = 0; i < 10; ++i) comm.barrier();
    auto recent = small->snapshot();
    REQUIRE(recent.size() == 8);
    for (size_t i = 0; i < 8; ++i) {
      CHECK(recent[i].seq == static_cast<int64_t>(i + 2));
      CHECK(recent[i].state == FlightState::kDone);
    }
  }

  TEST_CASE("dump writes the recorder as JSON that parses back") {
    TempDir dir;
    FlightRecorder recorder(4);
    for (int i = 0; i < 5; ++i) {
      uint64_t id = recorder.begin("tp", i, "all_gather", 16, -1);
      if (i < 3) recorder.end(id, FlightState::kDone);
      if (i == 3) recorder.end(id, FlightState::kFailed, "peer \"2\" gone\n\xff");
    }
    const auto path = dir / "rank-00000.json";
    recorder.dump(path);
    recorder.dump(path);  // replaces the first dump

    std::ifstream file(path);
    auto doc = nlohmann::json::parse(file);
    CHECK(doc["version"] == 1);
    CHECK(doc["capacity"] == 4);
    CHECK(doc["recorded"] == 5);
    CHECK(doc["dump_steady_ns"].get<int64_t>() > 0);
    CHECK(doc["dump_wall_ns"].get<int64_t>() > 0);
    const auto& entries = doc["entries"];
    REQUIRE(entries.size() == 4);
    for (size_t i = 0; i < 4; ++i) {
      CHECK(entries[i]["id"] == i + 1);
      CHECK(entries[i]["seq"] == i + 1);
      CHECK(entries[i]["group"] == "tp");
      CHECK(entries[i]["op"] == "all_gather");
      CHECK(entries[i]["bytes"] == 16);
      CHECK(entries[i]["peer"] == -1);
      CHECK(entries[i]["start_steady_ns"].get<int64_t>() <= doc["dump_steady_ns"].get<int64_t>());
      CHECK(entries[i]["start_wall_ns"].get<int64_t>() > 0);
    }
    CHECK(entries[1]["state"] == "done");
    CHECK(entries[2]["state"] == "failed");
    CHECK(contains(entries[2]["error"].get<std::string>(), "peer \"2\" gone"));
    CHECK(entries[3]["state"] == "in_flight");
    CHECK(entries[3]["end_steady_ns"].is_null());
    CHECK(entries[1]["end_steady_ns"].get<int64_t>() >= entries[1]["start_steady_ns"].get<int64_t>());

    // Only the dump itself is left: the temporary files were renamed.
    std::vector<fs::path> files;
    for (const auto& entry : fs::directory_iterator(dir.path())) files.push_back(entry.path());
    CHECK(files == std::vector<fs::path>{path});

    CHECK_THROWS_AS(recorder.dump(dir / "missing" / "rank.json"), Error);
  }

  TEST_CASE("a rank whose peer never joins a collective raises a hang error within its timeout") {
    // Measured on this Gloo: the waiting rank's recv times out ("Timed out
    // waiting ... for recv operation to complete"): kCollectiveHang.
    MemoryStore store;
    auto recorder = std::make_shared<FlightRecorder>();
    std::latch failed(1);
    Failure failure;
    require_no_errors(run_ranks(2, [&](int rank) {
      GlooCommunicator comm(store, "stuck", rank, 2, kFailureTimeout, rank == 0 ? recorder : nullptr);
      comm.barrier();
      if (rank == 1) {
        // Alive and connected, but never enters the all_reduce.
        failed.wait();
        return;
      }
      std::vector<float> data(1000, 1.0f);
      failure = failure_of([&] { comm.all_reduce(data.data(), data.size()); });
      failed.count_down();
    }));
    CHECK_MESSAGE(failure.code == ErrorCode::kCollectiveHang, describe(failure));
    CHECK(failure.elapsed >= kFailureTimeout - 100ms);
    CHECK(failure.elapsed < kFailureTimeout + 2s);
    CHECK(contains(failure.message, "group 'stuck' all_reduce seq 1"));
    CHECK(contains(failure.message, "Timed out"));
    auto entries = recorder->snapshot();
    REQUIRE(entries.size() == 2);
    CHECK(entries[0].state == FlightState::kDone);
    CHECK(entries[1].op == "all_reduce");
    CHECK(entries[1].state == FlightState::kFailed);
    CHECK(entries[1].error == failure.message);
  }

  TEST_CASE("in a group of three a missing rank makes the others fail with typed errors within the timeout") {
    MemoryStore store;
    std::latch failed(2);
    std::vector<Failure> failures(2);
    require_no_errors(run_ranks(3, [&](int rank) {
      GlooCommunicator comm(store, "stuck3", rank, 3, kFailureTimeout, nullptr);
      comm.barrier();
      if (rank == 2) {
        failed.wait();
        return;
      }
      std::vector<float> data(1000, 1.0f);
      failures[static_cast<size_t>(rank)] = failure_of([&] { comm.all_reduce(data.data(), data.size()); });
      failed.count_down();
    }));
    int hangs = 0;
    // Measured: both usually time out themselves (kCollectiveHang); the one
    // that times out second may instead see the first one close its pairs.
    for (const auto& f : failures) {
      CHECK_MESSAGE((f.code == ErrorCode::kCollectiveHang || f.code == ErrorCode::kPeerFailure), describe(f));
      CHECK_MESSAGE(f.elapsed < kFailureTimeout + 2s, describe(f));
      hangs += f.code == ErrorCode::kCollectiveHang;
    }
    CHECK(hangs >= 1);
  }

  TEST_CASE("a rank whose peer's communicator is destroyed mid-collective raises a peer failure at once") {
    MemoryStore store;
    auto recorder = std::make_shared<FlightRecorder>();
    Failure failure;
    const auto timeout = 5000ms;
    require_no_errors(run_ranks(2, [&](int rank) {
      auto comm = std::make_unique<GlooCommunicator>(store, "gone", rank, 2, timeout, rank == 0 ? recorder : nullptr);
      std::vector<float> data(1000, 1.0f);
      comm->all_reduce(data.data(), data.size());
      if (rank == 1) {
        // Once rank 0 is inside its second all_reduce, this rank leaves.
        if (!await_in_flight(*recorder, 2)) throw std::runtime_error("rank 0 never began its second all_reduce");
        comm.reset();
        return;
      }
      failure = failure_of([&] { comm->all_reduce(data.data(), data.size()); });
    }));
    CHECK_MESSAGE(failure.code == ErrorCode::kPeerFailure, describe(failure));
    CHECK(failure.elapsed < 2s);
    CHECK(contains(failure.message, "group 'gone' all_reduce seq 1"));
    auto entries = recorder->snapshot();
    REQUIRE(entries.size() == 2);
    CHECK(entries[1].state == FlightState::kFailed);
  }

  TEST_CASE("abort fails a blocked collective and every later call at once and its peers see a peer failure") {
    MemoryStore store;
    const auto timeout = 5000ms;
    Failure blocked, later, peer;
    std::latch aborted(1);
    auto recorder = std::make_shared<FlightRecorder>();
    require_no_errors(run_ranks(2, [&](int rank) {
      GlooCommunicator comm(store, "aborted", rank, 2, timeout, rank == 0 ? recorder : nullptr);
      comm.barrier();
      std::vector<float> data(1000, 1.0f);
      if (rank == 1) {
        aborted.wait();
        peer = failure_of([&] { comm.barrier(); });
        return;
      }
      bool blocked_seen = false;
      std::thread watchdog([&] {
        blocked_seen = await_in_flight(*recorder, 2);  // the barrier, then the all_reduce
        comm.abort();
        comm.abort();  // idempotent
      });
      blocked = failure_of([&] { comm.all_reduce(data.data(), data.size()); });
      watchdog.join();
      if (!blocked_seen) throw std::runtime_error("the all_reduce was never seen in flight");
      later = failure_of([&] { comm.barrier(); });
      aborted.count_down();
    }));
    CHECK_MESSAGE(blocked.code == ErrorCode::kCollectiveHang, describe(blocked));
    CHECK(contains(blocked.message, "aborted"));
    CHECK(blocked.elapsed < 2s);
    CHECK_MESSAGE(later.code == ErrorCode::kCollectiveHang, describe(later));
    CHECK(later.elapsed < 1s);
    CHECK_MESSAGE(peer.code == ErrorCode::kPeerFailure, describe(peer));
    CHECK(peer.elapsed < 2s);
  }

  TEST_CASE("abort wakes a call waiting on a live peer after another peer has died") {
    // abort() probes the pairs one by one; the pair to the dead rank cannot
    // carry its timeout, so abort must go on to the next. Nobody records a
    // failure here (abort's probes are not calls), so no rank learns of the
    // death through the store and only abort can end the wait.
    MemoryStore store;
    const auto timeout = 5000ms;
    Failure blocked;
    std::latch rank1_gone(1);
    std::latch aborted(1);
    auto recorder = std::make_shared<FlightRecorder>();
    require_no_errors(run_ranks(3, [&](int rank) {
      auto comm = std::make_unique<GlooCommunicator>(store, "partial", rank, 3, timeout, rank == 0 ? recorder : nullptr);
      comm->barrier();
      std::vector<float> data(10, 1.0f);
      if (rank == 1) {
        comm.reset();
        rank1_gone.count_down();
        return;
      }
      if (rank == 2) {
        // Alive, but never sends what rank 0 waits for.
        aborted.wait();
        return;
      }
      rank1_gone.wait();
      std::this_thread::sleep_for(100ms);  // let the closed connection reach rank 0's pair
      bool blocked_seen = false;
      std::thread watchdog([&] {
        blocked_seen = await_in_flight(*recorder, 2);  // the barrier, then the recv
        comm->abort();
      });
      blocked = failure_of([&] { comm->recv(data.data(), data.size(), 2); });
      watchdog.join();
      aborted.count_down();
      if (!blocked_seen) throw std::runtime_error("the recv was never seen in flight");
    }));
    CHECK_MESSAGE(blocked.code == ErrorCode::kCollectiveHang, describe(blocked));
    CHECK(contains(blocked.message, "aborted"));
    CHECK(blocked.elapsed < 2s);
  }

  TEST_CASE("a peer failure recorded by another rank wakes a call blocked on a live peer") {
    // What Gloo alone gets wrong: rank 1 is alive but will never take part
    // (as a rank blocked in a send that Gloo never fails), and another rank
    // has already recorded a peer failure. Rank 0 must not wait out its
    // timeout and call it a hang.
    MemoryStore store;
    const auto timeout = 5000ms;
    Failure blocked;
    std::latch done(1);
    auto recorder = std::make_shared<FlightRecorder>();
    require_no_errors(run_ranks(2, [&](int rank) {
      GlooCommunicator comm(store, "told", rank, 2, timeout, rank == 0 ? recorder : nullptr);
      comm.barrier();
      if (rank == 1) {
        done.wait();
        return;
      }
      bool blocked_seen = false;
      std::thread reporter([&] {
        blocked_seen = await_in_flight(*recorder, 2);  // the barrier, then the all_reduce
        store.set(GlooCommunicator::failure_key("told"), "peer_failure|7|gloo: Connection closed by peer");
      });
      std::vector<float> data(10, 1.0f);
      blocked = failure_of([&] { comm.all_reduce(data.data(), data.size()); });
      reporter.join();
      done.count_down();
      if (!blocked_seen) throw std::runtime_error("the all_reduce was never seen in flight");
    }));
    CHECK_MESSAGE(blocked.code == ErrorCode::kPeerFailure, describe(blocked));
    // Rank 1's watcher sees the record too and aborts, which may close the
    // connection under rank 0 before rank 0's own watcher fires: either way
    // a peer failure, within the poll interval.
    CHECK((contains(blocked.message, "rank 7 of group 'told' reported a peer failure") ||
           contains(blocked.message, "onnection closed")));
    CHECK(blocked.elapsed < 2s);
  }

  TEST_CASE("a departure record wakes a blocked peer even after a hang was recorded and runs its handler") {
    // The failure record already names a hang (first writer wins), so only
    // the departure record can tell rank 0 that rank 1 is gone. Rank 1
    // stays connected, as a rank blocked elsewhere would, so that nothing
    // but the record can wake rank 0.
    MemoryStore store;
    const auto timeout = 5000ms;
    Failure blocked;
    std::string handled;
    std::latch done(1);
    auto recorder = std::make_shared<FlightRecorder>();
    require_no_errors(run_ranks(2, [&](int rank) {
      GlooCommunicator comm(store, "left", rank, 2, timeout, rank == 0 ? recorder : nullptr);
      comm.barrier();
      if (rank == 1) {
        store.set(GlooCommunicator::failure_key("left"), "collective_hang|1|gloo: timed out");
        // The departure once rank 0 is blocked in its all_reduce.
        const bool blocked_seen = await_in_flight(*recorder, 2);
        store.set(GlooCommunicator::left_key("left"), "1|its other group failed");
        done.wait();
        if (!blocked_seen) throw std::runtime_error("the all_reduce was never seen in flight");
        return;
      }
      comm.set_peer_failure_handler([&](const std::string& cause) { handled = cause; });
      std::vector<float> data(10, 1.0f);
      blocked = failure_of([&] { comm.all_reduce(data.data(), data.size()); });
      comm.set_peer_failure_handler(nullptr);
      done.count_down();
    }));
    CHECK_MESSAGE(blocked.code == ErrorCode::kPeerFailure, describe(blocked));
    CHECK(contains(blocked.message, "rank 1 of group 'left' left it: its other group failed"));
    CHECK(blocked.elapsed < 2s);
    CHECK(contains(handled, "left it"));
  }

  TEST_CASE("leaving a group records the departure and aborts the communicator") {
    MemoryStore store;
    require_no_errors(run_ranks(2, [&](int rank) {
      GlooCommunicator comm(store, "leaving", rank, 2, 5000ms, nullptr);
      comm.barrier();
      if (rank == 0) comm.leave("its other group failed");
      std::vector<float> data(4, 1.0f);
      const Failure after = failure_of([&] { comm.all_reduce(data.data(), data.size()); });
      CHECK_MESSAGE(after.code == ErrorCode::kPeerFailure, describe(after));
    }));
    CHECK(store.get(GlooCommunicator::left_key("leaving")) == std::optional<std::string>("0|its other group failed"));
  }

  TEST_CASE("a recorded hang does not turn another rank's timeout into a peer failure") {
    MemoryStore store;
    Failure blocked;
    std::latch done(1);
    store.set(GlooCommunicator::failure_key("hung"), "collective_hang|1|gloo: Timed out");
    require_no_errors(run_ranks(2, [&](int rank) {
      GlooCommunicator comm(store, "hung", rank, 2, kFailureTimeout, nullptr);
      comm.barrier();
      if (rank == 1) {
        done.wait();
        return;
      }
      std::vector<float> data(10, 1.0f);
      blocked = failure_of([&] { comm.all_reduce(data.data(), data.size()); });
      done.count_down();
    }));
    CHECK_MESSAGE(blocked.code == ErrorCode::kCollectiveHang, describe(blocked));
    CHECK(blocked.elapsed >= kFailureTimeout - 100ms);
  }

  TEST_CASE("a rank that fails records the first failure of its group in the store") {
    MemoryStore store;
    Failure failure;
    require_no_errors(run_ranks(2, [&](int rank) {
      auto comm = std::make_unique<GlooCommunicator>(store, "recorded", rank, 2, 5000ms, nullptr);
      comm->barrier();
      std::vector<float> data(10, 1.0f);
      if (rank == 1) {
        comm.reset();
        return;
      }
      failure = failure_of([&] { comm->all_reduce(data.data(), data.size()); });
    }));
    CHECK_MESSAGE(failure.code == ErrorCode::kPeerFailure, describe(failure));
    auto record = store.get(GlooCommunicator::failure_key("recorded"));
    REQUIRE(record.has_value());
    CHECK(record->rfind("peer_failure|0|", 0) == 0);
  }

  TEST_CASE("a rank that never arrives at the rendezvous makes the constructor raise a peer failure") {
    MemoryStore store;
    const auto start = Clock::now();
    try {
      GlooCommunicator comm(store, "lonely", 0, 2, 500ms, nullptr);
      FAIL("the constructor returned without its peer");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kPeerFailure);
      CHECK(contains(e.what(), "group 'lonely'"));
    }
    CHECK(Clock::now() - start < 500ms + 2s);
  }
}

TEST_SUITE("unit") {
  TEST_CASE("a started collective runs while its caller goes on and wait gives its result") {
    // Rank 1 issues its half only after rank 0's start has returned: a
    // start that waited for the collective would wait for rank 1 forever
    // (until the timeout raised a hang).
    MemoryStore store;
    std::latch rank0_started(1);
    std::vector<std::vector<float>> results(2);
    run_group(store, "overlap", 2, [&](GlooCommunicator& comm) {
      std::vector<float> data(70001);
      for (size_t i = 0; i < data.size(); ++i) data[i] = value(comm.rank(), i);
      if (comm.rank() == 1) rank0_started.wait();
      CommWork work = comm.start_all_reduce(data.data(), data.size());
      if (comm.rank() == 0) rank0_started.count_down();
      work.wait();
      results[static_cast<size_t>(comm.rank())] = std::move(data);
    });
    for (const auto& got : results) {
      size_t wrong = 0;
      for (size_t i = 0; i < got.size(); ++i) wrong += got[i] != value(0, i) + value(1, i);
      CHECK(wrong == 0);
    }
  }

  TEST_CASE("started and blocking collectives of a group run in the order they were issued") {
    MemoryStore store;
    std::vector<std::shared_ptr<FlightRecorder>> recorders = {std::make_shared<FlightRecorder>(),
                                                              std::make_shared<FlightRecorder>()};
    std::vector<CommStats> stats(2);
    run_group(
        store, "ordered", 2,
        [&](GlooCommunicator& comm) {
          const auto rank = static_cast<float>(comm.rank());
          std::vector<float> summed(1000, rank + 1), gathered(2000), mine(1000, rank * 10), scattered(500);
          std::vector<float> blocks(1000, 1.0f);
          CommWork first = comm.start_all_reduce(summed.data(), summed.size());
          CommWork second = comm.start_all_gather(mine.data(), gathered.data(), mine.size());
          CommWork third = comm.start_reduce_scatter(blocks.data(), scattered.data(), scattered.size());
          // Blocking behind three in flight: it runs after them, on the
          // group's thread, in every rank's same order.
          float vote = 1.0f;
          comm.all_reduce(&vote, 1);
          first.wait();
          second.wait();
          third.wait();
          first.wait();  // a second wait does nothing
          CHECK(vote == 2.0f);
          CHECK(summed.front() == 3.0f);
          CHECK(gathered.front() == 0.0f);
          CHECK(gathered.back() == 10.0f);
          CHECK(scattered.back() == 2.0f);
          stats[static_cast<size_t>(comm.rank())] = comm.stats();
        },
        recorders);
    for (const auto& recorder : recorders) {
      const auto entries = recorder->snapshot();
      REQUIRE(entries.size() == 4);
      const std::vector<std::string> ops = {"all_reduce", "all_gather", "reduce_scatter", "all_reduce"};
      for (size_t i = 0; i < entries.size(); ++i) {
        CHECK(entries[i].seq == static_cast<int64_t>(i));
        CHECK(entries[i].op == ops[i]);
        CHECK(entries[i].state == FlightState::kDone);
      }
    }
    for (const CommStats& s : stats) {
      CHECK(s.calls_of(CollectiveOp::kAllReduce) == 2);
      CHECK(s.bytes_of(CollectiveOp::kReduceScatter) == 2 * 500 * sizeof(float));
      CHECK(s.busy_ns > 0);
    }
  }

  TEST_CASE("a started collective whose peer never joins raises its hang from wait") {
    MemoryStore store;
    std::latch failed(1);
    Failure failure;
    require_no_errors(run_ranks(2, [&](int rank) {
      GlooCommunicator comm(store, "stuck-started", rank, 2, kFailureTimeout, nullptr);
      comm.barrier();
      if (rank == 1) {
        failed.wait();
        return;
      }
      std::vector<float> data(1000, 1.0f);
      CommWork work = comm.start_all_reduce(data.data(), data.size());
      failure = failure_of([&] { work.wait(); });
      failed.count_down();
    }));
    CHECK_MESSAGE(failure.code == ErrorCode::kCollectiveHang, describe(failure));
    CHECK(contains(failure.message, "group 'stuck-started' all_reduce seq 1"));
  }

  TEST_CASE("a communicator destroyed with a started collective in flight aborts it instead of waiting it out") {
    // The rank is failing for another reason: its group must not hold it
    // for a whole timeout on the way out.
    MemoryStore store;
    std::latch gone(1);
    Clock::duration destroy_took{};
    require_no_errors(run_ranks(2, [&](int rank) {
      auto comm = std::make_unique<GlooCommunicator>(store, "left-in-flight", rank, 2, 60s, nullptr);
      comm->barrier();
      if (rank == 1) {
        gone.wait();
        return;
      }
      std::vector<float> data(1000, 1.0f);
      CommWork work = comm->start_all_reduce(data.data(), data.size());
      const auto start = Clock::now();
      comm.reset();
      destroy_took = Clock::now() - start;
      gone.count_down();
    }));
    CHECK(destroy_took < 30s);
  }
}
