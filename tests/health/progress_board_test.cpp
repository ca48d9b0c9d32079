#include "health/board_publisher.h"
#include "health/progress_board.h"

#include "common/clock.h"
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
    const int dp = rank.add_group("g0.dp.0", 1, 4);
    rank.begin_collective(dp, 42, "all_reduce", 4096);
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
    const GroupRecord* g = seen->group("g0.dp.0");
    REQUIRE(g != nullptr);
    CHECK(g->index == 1);
    CHECK(g->size == 4);
    CHECK(std::string(g->op) == "all_reduce");
    CHECK(g->seq_begun == 42);
    CHECK(g->seq_done == -1);
    CHECK(std::string(collective_state_name(g->state)) == "in_flight");

    rank.end_collective(dp, 42, true);
    g = daemon_side.read()->group("g0.dp.0");
    CHECK(std::string(collective_state_name(g->state)) == "done");
    CHECK(g->seq_done == 42);
  }

  TEST_CASE("a long group name round-trips and its collectives end") {
    // Pipeline and expert parallelism name groups like this one; board v1
    // kept 15 characters and compared against the truncated copy, so the
    // collective never showed as done.
    RemoveOnExit guard{unique_name("longname")};
    auto daemon_side = ProgressBoard::create(guard.name);
    BoardPublisher rank(ProgressBoard::open(guard.name), 0, 10);
    const std::string name = "g10.expert_dp.12";
    const int id = rank.add_group(name, 0, 2);
    const int other = rank.add_group("g10.expert_dp.13", 1, 2);
    rank.begin_collective(id, 5, "all_reduce", 8);
    rank.begin_collective(other, 9, "all_reduce", 8);
    rank.end_collective(id, 5, true);
    const auto seen = daemon_side.read();
    REQUIRE(seen.has_value());
    REQUIRE(seen->group(name) != nullptr);
    CHECK(group_name(*seen->group(name)) == name);
    CHECK(seen->group(name)->seq_done == 5);
    CHECK(std::string(collective_state_name(seen->group(name)->state)) == "done");
    CHECK(std::string(collective_state_name(seen->group("g10.expert_dp.13")->state)) == "in_flight");
  }

  TEST_CASE("a group name the board cannot hold whole is refused") {
    BoardPublisher none;
    CHECK_THROWS_AS(none.add_group(std::string(kGroupNameBytes, 'x'), 0, 2), common::Error);
    CHECK_THROWS_AS(none.add_group("", 0, 2), common::Error);
    for (size_t i = 0; i < kMaxGroups; ++i) CHECK(none.add_group("g0.dp." + std::to_string(i), 0, 2) == int(i));
    CHECK_THROWS_AS(none.add_group("g0.one_too_many.0", 0, 2), common::Error);
  }

  TEST_CASE("a step's time is split into compute collective wait data waiting for a CPU and stalls") {
    for (const bool cpu_rank : {true, false}) {
      CAPTURE(cpu_rank);
      RemoveOnExit guard{unique_name("timing")};
      auto daemon_side = ProgressBoard::create(guard.name);
      common::FakeClock clock;
      BoardPublisher rank(ProgressBoard::open(guard.name), 0, 0, clock);
      // A rank computing on a device waits for it by design: no stalls.
      rank.time_stalls(cpu_rank);
      const int dp = rank.add_group("g0.dp.0", 0, 2);
      rank.begin_step(7);
      rank.set_phase(Phase::kData);
      clock.advance_s(0.010);
      clock.stop_ns(common::seconds_to_ns(0.003));  // blocked reading the batch: data time already
      rank.set_phase(Phase::kForward);
      clock.advance_s(0.030);
      clock.wait_for_cpu_ns(common::seconds_to_ns(0.015));  // another process had the CPU
      clock.lose_cpu_to_own_thread_ns(common::seconds_to_ns(0.005));  // the rank's own communication thread had it
      clock.stop_ns(common::seconds_to_ns(0.008));  // stopped from outside (SIGSTOP)
      rank.begin_collective(dp, 0, "all_reduce", 4);
      const auto blocked = rank.begin_wait();
      clock.advance_s(0.040);
      clock.wait_for_cpu_ns(common::seconds_to_ns(0.010));  // inside the collective: wait already
      clock.stop_ns(common::seconds_to_ns(0.004));
      rank.end_wait(blocked);
      rank.end_collective(dp, 0, true);
      // A collective that ran on the communication thread while the rank
      // computed (overlapped) is compute time, not wait.
      rank.begin_collective(dp, 1, "all_reduce", 4);
      clock.advance_s(0.020);
      rank.end_collective(dp, 1, true);
      rank.record_step_timing();
      const auto seen = daemon_side.read();
      REQUIRE(seen.has_value());
      const StepTiming* t = seen->timing_of(7);
      REQUIRE(t != nullptr);
      CHECK(t->total_ms == doctest::Approx(145));
      CHECK(t->data_ms == doctest::Approx(13));
      CHECK(t->wait_ms == doctest::Approx(54));
      CHECK(t->cpu_wait_ms == doctest::Approx(20));
      CHECK(t->own_cpu_wait_ms == doctest::Approx(5));
      CHECK(t->compute_ms == doctest::Approx(58));
      CHECK(t->stalled_ms == doctest::Approx(cpu_rank ? 8 : 0));
      CHECK(seen->timing_of(7 + kRecentSteps) == nullptr);
      CHECK(seen->phase_count[static_cast<size_t>(Phase::kData)] == 1);
      CHECK(seen->phase_last_ms[static_cast<size_t>(Phase::kData)] == doctest::Approx(13));
    }
  }

  TEST_CASE("each group's payload of the last step timed is on the board and a step of none shows none") {
    RemoveOnExit guard{unique_name("step-bytes")};
    auto daemon_side = ProgressBoard::create(guard.name);
    common::FakeClock clock;
    BoardPublisher rank(ProgressBoard::open(guard.name), 0, 0, clock);
    const int tp = rank.add_group("g0.tp.0", 0, 2);
    const int dp = rank.add_group("g0.dp.0", 0, 2);
    rank.begin_step(3);
    rank.begin_collective(tp, 0, "all_reduce", 1000);
    rank.end_collective(tp, 0, true);
    rank.begin_collective(tp, 1, "all_gather", 500);
    rank.end_collective(tp, 1, true);
    rank.begin_collective(dp, 0, "all_reduce", 4096);
    // Still in flight when the step closes: begun in it, so counted.
    rank.record_step_timing();
    auto seen = daemon_side.read();
    REQUIRE(seen.has_value());
    CHECK(seen->groups[tp].step_bytes == 1500);
    CHECK(seen->groups[dp].step_bytes == 4096);
    rank.end_collective(dp, 0, true);
    rank.begin_step(4);
    rank.record_step_timing();
    seen = daemon_side.read();
    REQUIRE(seen.has_value());
    CHECK(seen->groups[tp].step_bytes == 0);
    CHECK(seen->groups[dp].step_bytes == 0);
  }

  TEST_CASE("the heartbeat goes on while the rank's own thread is busy") {
    RemoveOnExit guard{unique_name("heartbeat")};
    auto daemon_side = ProgressBoard::create(guard.name);
    CHECK(daemon_side.heartbeat_ns() == 0);
    common::FakeClock clock;
    BoardPublisher rank(ProgressBoard::open(guard.name), 0, 0, clock, 1'000'000);
    const int64_t first = daemon_side.heartbeat_ns();
    CHECK(first == clock.now_ns());
    clock.advance_s(5);
    // Nothing is published; only the publisher's own thread can move it.
    for (int i = 0; i < 100000 && daemon_side.heartbeat_ns() == first; ++i) usleep(1000);
    CHECK(daemon_side.heartbeat_ns() == clock.now_ns());
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

  TEST_CASE("a fault keeld requests reaches the rank once") {
    RemoveOnExit guard{unique_name("faults")};
    auto daemon_side = ProgressBoard::create(guard.name);
    BoardPublisher rank(ProgressBoard::open(guard.name), 0, 0);
    CHECK_FALSE(rank.take_fault_request().has_value());
    FaultRequest slow;
    slow.kind = static_cast<uint32_t>(FaultKind::kSlow);
    slow.factor = 1.5;
    daemon_side.request_fault(slow);
    const auto taken = rank.take_fault_request();
    REQUIRE(taken.has_value());
    CHECK(std::string(fault_kind_name(taken->kind)) == "slow");
    CHECK(taken->factor == 1.5);
    CHECK_FALSE(rank.take_fault_request().has_value());
  }

  TEST_CASE("the recent collectives ring keeps the newest of every group") {
    RemoveOnExit guard{unique_name("recent")};
    auto daemon_side = ProgressBoard::create(guard.name);
    BoardPublisher rank(ProgressBoard::open(guard.name), 0, 0);
    const int dp = rank.add_group("g0.dp.0", 0, 2);
    const int tp = rank.add_group("g0.tp.0", 0, 2);
    for (int64_t seq = 0; seq < 20; ++seq) {
      rank.begin_collective(seq % 2 == 0 ? dp : tp, seq / 2, "all_reduce", 4);
      if (seq < 19) rank.end_collective(seq % 2 == 0 ? dp : tp, seq / 2, true);
    }
    const auto seen = daemon_side.read();
    REQUIRE(seen.has_value());
    CHECK(seen->recent_count == 20);
    const RecentCollective& newest = seen->recent[(seen->recent_count - 1) % kRecentCollectives];
    CHECK(newest.group == tp);
    CHECK(newest.seq == 9);
    CHECK(std::string(collective_state_name(newest.state)) == "in_flight");
    const RecentCollective& before = seen->recent[(seen->recent_count - 2) % kRecentCollectives];
    CHECK(before.group == dp);
    CHECK(std::string(collective_state_name(before.state)) == "done");
    CHECK(before.end_ns >= before.begin_ns);
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
        for (auto& t : s.steps) t.step = i;
        for (auto& g : s.groups) g.seq_begun = -i;
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
      bool same = s->total_steps == 2 * i && s->loss == static_cast<float>(i);
      for (const auto& t : s->steps) same = same && t.step == i;
      for (const auto& g : s->groups) same = same && g.seq_begun == -i;
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
