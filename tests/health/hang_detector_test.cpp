#include "health/hang_detector.h"

#include "common/clock.h"
#include "common/log.h"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace keel::health {
namespace {

constexpr double kPollS = 0.25;  // how often the tests observe, like keeld's poll
constexpr double kStepS = 0.4;   // one healthy step

common::HealthConfig test_config() {
  common::HealthConfig c;
  c.heartbeat_timeout_s = 2;
  c.hang_timeout_floor_s = 1;
  c.hang_timeout_ceiling_s = 20;
  c.hang_warmup_steps = 5;
  c.hang_timeout_multiple = 5;
  return c;
}

// A job of dp x tp synthetic ranks whose boards change as BoardPublisher
// changes them, on a FakeClock, observed by a HangDetector the way keeld
// observes it. Rank r is TP index r % tp of DP replica r / tp: groups
// "g0.tp.<r / tp>" and "g0.dp.<r % tp>".
class SyntheticJob {
 public:
  SyntheticJob(int dp, int tp) : detector_(config_), tp_(tp), dp_(dp) {
    const int world = dp * tp;
    samples_.resize(world);
    for (int r = 0; r < world; ++r) {
      samples_[r].rank = r;
      BoardSnapshot& b = samples_[r].board.emplace();
      b.rank = r;
      b.pid = 1000 + r;
      b.phase_start_ns = clock_.now_ns();
      b.update_ns = clock_.now_ns();
      if (dp > 1) join(r, fmt::format("g0.dp.{}", r % tp), r / tp, dp);
      if (tp > 1) join(r, fmt::format("g0.tp.{}", r / tp), r % tp, tp);
      samples_[r].heartbeat_ns = clock_.now_ns();
    }
  }

  int world() const { return static_cast<int>(samples_.size()); }
  HangDetector& detector() { return detector_; }
  common::FakeClock& clock() { return clock_; }
  RankSample& sample(int r) { return samples_[r]; }
  BoardSnapshot& board(int r) { return *samples_[r].board; }
  const std::vector<HangFinding>& findings() const { return findings_; }

  // The group of kind `kind` ("dp", "tp") rank r belongs to.
  GroupRecord& group(int r, const std::string& kind) {
    GroupRecord* found = nullptr;
    for (GroupRecord& g : board(r).groups) {
      if (g.name[0] != '\0' && group_kind(group_name(g)) == kind) found = &g;
    }
    REQUIRE(found != nullptr);
    return *found;
  }
  std::string group_name_of(int r, const std::string& kind) { return group_name(group(r, kind)); }
  // The members of the group of kind `kind` rank r belongs to.
  std::set<int> members(int r, const std::string& kind) {
    std::set<int> ranks;
    const std::string name = group_name_of(r, kind);
    for (int o = 0; o < world(); ++o) {
      if (samples_[o].board && samples_[o].board->group(name) != nullptr) ranks.insert(o);
    }
    return ranks;
  }

  void set_phase(int r, Phase phase) {
    BoardSnapshot& b = board(r);
    const int64_t now = clock_.now_ns();
    b.phase_last_ms[b.phase] = static_cast<float>((now - b.phase_start_ns) / 1e6);
    b.phase_count[b.phase] += 1;
    b.phase = static_cast<uint32_t>(phase);
    b.phase_start_ns = now;
    b.update_ns = now;
  }
  void begin(int r, const std::string& kind, const char* op = "all_reduce") {
    GroupRecord& g = group(r, kind);
    std::strncpy(g.op, op, kOpNameBytes - 1);
    g.seq_begun += 1;
    g.begin_ns = clock_.now_ns();
    g.state = static_cast<uint32_t>(CollectiveState::kInFlight);
    board(r).update_ns = clock_.now_ns();
  }
  void end(int r, const std::string& kind) {
    GroupRecord& g = group(r, kind);
    g.seq_done = g.seq_begun;
    g.done_ns = clock_.now_ns();
    g.state = static_cast<uint32_t>(CollectiveState::kDone);
    board(r).update_ns = clock_.now_ns();
  }
  void finish_step(int r) {
    board(r).steps_done += 1;
    board(r).update_ns = clock_.now_ns();
  }
  // A frozen rank (SIGSTOP) stops beating its heartbeat.
  void freeze(int r) { frozen_.insert(r); }

  // Moves the clock; every live rank's heartbeat thread beats meanwhile.
  void advance(double s) {
    clock_.advance_s(s);
    for (int r = 0; r < world(); ++r) {
      if (frozen_.count(r) == 0 && samples_[r].board) samples_[r].heartbeat_ns = clock_.now_ns();
    }
  }
  // One observation, of the boards as `corrupt` (if set) garbles them.
  std::vector<HangFinding> poll() {
    RankSamples seen = samples_;
    if (corrupt) corrupt(seen);
    auto found = detector_.observe(seen, clock_.now_ns());
    findings_.insert(findings_.end(), found.begin(), found.end());
    return found;
  }
  // Polls every kPollS (or less, at the end) for `s` seconds.
  void wait(double s) {
    for (double left = s; left > 1e-9; left -= kPollS) {
      advance(std::min(kPollS, left));
      poll();
    }
  }
  // Polls every kPollS until a finding or `s` seconds.
  void wait_for_finding(double s) {
    const size_t before = findings_.size();
    for (double t = 0; findings_.size() == before && t < s; t += kPollS) {
      advance(kPollS);
      poll();
    }
  }

  // The ranks in `ranks` go through the phase `phase` for `s` seconds.
  void phase_for(const std::set<int>& ranks, Phase phase, double s) {
    for (int r : ranks) set_phase(r, phase);
    wait(s);
  }
  // Every rank in `ranks` begins its next collective of kind `kind` and
  // ends it `s` later.
  void collective(const std::set<int>& ranks, const std::string& kind, double s, const char* op = "all_reduce") {
    for (int r : ranks) begin(r, kind, op);
    poll();
    wait(s);
    for (int r : ranks) end(r, kind);
    poll();
  }
  std::set<int> all() const {
    std::set<int> ranks;
    for (int r = 0; r < world(); ++r) ranks.insert(r);
    return ranks;
  }
  // One healthy step of every rank: data, forward with a TP all-reduce,
  // backward, the DP all-reduce, optimizer.
  void step() {
    phase_for(all(), Phase::kData, 0.1 * kStepS);
    phase_for(all(), Phase::kForward, 0.2 * kStepS);
    if (tp_ > 1) collective(all(), "tp", 0.05 * kStepS);
    phase_for(all(), Phase::kBackward, 0.3 * kStepS);
    if (dp_ > 1) collective(all(), "dp", 0.1 * kStepS);
    phase_for(all(), Phase::kOptimizer, 0.25 * kStepS);
    for (int r = 0; r < world(); ++r) finish_step(r);
  }
  // Steps until the detector is warmed up and has learned from a few more.
  void warm_up() {
    for (int64_t s = 0; s <= config_.hang_warmup_steps + 2; ++s) step();
    REQUIRE(detector_.warmed_up());
  }

  // Applied to a copy of the samples before each observation.
  std::function<void(RankSamples&)> corrupt;

 private:
  void join(int r, const std::string& name, int index, int size) {
    for (GroupRecord& g : board(r).groups) {
      if (g.name[0] != '\0') continue;
      std::strncpy(g.name, name.c_str(), kGroupNameBytes - 1);
      g.index = index;
      g.size = size;
      return;
    }
  }

  common::HealthConfig config_ = test_config();
  // CLOCK_MONOTONIC counts from boot: far enough from zero for an hour's
  // jump back.
  common::FakeClock clock_{common::seconds_to_ns(100'000)};
  HangDetector detector_;
  RankSamples samples_;
  std::vector<HangFinding> findings_;
  std::set<int> frozen_;
  int tp_;
  int dp_;
};

std::set<int> as_set(const std::vector<int>& v) { return {v.begin(), v.end()}; }

std::set<int> without(std::set<int> ranks, int r) {
  ranks.erase(r);
  return ranks;
}

// The checks every hang finding must pass: found within one poll of its
// budget, or of the culprit's phase budget when that is longer, and so
// within one poll of the ceiling.
void check_timely(const HangFinding& f, double culprit_phase_budget_s = 0) {
  CAPTURE(f.reason);
  const double ceiling_s = test_config().hang_timeout_ceiling_s;
  CHECK(f.budget_s <= ceiling_s);
  CHECK(f.detect_s > f.budget_s);
  CHECK(f.detect_s <= std::max(f.budget_s, culprit_phase_budget_s) + kPollS + 1e-6);
  CHECK(f.detect_s <= ceiling_s + kPollS + 1e-6);
}

// One way to garble rank r's sample (its board is group slot 0 = its DP
// group, done with the collective begun last).
struct Garble {
  std::string name;
  std::function<void(RankSample&, int64_t now_ns)> garble;
};

// Garbage the detector must refuse to trust, one check each.
std::vector<Garble> untrusted_garbles() {
  const int64_t hour = common::seconds_to_ns(3600);
  auto dp = [](RankSample& s) -> GroupRecord& { return s.board->groups[0]; };
  return {
      {"wrong board version", [](RankSample& s, int64_t) { s.board->version = 1; }},
      {"rank of another board", [](RankSample& s, int64_t) { s.board->rank = 0; }},
      {"rank out of range", [](RankSample& s, int64_t) { s.board->rank = 7; }},
      {"phase out of range", [](RankSample& s, int64_t) { s.board->phase = 99; }},
      {"negative generation", [](RankSample& s, int64_t) { s.board->generation = -2; }},
      {"steps done before the first step", [](RankSample& s, int64_t) { s.board->first_step = 1'000'000; }},
      {"publish time zero", [](RankSample& s, int64_t) { s.board->update_ns = 0; }},
      {"phase start after publishing",
       [](RankSample& s, int64_t) { s.board->phase_start_ns = s.board->update_ns + 1; }},
      {"publish time in the future", [hour](RankSample& s, int64_t now) { s.board->update_ns = now + hour; }},
      {"heartbeat in the future", [hour](RankSample& s, int64_t now) { s.heartbeat_ns = now + hour; }},
      {"NaN phase duration",
       [](RankSample& s, int64_t) { s.board->phase_last_ms[1] = std::numeric_limits<float>::quiet_NaN(); }},
      {"negative phase duration", [](RankSample& s, int64_t) { s.board->phase_last_ms[2] = -5; }},
      {"group name without a NUL", [dp](RankSample& s, int64_t) { std::memset(dp(s).name, 'x', kGroupNameBytes); }},
      {"unprintable group name", [dp](RankSample& s, int64_t) { dp(s).name[1] = '\x01'; }},
      {"op without a NUL", [dp](RankSample& s, int64_t) { std::memset(dp(s).op, 'y', kOpNameBytes); }},
      {"the same group listed twice", [dp](RankSample& s, int64_t) { s.board->groups[3] = dp(s); }},
      {"group larger than the job", [dp](RankSample& s, int64_t) { dp(s).size = 1000; }},
      {"group of no rank", [dp](RankSample& s, int64_t) { dp(s).size = 0; }},
      {"negative index", [dp](RankSample& s, int64_t) { dp(s).index = -3; }},
      {"index beyond the group", [dp](RankSample& s, int64_t) { dp(s).index = dp(s).size; }},
      {"huge sequence number", [dp](RankSample& s, int64_t) { dp(s).seq_begun = dp(s).seq_done = int64_t{1} << 60; }},
      {"negative sequence number", [dp](RankSample& s, int64_t) { dp(s).seq_begun = dp(s).seq_done = -5; }},
      {"more done than begun", [dp](RankSample& s, int64_t) { dp(s).seq_done = dp(s).seq_begun + 1; }},
      {"state out of range", [dp](RankSample& s, int64_t) { dp(s).state = 17; }},
      {"state none after a collective", [dp](RankSample& s, int64_t) { dp(s).state = 0; }},
      {"in flight though done",
       [dp](RankSample& s, int64_t) { dp(s).state = static_cast<uint32_t>(CollectiveState::kInFlight); }},
      {"done though not ended", [dp](RankSample& s, int64_t) { dp(s).seq_done = dp(s).seq_begun - 1; }},
      {"begin time zero", [dp](RankSample& s, int64_t) { dp(s).begin_ns = 0; }},
      {"begin time in the future", [dp, hour](RankSample& s, int64_t now) { dp(s).begin_ns = now + hour; }},
      {"done time in the future", [dp, hour](RankSample& s, int64_t now) { dp(s).done_ns = now + hour; }},
  };
}

// Garbage that passes every check, and still must not name anybody alone.
std::vector<Garble> plausible_garbles() {
  auto claim = [](RankSample& s, int64_t seq) {
    GroupRecord& g = s.board->groups[0];
    g.seq_begun = seq;
    g.state = static_cast<uint32_t>(CollectiveState::kInFlight);
    g.begin_ns = 1;
  };
  return {
      {"a stale in-flight claim", [claim](RankSample& s, int64_t) { claim(s, s.board->groups[0].seq_done + 1); }},
      {"a claim far ahead of the group",
       [claim](RankSample& s, int64_t) { claim(s, s.board->groups[0].seq_done + 5000); }},
      {"phase start long ago", [](RankSample& s, int64_t) { s.board->phase_start_ns = 1; }},
      {"index another member holds", [](RankSample& s, int64_t) { s.board->groups[0].index = 0; }},
      {"heartbeat never beaten", [](RankSample& s, int64_t) { s.heartbeat_ns = 0; }},
      {"heartbeat long ago", [](RankSample& s, int64_t) { s.heartbeat_ns = 1; }},
  };
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("the kind of a group is its mesh axis") {
    struct Case {
      std::string name;
      const char* kind;
    };
    const Case cases[] = {
        {"g0.dp.0", "dp"}, {"g3.tp.12", "tp"},       {"g10.expert_dp.12", "expert_dp"},
        {"dp", "dp"},      {"g3.tp", "tp"},          {"gx.dp.0", "gx.dp"},
        {"g1..2", "g1..2"}, {"g1.dp_cp.x", "dp_cp.x"}, {"", ""},
    };
    for (const Case& c : cases) {
      INFO(c.name);
      CHECK(group_kind(c.name) == c.kind);
    }
  }

  TEST_CASE("a rank that never begins the collective is named with the waiting ranks group seq and op") {
    struct Case {
      std::string name;
      int dp;
      int tp;
      const char* kind;
      int culprit;
      const char* op;
    };
    const Case cases[] = {
        {"dp all-reduce in a 2x2 mesh", 2, 2, "dp", 3, "all_reduce"},
        {"tp all-reduce in a 2x2 mesh", 2, 2, "tp", 0, "all_reduce"},
        {"dp broadcast among 4 replicas", 4, 1, "dp", 2, "broadcast"},
        {"dp reduce-scatter among 2 replicas", 2, 1, "dp", 0, "reduce_scatter"},
        {"tp all-gather among 4 tensor ranks", 1, 4, "tp", 3, "all_gather"},
    };
    for (const Case& c : cases) {
      INFO(c.name);
      SyntheticJob job(c.dp, c.tp);
      job.warm_up();
      const std::string kind = c.kind;
      // The culprit stops before its collective of `kind` (the injected
      // hang); every other rank reaches it.
      const Phase before = kind == "tp" ? Phase::kForward : Phase::kBackward;
      job.phase_for(job.all(), before, 0.1);
      const std::set<int> stuck = job.members(c.culprit, kind);
      const std::set<int> others = [&] {
        std::set<int> o;
        for (int r : job.all()) {
          if (stuck.count(r) == 0) o.insert(r);
        }
        return o;
      }();
      if (!others.empty()) job.collective(others, kind, 0.02, c.op);
      const int64_t seq = job.group(c.culprit, kind).seq_begun + 1;
      for (int r : without(stuck, c.culprit)) job.begin(r, kind, c.op);
      job.poll();
      const double budget = job.detector().group_budget_s(kind);
      CHECK(budget == doctest::Approx(1.0));  // learned, clamped to the floor
      job.wait_for_finding(30);
      REQUIRE(job.findings().size() == 1);
      const HangFinding& f = job.findings()[0];
      CHECK(f.culprit_ranks == std::vector<int>{c.culprit});
      CHECK(as_set(f.waiting_ranks) == without(stuck, c.culprit));
      CHECK(f.frozen_ranks.empty());
      CHECK(f.group == job.group_name_of(c.culprit, kind));
      CHECK(f.seq == seq);
      CHECK(f.op == c.op);
      CHECK(f.budget_s == doctest::Approx(budget));
      CHECK(f.reason.find(fmt::format("rank {} never began it", c.culprit)) != std::string::npos);
      check_timely(f);
    }
  }

  TEST_CASE("a rank that waits in another hung collective is not blamed for the one it has not begun") {
    // Rank 3 stops before the DP all-reduce. Rank 1 waits for it there,
    // rank 0 then waits for rank 1 in the next step's TP all-reduce, and
    // rank 2 for rank 3 in its TP all-reduce: every finding names rank 3.
    SyntheticJob job(2, 2);
    job.warm_up();
    job.phase_for(job.all(), Phase::kBackward, 0.1);
    job.collective({0, 2}, "dp", 0.02);
    job.begin(1, "dp");
    job.phase_for({0, 2}, Phase::kOptimizer, 0.1);
    job.phase_for({0, 2}, Phase::kForward, 0.1);
    job.begin(0, "tp");
    job.begin(2, "tp");
    job.wait(10);
    REQUIRE(job.findings().size() == 3);
    std::set<std::string> groups;
    for (const HangFinding& f : job.findings()) {
      CAPTURE(f.reason);
      groups.insert(f.group);
      CHECK(f.culprit_ranks == std::vector<int>{3});
      check_timely(f);
    }
    CHECK(groups == std::set<std::string>{"g0.dp.1", "g0.tp.0", "g0.tp.1"});
    for (const HangFinding& f : job.findings()) {
      if (f.group != "g0.tp.0") continue;
      CHECK(f.waiting_ranks == std::vector<int>{0});
      CHECK(f.reason.find("rank 1 waits in g0.dp.1") != std::string::npos);
    }
  }

  TEST_CASE("a frozen rank is named whether or not it began the collective") {
    struct Case {
      std::string name;
      bool began;
    };
    // Stopped before it, the rank sits in a phase never seen (its budget
    // the ceiling): its stale heartbeat names it, not the phase budget.
    const Case cases[] = {{"stopped inside the collective", true}, {"stopped in a checkpoint before it", false}};
    for (const Case& c : cases) {
      INFO(c.name);
      SyntheticJob job(4, 1);
      job.warm_up();
      job.phase_for(job.all(), Phase::kBackward, 0.1);
      const int culprit = 2;
      for (int r : job.all()) {
        if (r != culprit || c.began) job.begin(r, "dp");
      }
      if (!c.began) job.set_phase(culprit, Phase::kCheckpoint);
      job.freeze(culprit);
      job.wait_for_finding(30);
      REQUIRE(job.findings().size() == 1);
      const HangFinding& f = job.findings()[0];
      CAPTURE(f.reason);
      CHECK(f.culprit_ranks == std::vector<int>{culprit});
      CHECK(f.frozen_ranks == std::vector<int>{culprit});
      CHECK(f.waiting_ranks == std::vector<int>{0, 1, 3});
      CHECK(f.reason.find("rank 2 is frozen") != std::string::npos);
      // Frozen is told after heartbeat_timeout_s, longer than the budget here.
      CHECK(f.detect_s > 2);
      CHECK(f.detect_s <= 2 + kPollS + 1e-6);
    }
  }

  TEST_CASE("a collective every member began names nobody once the heartbeat timeout has passed too") {
    SyntheticJob job(2, 1);
    job.warm_up();
    job.begin(0, "dp");
    job.begin(1, "dp");
    job.wait_for_finding(30);
    REQUIRE(job.findings().size() == 1);
    const HangFinding& f = job.findings()[0];
    CHECK(f.culprit_ranks.empty());
    CHECK(f.waiting_ranks == std::vector<int>{0, 1});
    CHECK(f.reason.find("the boards name nobody") != std::string::npos);
    CHECK(f.detect_s > 2);
    CHECK(f.detect_s <= 2 + kPollS + 1e-6);
  }

  TEST_CASE("a rank in a slow checkpoint validation or data load is no hang within the phase budget") {
    struct Case {
      std::string name;
      Phase phase;
      double steps;  // the phase's length in steps
      bool learned;  // the phase was seen this long after warm-up before
    };
    const Case cases[] = {
        {"checkpoint of 5 steps learned before", Phase::kCheckpoint, 5, true},
        {"validation of 10 steps learned before", Phase::kValidation, 10, true},
        {"data load of 5 steps learned before", Phase::kData, 5, true},
        {"checkpoint of 5 steps never seen", Phase::kCheckpoint, 5, false},
        {"validation of 10 steps never seen", Phase::kValidation, 10, false},
    };
    for (const Case& c : cases) {
      INFO(c.name);
      SyntheticJob job(2, 1);
      job.warm_up();
      const double length_s = c.steps * kStepS;
      if (c.learned) {
        // Both ranks went through the phase together, three times: nobody waited.
        for (int i = 0; i < 3; ++i) {
          job.phase_for(job.all(), c.phase, length_s);
          job.step();
        }
      }
      const double phase_budget = job.detector().phase_budget_s(c.phase);
      CHECK(phase_budget >= length_s);
      REQUIRE(job.detector().group_budget_s("dp") < length_s);  // rank 1 waits longer than any collective took

      job.phase_for(job.all(), Phase::kBackward, 0.1);
      job.set_phase(0, c.phase);
      job.begin(1, "dp");
      job.wait(length_s);
      CHECK(job.findings().empty());
      job.set_phase(0, Phase::kBackward);
      job.collective({0}, "dp", 0.02);
      job.end(1, "dp");
      job.step();
      CHECK(job.findings().empty());

      // The same phase outstaying its budget is a hang, named.
      job.phase_for(job.all(), Phase::kBackward, 0.1);
      job.set_phase(1, c.phase);
      job.begin(0, "dp");
      job.wait_for_finding(30);
      REQUIRE(job.findings().size() == 1);
      const HangFinding& f = job.findings()[0];
      CAPTURE(f.reason);
      CHECK(f.culprit_ranks == std::vector<int>{1});
      CHECK(f.reason.find(fmt::format("({} for", phase_name(static_cast<uint32_t>(c.phase)))) != std::string::npos);
      // Found when the phase, not only the wait, outlasts its budget.
      CHECK(f.detect_s > job.detector().phase_budget_s(c.phase));
      check_timely(f, job.detector().phase_budget_s(c.phase));
    }
  }

  TEST_CASE("during warm-up every budget is the ceiling") {
    SyntheticJob job(2, 1);
    for (int s = 0; s < 2; ++s) job.step();
    CHECK_FALSE(job.detector().warmed_up());
    CHECK(job.detector().group_budget_s("dp") == 20);
    CHECK(job.detector().phase_budget_s(Phase::kBackward) == 20);
    job.phase_for(job.all(), Phase::kBackward, 0.1);
    job.begin(0, "dp");
    job.wait(19.5);
    CHECK(job.findings().empty());
    job.wait_for_finding(5);
    REQUIRE(job.findings().size() == 1);
    CHECK(job.findings()[0].culprit_ranks == std::vector<int>{1});
    CHECK(job.findings()[0].budget_s == 20);
    check_timely(job.findings()[0]);
  }

  TEST_CASE("learned budgets are clamped to the floor and the ceiling") {
    struct Case {
      std::string name;
      double collective_s;  // how long every DP all-reduce takes
      double budget_s;
    };
    const Case cases[] = {
        {"fast collectives get the floor", 0.01, 1},
        {"between floor and ceiling the budget is 5 times the longest", 0.3, 1.5},
        {"slow collectives get the ceiling", 5, 20},
    };
    for (const Case& c : cases) {
      INFO(c.name);
      SyntheticJob job(2, 1);
      for (int s = 0; s < 12; ++s) {
        job.phase_for(job.all(), Phase::kBackward, 0.1);
        job.collective(job.all(), "dp", c.collective_s);
        job.phase_for(job.all(), Phase::kOptimizer, 0.1);
        for (int r : job.all()) job.finish_step(r);
      }
      REQUIRE(job.detector().warmed_up());
      CHECK(job.detector().group_budget_s("dp") == doctest::Approx(c.budget_s));
      CHECK(job.detector().group_budget_s("tp") == 20);  // never seen
      CHECK(job.detector().phase_budget_s(Phase::kOptimizer) == doctest::Approx(1));
      CHECK(job.detector().phase_budget_s(Phase::kCheckpoint) == 20);  // never seen
      const auto budgets = job.detector().budgets_json();
      CHECK(budgets["warmed_up"] == true);
      CHECK(budgets["groups"]["dp"].get<double>() == doctest::Approx(c.budget_s));
      CHECK(budgets["phases"]["checkpoint"].get<double>() == 20);
      CHECK(budgets["phases"].size() == kPhaseCount);
    }
  }

  TEST_CASE("a new generation warms up again and keeps what was learned") {
    SyntheticJob job(2, 1);
    job.warm_up();
    CHECK(job.detector().group_budget_s("dp") == doctest::Approx(1));
    for (int r : job.all()) {
      job.board(r).generation = 1;
      job.board(r).first_step = job.board(r).steps_done;
    }
    job.poll();
    CHECK_FALSE(job.detector().warmed_up());
    CHECK(job.detector().group_budget_s("dp") == 20);
    job.warm_up();
    CHECK(job.detector().group_budget_s("dp") == doctest::Approx(1));
  }

  TEST_CASE("a forward clock jump fires no timeout by itself") {
    SyntheticJob job(2, 2);
    job.warm_up();
    // Every rank in flight in a healthy collective, then the whole machine
    // pauses for an hour: no heartbeat and no end in between.
    job.phase_for(job.all(), Phase::kBackward, 0.1);
    for (int r : job.all()) job.begin(r, "dp");
    job.poll();
    job.clock().advance_s(3600);
    CHECK(job.poll().empty());
    job.advance(0.1);
    for (int r : job.all()) job.end(r, "dp");
    job.poll();
    for (int s = 0; s < 5; ++s) job.step();
    CHECK(job.findings().empty());

    // A real hang across a jump is still found, after its budget of
    // watched time rather than at the jump.
    job.phase_for(job.all(), Phase::kBackward, 0.1);
    job.collective({0, 2}, "dp", 0.02);
    job.begin(1, "dp");
    job.wait(0.5);
    job.advance(3600);
    CHECK(job.poll().empty());
    job.wait_for_finding(30);
    REQUIRE(job.findings().size() == 1);
    CHECK(job.findings()[0].culprit_ranks == std::vector<int>{3});
    // What was learned across the jump counts only its watched time.
    CHECK(job.detector().group_budget_s("dp") < 2);
    CHECK(job.detector().phase_budget_s(Phase::kBackward) < 3);
    check_timely(job.findings()[0], job.detector().phase_budget_s(Phase::kBackward));
  }

  TEST_CASE("a backward clock jump learns no negative duration and names nobody") {
    // Half a second back keeps the boards trusted (a collective then ends
    // before it began); an hour back puts them in the future.
    for (const double back_s : {0.5, 3600.0}) {
      CAPTURE(back_s);
      SyntheticJob job(2, 1);
      job.warm_up();
      job.phase_for(job.all(), Phase::kBackward, 0.1);
      job.begin(0, "dp");
      job.begin(1, "dp");
      job.poll();
      job.clock().advance_s(-back_s);
      job.advance(0.1);
      job.end(0, "dp");
      job.end(1, "dp");
      for (int r : job.all()) job.set_phase(r, Phase::kIdle);
      for (int i = 0; i < 40; ++i) {
        job.advance(kPollS);
        CHECK(job.poll().empty());
      }
      CHECK(job.detector().group_budget_s("dp") == doctest::Approx(1));
      // Boards written after the jump are trusted, and a hang is found.
      for (int s = 0; s < 3; ++s) job.step();
      job.phase_for(job.all(), Phase::kBackward, 0.1);
      job.begin(1, "dp");
      job.wait_for_finding(30);
      REQUIRE(job.findings().size() == 1);
      CHECK(job.findings()[0].culprit_ranks == std::vector<int>{0});
      check_timely(job.findings()[0]);
    }
    common::logger("hang")->set_level(spdlog::level::info);
  }

  TEST_CASE("a missing member is named with the reason it is missing unless its board is garbage or its node unheard of") {
    struct Case {
      std::string name;
      std::function<void(SyntheticJob&)> make_missing;  // rank 1 of 2
      std::string clause;
      std::vector<int> culprits;
    };
    std::vector<Case> cases = {
        {"never published its board", [](SyntheticJob& job) { job.sample(1).board.reset(); },
         "rank 1 never published its board", {1}},
        {"published but never joined the group",
         [](SyntheticJob& job) {
           job.board(1).groups[0] = GroupRecord{};
           job.set_phase(1, Phase::kInit);
         },
         "rank 1 never joined g0.dp.0 (init for", {1}},
        {"exited", [](SyntheticJob& job) { job.sample(1).running = false; }, "rank 1 exited", {1}},
        {"frozen", [](SyntheticJob& job) { job.freeze(1); }, "rank 1 is frozen", {1}},
        {"stuck in a phase", [](SyntheticJob&) {}, "rank 1 never began it (backward for", {1}},
    };
    // A rank on another node that keeld has not heard from lately may be
    // the one everybody waits for too, and is no more named than garbage.
    cases.push_back({"on a node not heard from",
                     [](SyntheticJob& job) {
                       job.corrupt = [](RankSamples& samples) {
                         samples[1].board.reset();
                         samples[1].known = false;
                       };
                     },
                     "rank 1's node has not been heard from, so the boards name nobody",
                     {}});
    // A board that is not trusted may be the one everybody waits for: past
    // the ceiling the hang is reported, naming nobody.
    for (const Garble& g : untrusted_garbles()) {
      cases.push_back({"garbage: " + g.name,
                       [g](SyntheticJob& job) {
                         job.corrupt = [&job, g](RankSamples& samples) { g.garble(samples[1], job.clock().now_ns()); };
                       },
                       "rank 1's board is not trusted, so the boards name nobody",
                       {}});
    }
    common::logger("hang")->set_level(spdlog::level::err);
    for (const Case& c : cases) {
      INFO(c.name);
      SyntheticJob job(2, 1);
      job.step();
      job.phase_for(job.all(), Phase::kBackward, 0.1);
      c.make_missing(job);
      job.begin(0, "dp");
      // Not warmed up: the ceiling is the budget, and nothing is said before it.
      job.wait(19.75);
      CHECK(job.findings().empty());
      job.wait_for_finding(5);
      REQUIRE(job.findings().size() == 1);
      const HangFinding& f = job.findings()[0];
      CAPTURE(f.reason);
      CHECK(f.culprit_ranks == c.culprits);
      CHECK(f.waiting_ranks == std::vector<int>{0});
      CHECK(f.reason.find(c.clause) != std::string::npos);
      check_timely(f);
    }
    common::logger("hang")->set_level(spdlog::level::info);
  }

  TEST_CASE("a finding is made once per group and sequence number") {
    SyntheticJob job(2, 1);
    job.warm_up();
    job.phase_for(job.all(), Phase::kBackward, 0.1);
    job.begin(0, "dp");
    job.wait(30);
    REQUIRE(job.findings().size() == 1);
    const int64_t seq = job.findings()[0].seq;
    // It resolves (a long stall, not a hang after all), and hangs again.
    job.begin(1, "dp");
    job.end(0, "dp");
    job.end(1, "dp");
    job.step();
    job.phase_for(job.all(), Phase::kBackward, 0.1);
    job.begin(0, "dp");
    job.wait(30);
    REQUIRE(job.findings().size() == 2);
    CHECK(job.findings()[1].seq > seq);
    CHECK(job.findings()[1].group == job.findings()[0].group);
  }

  TEST_CASE("a garbage field on one board names nobody") {
    common::logger("hang")->set_level(spdlog::level::err);
    std::vector<Garble> cases = untrusted_garbles();
    const std::vector<Garble> plausible = plausible_garbles();
    cases.insert(cases.end(), plausible.begin(), plausible.end());
    for (const Garble& c : cases) {
      INFO(c.name);
      SyntheticJob job(4, 1);
      job.corrupt = [&](RankSamples& samples) { c.garble(samples[1], job.clock().now_ns()); };
      // Through warm-up and well past the ceiling, the job healthy.
      for (int s = 0; s < 80; ++s) job.step();
      CHECK(job.findings().empty());
      CHECK(job.detector().group_budget_s("dp") == doctest::Approx(1));
    }
    common::logger("hang")->set_level(spdlog::level::info);
  }

  TEST_CASE("a member that disagrees about the size of its group names nobody beside it") {
    // Rank 2 never published. Rank 0's board claims tp.0 has three members
    // and a wait since long ago: believed, the slot nobody claims would be
    // rank 2's and name it, though rank 2 is no member of tp.0.
    SyntheticJob job(2, 2);
    job.sample(2).board.reset();
    job.corrupt = [](RankSamples& samples) {
      GroupRecord& tp = *std::find_if(std::begin(samples[0].board->groups), std::end(samples[0].board->groups),
                                      [](const GroupRecord& g) { return group_name(g) == "g0.tp.0"; });
      tp.size = 3;
      tp.begin_ns = 1;
    };
    for (int i = 0; i < 30; ++i) {
      job.phase_for({0, 1, 3}, Phase::kForward, 0.1);
      job.collective({0, 1}, "tp", 1);
    }
    CHECK(job.findings().empty());
  }

  TEST_CASE("a garbage board beside a hang changes nothing of the verdict") {
    common::logger("hang")->set_level(spdlog::level::err);
    SyntheticJob job(2, 2);
    job.warm_up();
    std::mt19937_64 random(7);
    job.corrupt = [&](RankSamples& samples) {
      auto* bytes = reinterpret_cast<unsigned char*>(&*samples[0].board);
      for (size_t i = 0; i < sizeof(BoardSnapshot); ++i) bytes[i] = static_cast<unsigned char>(random());
    };
    job.phase_for(job.all(), Phase::kBackward, 0.1);
    job.collective({0, 2}, "dp", 0.02);
    job.begin(1, "dp");
    job.wait_for_finding(30);
    REQUIRE(job.findings().size() == 1);
    CHECK(job.findings()[0].culprit_ranks == std::vector<int>{3});
    CHECK(job.findings()[0].group == "g0.dp.1");
    check_timely(job.findings()[0]);
    common::logger("hang")->set_level(spdlog::level::info);
  }

  TEST_CASE("random bytes in boards never crash the detector nor name a rank") {
    enum class Garble { kAll, kAllButHeader, kSpan };
    struct Case {
      std::string name;
      Garble how;
    };
    const Case cases[] = {
        {"every byte random", Garble::kAll},
        {"random bytes after a right version and rank", Garble::kAllButHeader},
        {"a random span over a good board", Garble::kSpan},
    };
    common::logger("hang")->set_level(spdlog::level::off);
    for (const Case& c : cases) {
      INFO(c.name);
      SyntheticJob job(2, 2);
      std::mt19937_64 random(20261123);
      job.corrupt = [&](RankSamples& samples) {
        for (RankSample& s : samples) {
          if (random() % 2 == 0) continue;
          auto* bytes = reinterpret_cast<unsigned char*>(&*s.board);
          size_t from = 0, to = sizeof(BoardSnapshot);
          if (c.how == Garble::kAllButHeader) from = offsetof(BoardSnapshot, pid);
          if (c.how == Garble::kSpan) {
            from = random() % sizeof(BoardSnapshot);
            to = std::min(sizeof(BoardSnapshot), from + 1 + random() % 64);
          }
          for (size_t i = from; i < to; ++i) bytes[i] = static_cast<unsigned char>(random());
          if (random() % 4 == 0) s.heartbeat_ns = static_cast<int64_t>(random());
        }
      };
      for (int s = 0; s < 60; ++s) job.step();
      CHECK(job.findings().empty());
    }
    common::logger("hang")->set_level(spdlog::level::info);
  }

  TEST_CASE("a hang finding carries the fields of the hang_detected event") {
    HangFinding f;
    f.culprit_ranks = {3};
    f.waiting_ranks = {1};
    f.frozen_ranks = {};
    f.group = "g0.dp.1";
    f.seq = 57;
    f.op = "all_reduce";
    f.detect_s = 31.5;
    f.budget_s = 30;
    f.reason = "rank 1 waited";
    const nlohmann::json j = f.to_json();
    CHECK(j == nlohmann::json{{"culprit_ranks", {3}},
                              {"group", "g0.dp.1"},
                              {"seq", 57},
                              {"op", "all_reduce"},
                              {"waiting_ranks", {1}},
                              {"frozen_ranks", nlohmann::json::array()},
                              {"detect_s", 31.5},
                              {"budget_s", 30.0},
                              {"reason", "rank 1 waited"}});
  }
}

}  // namespace keel::health
