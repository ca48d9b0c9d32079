#include "health/board_publisher.h"
#include "health/progress_board.h"

#include "common/error.h"

#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>

namespace keel::health {
namespace {

// A segment name no other test process uses.
std::string unique_name(const char* what) { return "/keel-test." + std::to_string(getpid()) + "." + what; }

struct RemoveOnExit {
  std::string name;
  ~RemoveOnExit() { ProgressBoard::remove(name); }
};

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("a board reads back what its rank published") {
    RemoveOnExit guard{unique_name("roundtrip")};
    auto daemon_side = ProgressBoard::create(guard.name);
    CHECK_FALSE(daemon_side.read().has_value());

    BoardPublisher rank(ProgressBoard::open(guard.name), 3, 7);
    rank.set_extent(100, 1000);
    rank.set_phase(Phase::kBackward);
    rank.begin_collective("dp", 42, "all_reduce", 4096);
    rank.finish_step(101, 2.5f, 0.75f, 1234.0, 56.0);

    const auto seen = daemon_side.read();
    REQUIRE(seen.has_value());
    CHECK(seen->rank == 3);
    CHECK(seen->pid == getpid());
    CHECK(seen->generation == 7);
    CHECK(seen->first_step == 100);
    CHECK(seen->steps_done == 101);
    CHECK(seen->total_steps == 1000);
    CHECK(std::string(phase_name(seen->phase)) == "backward");
    CHECK(seen->loss == 2.5f);
    CHECK(seen->recent_step_ms[100 % kRecentSteps] == 56.0);
    CHECK(std::string(seen->collective.group) == "dp");
    CHECK(std::string(seen->collective.op) == "all_reduce");
    CHECK(seen->collective.seq == 42);
    CHECK(std::string(collective_state_name(seen->collective.state)) == "in_flight");

    rank.end_collective("dp", 42, true);
    CHECK(std::string(collective_state_name(daemon_side.read()->collective.state)) == "done");
    // A collective that is not the newest one leaves the board alone.
    rank.end_collective("tp", 42, false);
    CHECK(std::string(collective_state_name(daemon_side.read()->collective.state)) == "done");
  }

  TEST_CASE("a checkpoint request reaches the rank once however often it was made") {
    RemoveOnExit guard{unique_name("requests")};
    auto daemon_side = ProgressBoard::create(guard.name);
    BoardPublisher rank(ProgressBoard::open(guard.name), 0, 0);
    CHECK_FALSE(rank.take_checkpoint_request());
    daemon_side.request_checkpoint();
    daemon_side.request_checkpoint();
    CHECK(rank.take_checkpoint_request());
    CHECK_FALSE(rank.take_checkpoint_request());
    CHECK(daemon_side.read()->checkpoint_requests_seen == 2);
  }

  TEST_CASE("a rank without a board publishes nothing and never fails") {
    BoardPublisher none;
    CHECK_FALSE(none.active());
    none.set_phase(Phase::kForward);
    none.finish_step(1, 1, 1, 1, 1);
    CHECK_FALSE(none.take_checkpoint_request());
  }

  TEST_CASE("a missing or foreign segment is refused as bad configuration") {
    CHECK_THROWS_AS(ProgressBoard::open(unique_name("missing")), common::Error);
    try {
      ProgressBoard::open(unique_name("missing"));
    } catch (const common::Error& e) {
      CHECK(e.code() == common::ErrorCode::kBadConfig);
      CHECK(std::string(e.what()).find("KEEL_BOARD") != std::string::npos);
    }
  }

  TEST_CASE("a reader in another process never sees half of an update") {
    RemoveOnExit guard{unique_name("torn")};
    auto daemon_side = ProgressBoard::create(guard.name);
    constexpr int64_t kUpdates = 200000;
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      // Every field of update i is derived from i, so a torn copy shows up
      // as fields that disagree.
      auto board = ProgressBoard::open(guard.name);
      BoardSnapshot s;
      for (int64_t i = 1; i <= kUpdates; ++i) {
        s.steps_done = i;
        s.total_steps = 2 * i;
        s.loss = static_cast<float>(i);
        for (double& ms : s.recent_step_ms) ms = static_cast<double>(i);
        s.collective.seq = -i;
        board.publish(s);
      }
      _exit(0);
    }
    int64_t reads = 0, last = 0;
    bool consistent = true, monotonic = true, child_done = false;
    int status = 0;
    while (last < kUpdates) {
      // The writer's last update may be read after it exited; a writer that
      // died early must not leave this loop waiting.
      if (child_done) {
        if (daemon_side.read().value_or(BoardSnapshot{}).steps_done != kUpdates) break;
      } else {
        child_done = waitpid(child, &status, WNOHANG) == child;
      }
      const auto s = daemon_side.read();
      if (!s) continue;
      ++reads;
      const int64_t i = s->steps_done;
      bool same = s->total_steps == 2 * i && s->loss == static_cast<float>(i) && s->collective.seq == -i;
      for (double ms : s->recent_step_ms) same = same && ms == static_cast<double>(i);
      consistent = consistent && same;
      monotonic = monotonic && i >= last;
      last = i;
    }
    if (!child_done) waitpid(child, &status, 0);
    CHECK(WIFEXITED(status));
    CHECK(last == kUpdates);
    CHECK(consistent);
    CHECK(monotonic);
    CHECK(reads > 0);
  }
}

}  // namespace keel::health
