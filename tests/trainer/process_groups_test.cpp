// ProcessGroups: a rank's communicators by axis, over real Gloo groups
// (threads of one process act as the ranks of a dp 2 x tp 2 mesh).
#include "common/error.h"
#include "tests/support/failure.h"
#include "tests/support/memory_store.h"
#include "tests/support/thread_ranks.h"
#include "tests/support/wait.h"
#include "trainer/comm/gloo_communicator.h"
#include "trainer/parallel/process_groups.h"

#include <doctest/doctest.h>

#include <chrono>
#include <exception>
#include <functional>
#include <latch>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

using keel::test::MemoryStore;
using keel::test::run_ranks;
using namespace keel::trainer;
using namespace std::chrono_literals;

ProcessGroups::Join gloo_join(MemoryStore& store, std::vector<std::string>* joined = nullptr) {
  return [&store, joined](const Group& group) {
    if (joined != nullptr) joined->push_back(group.name);
    return std::make_unique<GlooCommunicator>(store, group.name, group.index_in_group,
                                              static_cast<int>(group.ranks.size()), 10000ms, nullptr);
  };
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("process groups join each distinct group once and answer every axis") {
    MemoryStore store;
    const Layout layout{.dp = 2, .tp = 2};
    std::vector<std::vector<std::string>> joined(4);
    std::vector<std::vector<float>> sums(4);
    const auto errors = run_ranks(4, [&](int rank) {
      const Mesh mesh(layout, rank);
      ProcessGroups groups(mesh, gloo_join(store, &joined[static_cast<size_t>(rank)]));
      CHECK(groups.get(Axis::kCp) == nullptr);
      CHECK(groups.get(Axis::kPp) == nullptr);
      CHECK(groups.get(Axis::kEp) == nullptr);
      // cp = 1 and ep = 1: dp x cp and the expert-DP group are the DP group.
      CHECK(groups.get(Axis::kDpCp) == groups.get(Axis::kDp));
      CHECK(groups.get(Axis::kExpertDp) == groups.get(Axis::kDp));
      REQUIRE(groups.communicators().size() == 2);
      CHECK(groups.communicators()[0].axis == Axis::kTp);
      CHECK(groups.communicators()[1].axis == Axis::kDp);
      CHECK(groups.rank(Axis::kTp) == mesh.coords().tp);
      CHECK(groups.rank(Axis::kDp) == mesh.coords().dp);
      CHECK(groups.size(Axis::kDpCp) == 2);
      CHECK(groups.size(Axis::kCp) == 1);
      CHECK(groups.rank(Axis::kCp) == 0);
      // Over TP, then over DP x CP: the four ranks' values in two sums.
      std::vector<float> values = {static_cast<float>(rank + 1)};
      groups.get(Axis::kTp)->all_reduce(values.data(), 1);
      sums[static_cast<size_t>(rank)].push_back(values[0]);
      groups.get(Axis::kDpCp)->all_reduce(values.data(), 1);
      sums[static_cast<size_t>(rank)].push_back(values[0]);
    });
    for (int rank = 0; rank < 4; ++rank) {
      CAPTURE(rank);
      CHECK_FALSE(errors[static_cast<size_t>(rank)]);
      CHECK(joined[static_cast<size_t>(rank)] == std::vector<std::string>{rank < 2 ? "tp.0" : "tp.1",
                                                                           rank % 2 == 0 ? "dp.0" : "dp.1"});
      // Ranks 0 and 1 hold 1 + 2 over TP, ranks 2 and 3 hold 3 + 4.
      CHECK(sums[static_cast<size_t>(rank)] == std::vector<float>{rank < 2 ? 3.0f : 7.0f, 10.0f});
    }
  }

  TEST_CASE("a single rank has no communicator on any axis") {
    const ProcessGroups& none = ProcessGroups::none();
    for (Axis axis : kAxes) {
      CAPTURE(axis_name(axis));
      CHECK(none.get(axis) == nullptr);
      CHECK(none.rank(axis) == 0);
      CHECK(none.size(axis) == 1);
    }
    CHECK(none.communicators().empty());
    ProcessGroups alone(Mesh(Layout{}, 0), [](const Group&) -> std::unique_ptr<Communicator> {
      FAIL("a single rank joins nothing");
      return nullptr;
    });
    CHECK(alone.communicators().empty());
  }

  TEST_CASE("a peer failure in one group makes the rank leave its other groups") {
    // Every rank stays alive to the end, so no connection closes: the news
    // travels only through departure records and the handlers. Rank 0
    // leaves; rank 1, in no call, hears it over TP and leaves DP, where
    // rank 3 waits for it though rank 3 shares no group with rank 0.
    MemoryStore store;
    const Layout layout{.dp = 2, .tp = 2};
    std::mutex mutex;
    std::vector<std::string> heard(4);  // the first cause each rank's handler heard
    std::vector<keel::test::Failure> failures(4);
    std::latch all_done(4);
    const auto errors = run_ranks(4, [&](int rank) {
      ProcessGroups groups(Mesh(layout, rank), gloo_join(store));
      auto heard_of = [&](int r) {
        std::lock_guard<std::mutex> lock(mutex);
        return heard[static_cast<size_t>(r)];
      };
      groups.on_peer_failure([&, rank](const std::string& cause) {
        std::lock_guard<std::mutex> lock(mutex);  // every group's watcher may call it
        if (heard[static_cast<size_t>(rank)].empty()) heard[static_cast<size_t>(rank)] = cause;
      });
      std::vector<float> value = {1.0f};
      if (rank == 0) groups.leave_all("rank 0 failed on purpose");
      if (rank == 1) keel::test::wait_until([&] { return !heard_of(1).empty(); }, 30);
      if (rank == 2 || rank == 3) {
        failures[static_cast<size_t>(rank)] =
            keel::test::failure_of([&] { groups.get(Axis::kDp)->all_reduce(value.data(), 1); });
      }
      all_done.arrive_and_wait();
      groups.on_peer_failure();  // heard is about to go
    });
    for (int rank = 0; rank < 4; ++rank) CHECK_FALSE(errors[static_cast<size_t>(rank)]);
    CAPTURE(heard[1]);
    CHECK(heard[1].find("rank 0 failed on purpose") != std::string::npos);
    for (int rank : {2, 3}) {
      CAPTURE(rank);
      CAPTURE(failures[static_cast<size_t>(rank)].message);
      // A peer failure, not a hang at the timeout: for rank 3 only rank 1's
      // departure could have brought it.
      CHECK(failures[static_cast<size_t>(rank)].code == keel::common::ErrorCode::kPeerFailure);
    }
  }
}
