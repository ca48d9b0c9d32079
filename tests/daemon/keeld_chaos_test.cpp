// Chaos and trials against a real keeld (docs/architecture.md "Health"):
// faults injected at random into running jobs, as an operator's game day
// would, and the detectors held to their rates over many trials. Every run
// must end with the final model of the fault-free run whenever no corrupted
// update was applied, and says what it cost (goodput: useful tokens per
// wall second against the fault-free run, printed as JSON).
//
// The short chaos run is in the default suite; the long one and the trials
// carry the label chaos.
#include "bench/goodput_model.h"
#include "common/clock.h"
#include "tests/daemon/health_job.h"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace keel::test {
namespace {

using keel::common::seconds_since;

// Three replicas (so a flipped bit is named by the digests), digests every
// 5 steps, every checkpoint kept (a rollback may go back past `keep`), and
// a model big enough (tens of ms a step) that keeld's status, read every
// 200 ms, sees a generation's steps go by and a fault lands mid-run.
std::vector<std::string> chaos_layout(int64_t steps) {
  return with(with(kFastHealth, kThreeReplicas),
              {fmt::format("train.steps={}", steps), "checkpoint.keep=100", "health.sdc_digest_every=5",
               "health.sdc_policy=restart", "model.n_layer=4", "model.n_embd=128", "model.seq_len=64"});
}

struct ChaosResult {
  std::map<std::string, int> injected;  // per kind
  double wall_s = 0;
  // Per fault that ended its generation: from the injection until the next
  // generation is back at the step the fault found (detection, restart
  // and the steps trained again).
  std::vector<double> failure_cost_s;
};

// Runs `layout` under keeld and injects `kinds` in order, each at a random
// live rank once its generation has committed a checkpoint, waiting for the
// generation a fault ends before the next. A crash, hang or bit flip ends
// its generation (the flip at the next replica digest); a slow rank does
// not.
ChaosResult run_chaos(const KeeldJob& job, const std::vector<std::string>& layout, int64_t steps,
                      const std::vector<std::string>& kinds, std::mt19937& rng) {
  ChaosResult out;
  const auto start = std::chrono::steady_clock::now();
  auto keeld = job.start(layout);
  int64_t generation = 0;
  for (const auto& kind : kinds) {
    const auto running = job.wait_for(
        [&](const nlohmann::json& s) { return s.at("state") == "running" && s.at("generation") == generation; }, 300);
    const int64_t from = step_of(running);
    // Past a checkpoint of this generation's own: generations that end
    // without one are a crash loop, which keeld rightly gives up on.
    const auto status = job.wait_for(
        [&](const nlohmann::json& s) {
          return s.at("generation") != generation ||
                 (s.at("state") == "running" && s.at("checkpoint_step").get<int64_t>() > from);
        },
        300);
    REQUIRE_MESSAGE(status.at("generation") == generation, "generation " << generation << " ended by itself");
    // Room for the fault to land and, for a flip, for the digest to see it.
    REQUIRE_MESSAGE(step_of(status) + 15 < steps, "the run is too short for the next fault");
    const int rank = std::uniform_int_distribution<int>(0, 2)(rng);
    std::vector<std::string> args = {"inject", kind, "--rank", std::to_string(rank)};
    if (kind == "slow") args = with(args, {"--factor", "1.5"});
    const auto injected = keelctl(job, args);
    INFO(kind << " at rank " << rank << ": " << injected.output);
    REQUIRE(injected.exit_code == 0);
    const auto injected_at = std::chrono::steady_clock::now();
    out.injected[kind] += 1;
    if (kind == "slow") continue;
    ++generation;
    job.wait_for(
        [&](const nlohmann::json& s) {
          return s.at("generation").get<int64_t>() > generation ||
                 (s.at("generation") == generation && s.at("state") == "running" && step_of(s) >= step_of(status));
        },
        300);
    out.failure_cost_s.push_back(seconds_since(injected_at));
  }
  const auto result = keeld->wait(600);
  out.wall_s = seconds_since(start);
  INFO(result.output);
  REQUIRE(result.exit_code == 0);
  return out;
}

// Checks that each fault did what it should and prints the figures.
void check_and_report(const char* name, const KeeldJob& job, const ChaosResult& chaos, int64_t steps,
                      double reference_wall_s) {
  const int crashes = chaos.injected.count("crash") ? chaos.injected.at("crash") : 0;
  const int hangs = chaos.injected.count("hang") ? chaos.injected.at("hang") : 0;
  const int flips = chaos.injected.count("bitflip") ? chaos.injected.at("bitflip") : 0;
  CHECK(job.events_of("rank_failed").size() == static_cast<size_t>(crashes));
  CHECK(job.events_of("hang_detected").size() >= static_cast<size_t>(hangs));
  const auto sdc = job.events_of("sdc_detected");
  CHECK(sdc.size() == static_cast<size_t>(flips));
  for (const auto& e : sdc) CHECK(e.at("method") == "replica_digest");
  CHECK(job.events_of("generation_started").size() == static_cast<size_t>(1 + crashes + hangs + flips));
  CHECK(job.events_of("job_finished").size() == 1);
  const nlohmann::json figures = {
      {"chaos", name},
      {"steps", steps},
      {"faults", chaos.injected},
      {"generations", job.events_of("generation_started").size()},
      {"wall_s", chaos.wall_s},
      {"fault_free_wall_s", reference_wall_s},
      // Useful tokens are the same in both runs: the ratio of tokens per
      // wall second is the ratio of wall times.
      {"goodput", reference_wall_s / chaos.wall_s},
      // keel-bench-goodput's model at this run's failure rate and measured
      // cost per failure (bench/README.md "keel-bench-goodput").
      {"failure_cost_s", chaos.failure_cost_s},
      {"projected_goodput",
       bench::kept_share(0, static_cast<double>(chaos.failure_cost_s.size()) / chaos.wall_s,
                         chaos.failure_cost_s.empty()
                             ? 0.0
                             : std::accumulate(chaos.failure_cost_s.begin(), chaos.failure_cost_s.end(), 0.0) /
                                   static_cast<double>(chaos.failure_cost_s.size()))}};
  std::cout << figures.dump() << std::endl;
}

// A fault-free run and a chaos run of `steps` with the faults `pick`
// draws, the final models held equal and the figures printed.
void chaos_case(const char* name, int64_t steps,
                const std::function<std::vector<std::string>(std::mt19937&)>& pick) {
  const unsigned seed = std::random_device()();
  INFO("random seed " << seed);
  std::mt19937 rng(seed);
  KeeldJob reference;
  const auto start = std::chrono::steady_clock::now();
  reference.run(chaos_layout(steps));
  const double reference_wall_s = seconds_since(start);

  KeeldJob job;
  const auto chaos = run_chaos(job, chaos_layout(steps), steps, pick(rng), rng);
  check_and_report(name, job, chaos, steps, reference_wall_s);
  require_identical(job.checkpoint_tensors(steps), reference.checkpoint_tensors(steps));
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("a short run survives a crash a hang a bit flip and a slow rank injected at random and ends with the fault-free model") {
    chaos_case("short", 120, [](std::mt19937& rng) {
      std::vector<std::string> kinds = {"crash", "hang", "bitflip", "slow"};
      std::shuffle(kinds.begin(), kinds.end(), rng);
      return kinds;
    });
  }
}

TEST_SUITE("chaos") {
  TEST_CASE("a long run survives a random mix of sixteen crashes hangs bit flips and slow ranks and ends with the fault-free model") {
    chaos_case("long", 400, [](std::mt19937& rng) {
      const std::vector<std::string> all = {"crash", "hang", "bitflip", "slow"};
      std::vector<std::string> kinds;
      for (int i = 0; i < 16; ++i) kinds.push_back(all[std::uniform_int_distribution<size_t>(0, all.size() - 1)(rng)]);
      return kinds;
    });
  }

  TEST_CASE("hangs injected at random ranks steps and groups are named in twenty of twenty trials") {
    const unsigned seed = std::random_device()();
    INFO("random seed " << seed);
    std::mt19937 rng(seed);
    KeeldJob reference;
    reference.run(kFastHealth);
    const auto expected = reference.checkpoint_tensors(40);
    int named = 0;
    double slowest_s = 0;
    for (int trial = 0; trial < 20; ++trial) {
      const int rank = std::uniform_int_distribution<int>(0, 3)(rng);
      const int64_t step = std::uniform_int_distribution<int64_t>(1, 35)(rng);
      const std::string group = std::uniform_int_distribution<int>(0, 1)(rng) == 0 ? "dp" : "tp";
      INFO("trial " << trial << ": rank " << rank << " hangs at step " << step << " in " << group);
      KeeldJob job;
      job.run(with(kFastHealth, {fmt::format("faults.hang_rank={}", rank), fmt::format("faults.hang_step={}", step),
                                 "faults.hang_group=" + group}));
      const auto hangs = job.events_of("hang_detected");
      bool ok = !hangs.empty();
      for (const auto& hang : hangs) {
        INFO(hang.dump());
        ok = ok && hang.at("culprit_ranks") == nlohmann::json::array({rank});
        slowest_s = std::max(slowest_s, hang.at("detect_s").get<double>());
      }
      CHECK(ok);
      require_identical(job.checkpoint_tensors(40), expected);
      named += ok ? 1 : 0;
    }
    std::cout << nlohmann::json{{"trials", "hang"}, {"named", named}, {"of", 20}, {"slowest_detect_s", slowest_s},
                                {"ceiling_s", kCeilingS}}
                     .dump()
              << std::endl;
    CHECK(named == 20);
    CHECK(slowest_s <= kCeilingS + 2);
  }

  TEST_CASE("bit flips in parameters and moments at random ranks and steps are attributed and rolled back") {
    // Digests every step, so that attribution within 2 steps is the
    // digests' doing, not their interval's, and steps of tens of ms, so
    // that a board's ring of digests outlasts keeld's poll interval. Three replicas name the rank;
    // two only see that they differ, and the rollback must still hold.
    // ZeRO-3 keeps no replica: nothing but the rerun (on a loss or norm
    // anomaly) can see a silent flip there, and the rate is only measured.
    struct Layout {
      const char* name;
      std::vector<std::string> sets;
      int ranks;
      bool covered;  // whether every flip must be found and rolled back
    };
    const std::vector<Layout> layouts = {
        {"3 replicas", kThreeReplicas, 3, true},
        {"2 replicas", {"parallel.dp=2", "parallel.tp=1", "parallel.zero=0", "train.batch_size=6"}, 2, true},
        {"ZeRO-3, no replicas", {"parallel.dp=3", "parallel.tp=1", "parallel.zero=3", "train.batch_size=6"}, 3, false},
    };
    const unsigned seed = std::random_device()();
    INFO("random seed " << seed);
    std::mt19937 rng(seed);
    const std::vector<std::string> targets = {"param", "exp_avg", "exp_avg_sq"};
    for (const auto& layout : layouts) {
      const auto sets = with(with(kFastHealth, layout.sets),
                             {"health.sdc_digest_every=1", "health.sdc_policy=restart", "checkpoint.keep=100",
                              "model.n_layer=4", "model.n_embd=128", "model.seq_len=64"});
      KeeldJob reference;
      reference.run(sets);
      const auto expected = reference.checkpoint_tensors(40);
      int attributed = 0, detected = 0, identical = 0;
      for (int trial = 0; trial < 30; ++trial) {
        const int rank = std::uniform_int_distribution<int>(0, layout.ranks - 1)(rng);
        const int64_t step = std::uniform_int_distribution<int64_t>(2, 35)(rng);
        const std::string target = targets[std::uniform_int_distribution<size_t>(0, targets.size() - 1)(rng)];
        const int bit = std::uniform_int_distribution<int>(0, 22)(rng);  // mantissa: silent
        INFO(std::string(layout.name) << " trial " << trial << ": bit " << bit << " of " << target << " on rank " << rank
                         << " after step " << step);
        KeeldJob job;
        job.run(with(sets, {fmt::format("faults.bitflip_rank={}", rank), fmt::format("faults.bitflip_step={}", step),
                            "faults.bitflip_target=" + target, fmt::format("faults.bitflip_bit={}", bit)}));
        const auto found = job.events_of("sdc_detected");
        // The flip lands after step `step`'s update: steps done step + 1.
        const bool in_time = !found.empty() && found[0].at("step").get<int64_t>() <= step + 1 + 2;
        detected += in_time ? 1 : 0;
        attributed += in_time && found[0].at("rank") == rank ? 1 : 0;
        const auto final_state = job.checkpoint_tensors(40);
        const bool same = final_state == expected;
        identical += same ? 1 : 0;
        if (layout.covered) CHECK(same);
      }
      std::cout << nlohmann::json{{"trials", "bitflip persistent"}, {"layout", layout.name}, {"of", 30},
                                  {"detected_within_2_steps", detected}, {"attributed_within_2_steps", attributed},
                                  {"final_model_identical", identical}}
                       .dump()
                << std::endl;
      if (layout.covered && layout.ranks >= 3) CHECK(attributed * 100 >= 95 * 30);
      if (layout.covered) CHECK(detected * 100 >= 95 * 30);
    }
  }

  TEST_CASE("a rank slowed by a tenth is flagged within fifty steps in most of ten trials and no other rank ever") {
    const unsigned seed = std::random_device()();
    INFO("random seed " << seed);
    std::mt19937 rng(seed);
    int flagged = 0, within_50 = 0, others = 0;
    std::vector<int64_t> steps;
    for (int trial = 0; trial < 10; ++trial) {
      const int rank = std::uniform_int_distribution<int>(0, 3)(rng);
      INFO("trial " << trial << ": rank " << rank << " slowed by 1.10");
      KeeldJob job;
      job.run(with(kFourComputeRanks,
                   {"train.steps=200", fmt::format("faults.slow_rank={}", rank), "faults.slow_factor=1.1"}));
      bool first = true;
      for (const auto& f : job.events_of("straggler_flagged")) {
        if (f.at("rank") != rank) {
          ++others;
          continue;
        }
        if (!first) continue;
        first = false;
        ++flagged;
        steps.push_back(f.at("step").get<int64_t>());
        within_50 += steps.back() < 50 ? 1 : 0;
      }
    }
    std::cout << nlohmann::json{{"trials", "straggler 1.10x"}, {"of", 10},         {"flagged", flagged},
                                {"flagged_within_50_steps", within_50},            {"flag_steps", steps},
                                {"other_ranks_flagged", others}}
                     .dump()
              << std::endl;
    CHECK(flagged == 10);
    CHECK(others == 0);
    CHECK(within_50 >= 8);
  }

  TEST_CASE("a fault-free run of two thousand steps raises no hang no SDC and flags no straggler") {
    KeeldJob job;
    job.run(with(kFourComputeRanks, {"train.steps=2000", "checkpoint.every_steps=500", "health.sdc_digest_every=10"}));
    CHECK(job.events_of("hang_detected").empty());
    CHECK(job.events_of("sdc_detected").empty());
    CHECK(job.events_of("step_skipped").empty());
    CHECK(job.events_of("straggler_flagged").empty());
    CHECK(job.events_of("generation_started").size() == 1);
  }
}

}  // namespace keel::test
