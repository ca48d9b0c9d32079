// keeld's health monitor and health policy on their own
// (daemon/health_monitor.h, daemon/health_policy.h): synthetic boards and
// a FakeClock in, verdicts, per-rank health and the policy's response out.
// No process, no sleeping.
#include "common/clock.h"
#include "daemon/health_monitor.h"
#include "daemon/health_policy.h"

#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

namespace keel::daemon {
namespace {

common::HealthConfig health_config() {
  common::HealthConfig c;
  c.heartbeat_timeout_s = 2;
  c.hang_timeout_floor_s = 1;
  c.hang_timeout_ceiling_s = 5;
  c.hang_warmup_steps = 20;
  return c;
}

// A rank's board at `now_ns`: training step `steps`, in the forward phase
// since `now_ns`, its heartbeat live.
health::RankSample sample(int rank, int64_t now_ns, int64_t steps = 3) {
  health::BoardSnapshot b;
  b.rank = rank;
  b.pid = 1000 + rank;
  b.steps_done = steps;
  b.total_steps = 100;
  b.phase = static_cast<uint32_t>(health::Phase::kForward);
  b.update_ns = now_ns;
  b.step_start_ns = now_ns;
  b.phase_start_ns = now_ns;
  return {rank, b, now_ns, true};
}

// Puts the rank in group `name` (slot 0) with collective `seq_begun` in
// `state` since `begin_ns`.
void in_group(health::RankSample& s, const std::string& name, int index, int size, int64_t seq_begun,
              health::CollectiveState state, int64_t begin_ns) {
  auto& g = s.board->groups[0];
  std::strncpy(g.name, name.c_str(), sizeof(g.name) - 1);
  std::strncpy(g.op, "all_reduce", sizeof(g.op) - 1);
  g.index = index;
  g.size = size;
  g.seq_begun = seq_begun;
  g.seq_done = state == health::CollectiveState::kInFlight ? seq_begun - 1 : seq_begun;
  g.state = static_cast<uint32_t>(state);
  g.begin_ns = begin_ns;
  // In flight, the previous collective ended just before this one began.
  g.done_ns = state == health::CollectiveState::kInFlight ? begin_ns - 1000 : begin_ns + 1000;
}

void report_sdc(health::RankSample& s, uint64_t count, int64_t step, int rank, health::SdcMethod method,
                health::SdcVerdict verdict) {
  s.board->sdc = {count, step, rank, static_cast<uint32_t>(method), static_cast<uint32_t>(verdict), 0};
}

// Three ranks of one DP group: ranks 0 and 2 wait in #7 since `since`,
// rank 1 finished #6 and never began #7.
health::RankSamples stuck_on_rank_1(int64_t since, int64_t now_ns, int64_t heartbeat_1) {
  health::RankSamples samples = {sample(0, now_ns), sample(1, now_ns), sample(2, now_ns)};
  in_group(samples[0], "g0.dp.0", 0, 3, 7, health::CollectiveState::kInFlight, since);
  in_group(samples[1], "g0.dp.0", 1, 3, 6, health::CollectiveState::kDone, since - 1'000'000);
  in_group(samples[2], "g0.dp.0", 2, 3, 7, health::CollectiveState::kInFlight, since);
  samples[1].board->phase_start_ns = since;
  samples[1].board->update_ns = heartbeat_1;
  samples[1].heartbeat_ns = heartbeat_1;
  return samples;
}

// keeld polls every 200 ms and the detector counts only the time it
// watched (a gap is a clock jump, not a hang): advances the clock by
// `seconds` in polls of 100 ms, rank 1 stuck since `since` with a live
// heartbeat, and returns every verdict found on the way.
Verdicts watch_stuck(HealthMonitor& monitor, common::FakeClock& clock, int64_t since, double seconds) {
  Verdicts all;
  for (int tick = 0; tick < static_cast<int>(seconds * 10 + 0.5); ++tick) {
    clock.advance_s(0.1);
    auto v = monitor.observe(stuck_on_rank_1(since, clock.now_ns(), clock.now_ns()), clock.now_ns());
    all.hangs.insert(all.hangs.end(), v.hangs.begin(), v.hangs.end());
    all.sdc.insert(all.sdc.end(), v.sdc.begin(), v.sdc.end());
    all.stragglers.insert(all.stragglers.end(), v.stragglers.begin(), v.stragglers.end());
  }
  return all;
}

// A generation of `world` ranks on one node.
std::vector<std::string> one_node(int world) { return std::vector<std::string>(static_cast<size_t>(world)); }

// Three ranks' boards with steps 0..`steps`-1 timed, rank 2 the slowest.
health::RankSamples timed(int64_t now_ns, int64_t steps) {
  health::RankSamples samples = {sample(0, now_ns, steps), sample(1, now_ns, steps), sample(2, now_ns, steps)};
  for (auto& s : samples) {
    for (int64_t step = 0; step < steps; ++step) {
      auto& t = s.board->steps[step % health::kRecentSteps];
      t.step = step;
      t.compute_ms = t.total_ms = 100.0f + 10.0f * static_cast<float>(s.rank);
    }
  }
  return samples;
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("a rank that never began the collective the others wait in is named hung once and healthy in the next generation") {
    common::FakeClock clock;
    HealthMonitor monitor(health_config(), 3);
    const int64_t since = clock.now_ns();
    // Within the budget (the ceiling, before warm-up) nothing is found.
    CHECK(watch_stuck(monitor, clock, since, 4).empty());
    CHECK(monitor.rank(1).condition == RankCondition::kHealthy);

    // Past it, rank 1 is the culprit: its heartbeat beats, but nothing it
    // does (its phase for as long) explains it.
    const auto verdicts = watch_stuck(monitor, clock, since, 2);
    REQUIRE(verdicts.hangs.size() == 1);
    const auto& hang = verdicts.hangs[0];
    CHECK(hang.culprit_ranks == std::vector<int>{1});
    CHECK(hang.waiting_ranks == std::vector<int>{0, 2});
    CHECK(hang.group == "g0.dp.0");
    CHECK(hang.seq == 7);
    CHECK(hang.detect_s <= health_config().hang_timeout_ceiling_s + 2);
    CHECK(monitor.rank(1).condition == RankCondition::kHung);
    CHECK(monitor.rank(1).reason.find("g0.dp.0 #7") != std::string::npos);
    CHECK(monitor.rank(0).condition == RankCondition::kHealthy);
    CHECK(monitor.counts().hang == 1);

    // Found once per collective.
    CHECK(watch_stuck(monitor, clock, since, 1).hangs.empty());
    CHECK(monitor.counts().hang == 1);

    monitor.new_generation(one_node(3));
    CHECK(monitor.rank(1).condition == RankCondition::kHealthy);
    const auto health = monitor.health_json();
    CHECK(health.at("ranks").size() == 3);
    CHECK(health.at("detections").at("hang") == 1);
  }

  TEST_CASE("a frozen rank is named among the culprits and frozen") {
    common::FakeClock clock;
    HealthMonitor monitor(health_config(), 3);
    const int64_t since = clock.now_ns();
    const int64_t last_beat = since;  // rank 1 was stopped at `since`
    clock.advance_s(6);
    const auto verdicts = monitor.observe(stuck_on_rank_1(since, clock.now_ns(), last_beat), clock.now_ns());
    REQUIRE(verdicts.hangs.size() == 1);
    CHECK(verdicts.hangs[0].culprit_ranks == std::vector<int>{1});
    CHECK(verdicts.hangs[0].frozen_ranks == std::vector<int>{1});
    CHECK(monitor.rank(1).reason.find("frozen") != std::string::npos);
  }

  TEST_CASE("the ranks' own SDC reports become one finding each and mark the named rank suspect") {
    common::FakeClock clock;
    HealthMonitor monitor(health_config(), 3);
    const int64_t now = clock.now_ns();
    auto samples = health::RankSamples{sample(0, now), sample(1, now), sample(2, now)};
    CHECK(monitor.observe(samples, now).empty());  // count 0: no report

    // Every rank reports the same rerun finding against rank 2.
    for (auto& s : samples) report_sdc(s, 1, 12, 2, health::SdcMethod::kRerun, health::SdcVerdict::kTransient);
    auto verdicts = monitor.observe(samples, now);
    REQUIRE(verdicts.sdc.size() == 1);
    CHECK(verdicts.sdc[0].rank == 2);
    CHECK(verdicts.sdc[0].method == "rerun");
    CHECK(verdicts.sdc[0].verdict == "transient");
    CHECK(!verdicts.sdc[0].last_good_step);
    CHECK(verdicts.sdc[0].event_fields() ==
          nlohmann::json{{"rank", 2}, {"step", 12}, {"method", "rerun"}, {"verdict", "transient"}});
    CHECK(monitor.rank(2).condition == RankCondition::kSuspect);
    CHECK(monitor.rank(0).condition == RankCondition::kHealthy);
    CHECK(monitor.counts().sdc == 1);
    // The same count again is the same report.
    CHECK(monitor.observe(samples, now).empty());

    // A rerun that came out the same is a loss spike, no SDC: a board
    // never reports one, and the verdict older builds used for it (3,
    // "data") counts as nothing.
    report_sdc(samples[0], 2, 14, -1, health::SdcMethod::kRerun, static_cast<health::SdcVerdict>(3));
    CHECK(monitor.observe(samples, now).empty());
    CHECK(monitor.counts().sdc == 1);

    // Garbage on a board names nobody.
    struct Garbage {
      const char* what;
      int rank;
      uint32_t method, verdict;
    };
    const Garbage garbage[] = {{"method out of range", 0, 99, 1},
                               {"verdict out of range", 0, 3, 42},
                               {"no method", 0, 0, 1},
                               {"no verdict", 0, 3, 0}};
    uint64_t count = 10;
    for (const auto& g : garbage) {
      CAPTURE(g.what);
      samples[1].board->sdc = {++count, 20, g.rank, g.method, g.verdict, 0};
      CHECK(monitor.observe(samples, now).sdc.empty());
    }
    CHECK(monitor.rank(0).condition == RankCondition::kHealthy);
    // A rank out of range is no rank: the finding names nobody.
    samples[1].board->sdc = {++count, 21, 77, 3, 2, 0};
    verdicts = monitor.observe(samples, now);
    REQUIRE(verdicts.sdc.size() == 1);
    CHECK(verdicts.sdc[0].rank == -1);

    // A new generation's boards count from zero again; rank 2 stays suspect.
    monitor.new_generation(one_node(3));
    samples = {sample(0, now), sample(1, now), sample(2, now)};
    report_sdc(samples[0], 1, 12, 2, health::SdcMethod::kKat, health::SdcVerdict::kPersistent);
    CHECK(monitor.observe(samples, now).sdc.size() == 1);
    CHECK(monitor.rank(2).condition == RankCondition::kSuspect);
    CHECK(monitor.rank(2).reason.find("known-answer") != std::string::npos);
  }

  TEST_CASE("what was learned of a rank number stays while it runs on its node and goes when the placement changes") {
    common::FakeClock clock;
    HealthMonitor monitor(health_config(), 3);
    const std::vector<std::string> three_nodes = {"node-a", "node-b", "node-c"};
    monitor.new_generation(three_nodes);
    auto samples = timed(clock.now_ns(), 10);
    report_sdc(samples[0], 1, 3, 2, health::SdcMethod::kKat, health::SdcVerdict::kPersistent);
    monitor.observe(samples, clock.now_ns());
    REQUIRE(monitor.rank(2).condition == RankCondition::kSuspect);
    REQUIRE_FALSE(monitor.straggler_report().at("steps").empty());

    // The same nodes in the same places: rank 2 is the same machine.
    monitor.new_generation(three_nodes);
    CHECK(monitor.rank(2).condition == RankCondition::kSuspect);
    CHECK_FALSE(monitor.straggler_report().at("steps").empty());

    // node-b left: rank 2 is now a rank of another node (the world has
    // three ranks still, as with two nodes of more ranks each).
    monitor.new_generation({"node-a", "node-c", "node-c"});
    CHECK(monitor.rank(2).condition == RankCondition::kHealthy);
    CHECK(monitor.straggler_report().at("steps").empty());
    CHECK(monitor.counts().sdc == 1);  // what was found stays counted
  }

  TEST_CASE("a rank shows its worst verdict: hung over suspect over straggler") {
    common::FakeClock clock;
    HealthMonitor monitor(health_config(), 3);
    const int64_t since = clock.now_ns();
    auto samples = stuck_on_rank_1(since, since, since);
    report_sdc(samples[0], 1, 3, 1, health::SdcMethod::kKat, health::SdcVerdict::kPersistent);
    monitor.observe(samples, since);
    CHECK(monitor.rank(1).condition == RankCondition::kSuspect);
    REQUIRE(watch_stuck(monitor, clock, since, 6).hangs.size() == 1);
    CHECK(monitor.rank(1).condition == RankCondition::kHung);
    monitor.new_generation(one_node(3));
    CHECK(monitor.rank(1).condition == RankCondition::kSuspect);
  }

  TEST_CASE("the health policy records keeld's verdicts and restarts only for a hang or a corrupted replica") {
    health::HangFinding hang;
    hang.culprit_ranks = {1};
    hang.waiting_ranks = {0, 2};
    hang.group = "g0.dp.0";
    hang.seq = 7;
    hang.op = "all_reduce";
    hang.reason = "rank 1 never began g0.dp.0 #7";
    const SdcFinding digest{2, 40, "replica_digest", "persistent", 3, {}, 30};
    const SdcFinding earlier_digest{1, 40, "replica_digest", "persistent", 3, {}, 20};
    const SdcFinding no_majority{-1, 40, "replica_digest", "persistent", 2, {0, 1}, 30};
    const SdcFinding rerun{2, 41, "rerun", "transient", 0, {}, std::nullopt};
    health::StragglerFinding straggler;
    straggler.rank = 3;
    straggler.score = 0.12;
    straggler.step = 50;

    struct Case {
      const char* name;
      Verdicts verdicts;
      std::string policy;
      std::vector<std::string> events;
      std::string stop_cause;  // a part of it; empty: no stop
      std::optional<int64_t> keep_through;
      bool warns = false;
    };
    const std::vector<Case> cases = {
        {"a hang", {{hang}, {}, {}}, "restart", {"hang_detected"}, "hang detected: rank 1 never began", std::nullopt},
        {"a digest finding under warn", {{}, {digest}, {}}, "warn", {"sdc_detected"}, "", std::nullopt},
        {"a digest finding under restart", {{}, {digest}, {}}, "restart", {"sdc_detected"}, "rank 2 at step 40", 30},
        {"two digest findings keep through the older good step",
         {{}, {digest, earlier_digest}, {}}, "restart", {"sdc_detected", "sdc_detected"}, "rank 2", 20},
        {"replicas without a majority", {{}, {no_majority}, {}}, "restart", {"sdc_detected"}, "no majority", 30},
        {"a rerun finding is the trainer's: not recorded again, no stop", {{}, {rerun}, {}}, "restart", {}, "",
         std::nullopt},
        {"exclude acts as restart and says so", {{}, {digest}, {}}, "exclude", {"sdc_detected"}, "rank 2", 30, true},
        {"a straggler only records", {{}, {}, {straggler}}, "restart", {"straggler_flagged"}, "", std::nullopt},
        {"a hang and a corrupted rank at once",
         {{hang}, {digest}, {straggler}}, "restart", {"hang_detected", "sdc_detected", "straggler_flagged"},
         "hang detected", 30},
    };
    for (const auto& c : cases) {
      CAPTURE(c.name);
      const auto r = respond(c.verdicts, c.policy, "flight/0");
      std::vector<std::string> kinds;
      for (const auto& e : r.events) kinds.push_back(e.kind);
      CHECK(kinds == c.events);
      if (c.stop_cause.empty()) {
        CHECK(r.stop_cause.empty());
      } else {
        CAPTURE(r.stop_cause);
        CHECK(r.stop_cause.find(c.stop_cause) != std::string::npos);
      }
      CHECK(r.keep_through_step == c.keep_through);
      CHECK(r.warnings.empty() != c.warns);
      for (const auto& e : r.events) {
        if (e.kind == "hang_detected") {
          CHECK(e.fields.at("culprit_ranks") == std::vector<int>{1});
          CHECK(e.fields.at("flight") == "flight/0");
        }
        if (e.kind == "sdc_detected") {
          CHECK(e.fields.at("policy") == c.policy);
          for (const char* key : {"rank", "step", "method", "verdict"}) CHECK(e.fields.contains(key));
        }
        if (e.kind == "straggler_flagged") {
          CHECK(e.fields.at("rank") == 3);
          CHECK(e.fields.at("score") == 0.12);
        }
      }
    }
  }
}

}  // namespace keel::daemon
