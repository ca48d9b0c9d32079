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

  explicit Guarded(std::vector<std::string> sets = {}) {
    sets.push_back("job.run_dir=" + (dir / "run").string());
    const auto config =
        keel::common::Config::parse("[data]\ntrain = \"x.bin\"\n[train]\nwarmup_steps = 5\n", "test", dir.path(), sets);
    guard = std::make_unique<keel::trainer::SdcGuard>(
        config, cpu, 0, 1, 0, board, [](float*, size_t) {}, keel::trainer::ReplicatedState{});
  }
};

using keel::trainer::StepSignals;

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

// An ordinary result after history(40).
StepSignals ordinary(float loss = 2.95f, double norm = 0.6, double activations = 1.4e4) {
  return {loss, norm, activations};
}

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("a step is re-run when its loss or norm is non-finite or stands far above the recent window") {
    struct Row {
      const char* name;
      size_t steps;  // accepted before the candidate, one per step from 0
      StepSignals result;
      bool rerun;
      std::vector<std::string> sets;
    };
    const std::vector<Row> rows = {
        {"an ordinary step", 40, ordinary(), false, {}},
        {"the loss four times the median", 40, ordinary(12.0f), true, {}},
        {"the norm a hundred times the median", 40, ordinary(2.9f, 50.0), true, {}},
        {"a norm at the window's heavy tail", 40, ordinary(2.9f, 1.2), false, {}},
        {"activation squares 2^64 times the median (an exponent bit flipped)", 40, ordinary(2.9f, 0.5, 2.6e23),
         true, {}},
        {"infinite activation squares", 40, ordinary(2.9f, 0.5, kInf), true, {}},
        {"a sudden fall of the loss", 40, ordinary(0.5f), false, {}},
        {"a sudden fall of the norm", 40, ordinary(2.9f, 0.001), false, {}},
        {"a sudden fall of the activation squares", 40, ordinary(2.9f, 0.5, 10.0), false, {}},
        {"a NaN loss with an empty window", 0, ordinary(kNan), true, {}},
        {"an infinite norm", 40, ordinary(2.9f, kInf), true, {}},
        {"a spike with only seven values in the window", 7, ordinary(12.0f, 50.0, 1e30), false, {}},
        {"a spike during train.warmup_steps", 20, ordinary(12.0f, 50.0, 1e30), false, {"train.warmup_steps=40"}},
        {"a NaN with health.sdc_rerun off", 40, ordinary(kNan), false, {"health.sdc_rerun=false"}},
        {"a spike below a higher health.sdc_anomaly_z", 40, ordinary(12.0f), false, {"health.sdc_anomaly_z=100"}},
    };
    for (const Row& row : rows) {
      CAPTURE(row.name);
      Guarded g(row.sets);
      for (const auto& step : history(row.steps)) g.guard->accept(step);
      CHECK(g.guard->needs_rerun(static_cast<int64_t>(row.steps), row.result) == row.rerun);
    }
  }

  TEST_CASE("a plateau of equal values calls only a large rise an anomaly") {
    Guarded g;
    for (int i = 0; i < 30; ++i) g.guard->accept({2.0f, 0.25, 100.0});
    CHECK_FALSE(g.guard->needs_rerun(30, {2.1f, 0.25, 100.0}));
    CHECK_FALSE(g.guard->needs_rerun(30, {2.0f, 0.3, 100.0}));
    CHECK_FALSE(g.guard->needs_rerun(30, {2.0f, 0.25, 110.0}));
    CHECK(g.guard->needs_rerun(30, {4.0f, 0.25, 100.0}));
    CHECK(g.guard->needs_rerun(30, {2.0f, 1.0, 100.0}));
    CHECK(g.guard->needs_rerun(30, {2.0f, 0.25, 400.0}));
  }

  TEST_CASE("a rerun with another result is a transient fault named on the rank whose fingerprint changed") {
    for (bool changed : {true, false}) {
      CAPTURE(changed);
      Guarded g;
      g.guard->begin_attempt();
      g.guard->add_local_loss(6.0);
      g.guard->add_local_gradients(changed ? 1e30 : 1.0);
      g.guard->begin_attempt();
      g.guard->add_local_loss(6.0);
      g.guard->add_local_gradients(1.0);
      CHECK(g.guard->judge_rerun(12, {3.0f, 1e15, 7.0}, {3.0f, 0.5, 7.0}));
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
    CHECK(g.guard->judge_rerun(20, {3.0f, 0.5, kInf}, {3.0f, 0.5, 5e3}));
    const auto events = keel::test::events(g.dir / "run");
    REQUIRE(events.size() == 1);
    CHECK(events[0].at("rank") == 0);
    CHECK(events[0].at("verdict") == "transient");
    CHECK(events[0].at("rerun_activation_squares") == 5e3);
  }

  TEST_CASE("a rerun with the same result blames the data and skips the step") {
    Guarded g;
    g.guard->begin_attempt();
    g.guard->begin_attempt();
    CHECK_FALSE(g.guard->judge_rerun(30, {9.0f, 40.0, 7.0}, {9.0f, 40.0, 7.0}));
    const auto events = keel::test::events(g.dir / "run");
    REQUIRE(events.size() == 2);
    CHECK(events[0].at("kind") == "sdc_detected");
    CHECK(events[0].at("rank") == -1);
    CHECK(events[0].at("verdict") == "data");
    CHECK(events[1].at("kind") == "step_skipped");
    CHECK(events[1].at("step") == 30);
  }

  TEST_CASE("a step non-finite twice is recorded as data and refused with exit 11") {
    Guarded g;
    g.guard->begin_attempt();
    g.guard->begin_attempt();
    try {
      g.guard->judge_rerun(7, {kNan, 1.0, 7.0}, {kNan, 1.0, 7.0});
      FAIL("a NaN step was accepted");
    } catch (const keel::common::Error& e) {
      CHECK(e.code() == keel::common::ErrorCode::kSdcSuspected);
      CHECK(std::string(e.what()).find("not applied") != std::string::npos);
    }
    const auto events = keel::test::events(g.dir / "run");
    REQUIRE(events.size() == 1);
    CHECK(events[0].at("verdict") == "data");
  }
}
