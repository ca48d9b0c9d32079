// SdcGuard's rerun decisions on synthetic steps (docs/architecture.md
// "Health": SDC): which results are suspicious enough to compute again, and
// what a rerun's outcome records. One rank, no collectives: the guard's sum
// over the world is the identity.
#include "trainer/train/sdc_guard.h"
#include "common/error.h"
#include "tests/support/temp_dir.h"
#include "tests/trainer/trainer_runs.h"
#include "trainer/kernels/cpu_backend.h"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {

struct Guarded {
  keel::test::TempDir dir;
  keel::trainer::CpuBackend cpu{1};
  keel::health::BoardPublisher board;  // none
  std::unique_ptr<keel::trainer::SdcGuard> guard;

  // train.warmup_steps = 5 and a window of 40 steps, unless `sets` say otherwise.
  explicit Guarded(std::vector<std::string> sets = {}) {
    sets.insert(sets.begin(), "health.sdc_anomaly_window=40");
    sets.push_back("job.run_dir=" + (dir / "run").string());
    const auto config =
        keel::common::Config::parse("[data]\ntrain = \"x.bin\"\n[train]\nwarmup_steps = 5\n", "test", dir.path(), sets);
    guard = std::make_unique<keel::trainer::SdcGuard>(
        config, cpu, 0, 1, 0, board, [](float*, size_t) {});
  }
};

using keel::trainer::SdcGuard;
using keel::trainer::StepSignals;
using Outcome = SdcGuard::RerunOutcome;

// Steps of noisy training: the loss drifts down around 3, the norm
// wanders around 0.5 with a heavy right tail, the activations' squares
// grow slowly around 1e4 as the weights do.
std::vector<StepSignals> history(size_t n) {
  std::vector<StepSignals> steps;
  for (size_t i = 0; i < n; ++i) {
    const double wiggle = std::sin(static_cast<double>(i) * 1.7);
    steps.push_back({static_cast<float>(3.0 - 0.002 * i + 0.05 * wiggle), 0.5 * std::exp(0.3 * wiggle),
                     1e4 * (1 + 0.01 * i) * (1 + 0.05 * wiggle)});
  }
  return steps;
}

// Feeds history(n) as the steps from `first` on.
void feed(SdcGuard& guard, size_t n, int64_t first = 5) {
  int64_t step = first;
  for (const auto& signals : history(n)) guard.accept(step++, signals);
}

// An ordinary result after history(40).
StepSignals ordinary(float loss = 2.95f, double norm = 0.6, double activations = 1.4e4) {
  return {loss, norm, activations};
}

// A result that ran twice: `first`, then a rerun with `rerun`'s local share.
struct Attempts {
  double first_gradients = 1.0, rerun_gradients = 1.0;
};
void two_attempts(SdcGuard& guard, Attempts a = {}) {
  guard.begin_attempt();
  guard.add_local_loss(6.0);
  guard.add_local_gradients(a.first_gradients);
  guard.begin_attempt();
  guard.add_local_loss(6.0);
  guard.add_local_gradients(a.rerun_gradients);
}

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("a step is re-run when its loss or norm is non-finite or stands far above a full window after warm-up") {
    struct Row {
      const char* name;
      size_t steps;  // accepted before the candidate, one per step from `first`
      StepSignals result;
      bool rerun;
      std::vector<std::string> sets;
      int64_t first = 5;
    };
    const std::vector<Row> rows = {
        {"an ordinary step", 40, ordinary(), false, {}},
        {"the loss four times the median", 40, ordinary(12.0f), true, {}},
        {"the norm ten thousand times the median", 40, ordinary(2.9f, 5000.0), true, {}},
        {"the norm ten times the median, as training spikes", 40, ordinary(2.9f, 5.0), false, {}},
        {"a norm at the window's heavy tail", 40, ordinary(2.9f, 1.2), false, {}},
        {"activation squares 2^64 times the median (an exponent bit flipped)", 40, ordinary(2.9f, 0.5, 2.6e23),
         true, {}},
        {"infinite activation squares", 40, ordinary(2.9f, 0.5, kInf), true, {}},
        {"a sudden fall of the loss", 40, ordinary(0.5f), false, {}},
        {"a sudden fall of the norm", 40, ordinary(2.9f, 0.001), false, {}},
        {"a sudden fall of the activation squares", 40, ordinary(2.9f, 0.5, 10.0), false, {}},
        {"a NaN loss with an empty window", 0, ordinary(kNan), true, {}},
        {"an infinite norm", 40, ordinary(2.9f, kInf), true, {}},
        {"a spike before the window is full", 39, ordinary(12.0f, 50.0, 1e30), false, {}},
        {"a spike after steps that were all warm-up", 40, ordinary(12.0f, 50.0, 1e30), false, {}, 0},
        {"a spike after a smaller window filled", 8, ordinary(12.0f), true, {"health.sdc_anomaly_window=8"}},
        {"a NaN with health.sdc_rerun off", 40, ordinary(kNan), false, {"health.sdc_rerun=false"}},
        {"a spike below a higher health.sdc_anomaly_z", 40, ordinary(12.0f), false, {"health.sdc_anomaly_z=100"}},
        {"a spike of the norm above a lower health.sdc_anomaly_z", 40, ordinary(2.9f, 50.0), true,
         {"health.sdc_anomaly_z=8"}},
    };
    for (const Row& row : rows) {
      CAPTURE(row.name);
      auto sets = row.sets;
      // Warm-up covers every step fed from 0: 40 steps.
      if (row.first == 0) sets.push_back("train.warmup_steps=40");
      Guarded g(sets);
      feed(*g.guard, row.steps, row.first);
      CHECK(g.guard->assess(row.result).rerun == row.rerun);
    }
  }

  TEST_CASE("a step is scored only once the window is full and the score names the signal that stood out") {
    Guarded g;
    feed(*g.guard, 39);
    CHECK_FALSE(g.guard->assess(ordinary()).score.has_value());
    feed(*g.guard, 1, 44);
    const auto calm = g.guard->assess(ordinary());
    REQUIRE(calm.score.has_value());
    CHECK(*calm.score < 4);
    const auto spike = g.guard->assess(ordinary(2.9f, 5000.0));
    CHECK(spike.signal == "grad_norm");
    CHECK(*spike.score > 20);
    CHECK(spike.rerun);
    const auto nan = g.guard->assess(ordinary(2.9f, 0.5, kInf));
    CHECK(nan.signal == "activation_squares");
    CHECK_FALSE(nan.score.has_value());
  }

  TEST_CASE("a plateau of equal values calls only a large rise an anomaly") {
    Guarded g;
    for (int64_t step = 5; step < 45; ++step) g.guard->accept(step, {2.0f, 0.25, 100.0});
    CHECK_FALSE(g.guard->assess({2.1f, 0.25, 100.0}).rerun);
    CHECK_FALSE(g.guard->assess({2.0f, 0.3, 100.0}).rerun);
    CHECK_FALSE(g.guard->assess({2.0f, 0.25, 110.0}).rerun);
    CHECK_FALSE(g.guard->assess({4.0f, 0.25, 100.0}).rerun);  // twice the plateau
    CHECK(g.guard->assess({8.0f, 0.25, 100.0}).rerun);
    CHECK(g.guard->assess({2.0f, 1.0, 100.0}).rerun);
    CHECK(g.guard->assess({2.0f, 0.25, 400.0}).rerun);
  }

  TEST_CASE("a rerun with another result is a transient fault named on the rank whose fingerprint changed") {
    for (bool changed : {true, false}) {
      CAPTURE(changed);
      Guarded g;
      two_attempts(*g.guard, {changed ? 1e30 : 1.0, 1.0});
      CHECK(g.guard->judge_rerun(12, {30.0, "grad_norm", true}, {3.0f, 1e15, 7.0}, {3.0f, 0.5, 7.0}) ==
            Outcome::kTransient);
      const auto events = keel::test::events(g.dir / "run");
      REQUIRE(events.size() == 1);
      CHECK(events[0].at("kind") == "sdc_detected");
      CHECK(events[0].at("rank") == (changed ? 0 : -1));
      CHECK(events[0].at("step") == 12);
      CHECK(events[0].at("method") == "rerun");
      CHECK(events[0].at("verdict") == "transient");
      CHECK(events[0].at("grad_norm") == 1e15);
      CHECK(events[0].at("rerun_grad_norm") == 0.5);
    }
  }

  TEST_CASE("a rerun that differs only in its activation squares is a transient fault named on that rank") {
    // LayerNorm swallowed the corrupted activation: the loss and the norm
    // came out the same, the activations' squares did not.
    Guarded g;
    g.guard->begin_attempt();
    g.guard->add_local_loss(6.0);
    g.guard->add_local_gradients(1.0);
    g.guard->add_local_activations(1e76);
    g.guard->begin_attempt();
    g.guard->add_local_loss(6.0);
    g.guard->add_local_gradients(1.0);
    g.guard->add_local_activations(5e3);
    CHECK(g.guard->local_activation_squares() == 5e3);
    CHECK(g.guard->judge_rerun(20, {std::nullopt, "activation_squares", true}, {3.0f, 0.5, kInf},
                               {3.0f, 0.5, 5e3}) == Outcome::kTransient);
    const auto events = keel::test::events(g.dir / "run");
    REQUIRE(events.size() == 1);
    CHECK(events[0].at("rank") == 0);
    CHECK(events[0].at("verdict") == "transient");
    CHECK(events[0].at("rerun_activation_squares") == 5e3);
  }

  TEST_CASE("a rerun with the same result is a loss spike - never SDC - applied or skipped as spike_policy says") {
    struct Row {
      const char* policy;
      Outcome outcome;
      std::vector<std::string> kinds;
    };
    const std::vector<Row> rows = {
        {"apply", Outcome::kSpikeApplied, {"loss_spike"}},
        {"skip", Outcome::kSpikeSkipped, {"loss_spike", "step_skipped"}},
    };
    for (const Row& row : rows) {
      CAPTURE(row.policy);
      Guarded g({std::string("health.spike_policy=") + row.policy});
      two_attempts(*g.guard);
      CHECK(g.guard->judge_rerun(30, {11.5, "grad_norm", true}, {9.0f, 40.0, 7.0}, {9.0f, 40.0, 7.0}) == row.outcome);
      const auto events = keel::test::events(g.dir / "run");
      REQUIRE(events.size() == row.kinds.size());
      for (size_t i = 0; i < events.size(); ++i) CHECK(events[i].at("kind") == row.kinds[i]);
      const auto& spike = events[0];
      CHECK(spike.at("rank") == -1);
      CHECK(spike.at("step") == 30);
      CHECK(spike.at("loss") == 9.0);
      CHECK(spike.at("grad_norm") == 40.0);
      CHECK(spike.at("score") == 11.5);
      CHECK(spike.at("signal") == "grad_norm");
      CHECK(spike.at("threshold") == 20.0);
      CHECK(spike.at("rerun_equal") == true);
      CHECK(spike.at("action") == (row.outcome == Outcome::kSpikeSkipped ? "skipped" : "applied"));
      if (events.size() > 1) CHECK(events[1].at("step") == 30);
    }
  }

  TEST_CASE("a step non-finite twice is recorded as a spike and refused with exit 11") {
    Guarded g;
    two_attempts(*g.guard);
    try {
      g.guard->judge_rerun(7, {std::nullopt, "loss", true}, {kNan, 1.0, 7.0}, {kNan, 1.0, 7.0});
      FAIL("a NaN step was accepted");
    } catch (const keel::common::Error& e) {
      CHECK(e.code() == keel::common::ErrorCode::kSdcSuspected);
      CHECK(std::string(e.what()).find("not applied") != std::string::npos);
    }
    const auto events = keel::test::events(g.dir / "run");
    REQUIRE(events.size() == 1);
    CHECK(events[0].at("kind") == "loss_spike");
    CHECK(events[0].at("action") == "refused");
    CHECK(events[0].at("score").is_null());
  }
}
