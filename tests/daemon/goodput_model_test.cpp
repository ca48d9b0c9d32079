// The goodput projection's model (bench/goodput_model.h) against figures
// worked by hand: what a run keeps of its wall time given its failures and
// its saves.
#include "bench/goodput_model.h"

#include <doctest/doctest.h>

using keel::bench::GoodputInputs;
using keel::bench::kept_share;
using keel::bench::project_goodput;

TEST_SUITE("unit") {
  TEST_CASE("a run keeps its wall time less the saves' stall and each failure's cost") {
    CHECK(kept_share(0, 0, 100) == 1.0);
    // One failure an hour costing 6 minutes keeps 90%; a 2% stall on top 88.2%.
    CHECK(kept_share(0, 1.0 / 3600, 360) == doctest::Approx(0.9));
    CHECK(kept_share(0.02, 1.0 / 3600, 360) == doctest::Approx(0.882));
    // Failures that cost more than the time between them leave nothing.
    CHECK(kept_share(0, 1.0 / 60, 120) == 0.0);
  }

  TEST_CASE("snapshots keep more than disk checkpoints alone where the failures they cover outweigh their stall") {
    GoodputInputs in;
    in.failures_per_gpu_hour = 1e-5;
    in.memory_share = 0.5;
    in.restart_disk_s = 60;
    in.restart_memory_s = 20;
    in.step_s = 2;
    in.checkpoint_every_s = 1800;
    in.checkpoint_stall_s = 1;
    in.snapshot_every_steps = 1;
    in.snapshot_stall_share = 0.01;
    // 10,000 GPUs: 0.1 failures an hour. Disk: each costs 60 + 900 s.
    const auto g = project_goodput(in, 10000);
    const double rate = 0.1 / 3600;
    CHECK(g.disk_only == doctest::Approx((1 - 1.0 / 1800) * (1 - rate * 960)));
    // With snapshots half of them cost 20 + 1 s instead.
    CHECK(g.with_snapshots == doctest::Approx((1 - 1.0 / 1800 - 0.01) * (1 - rate * (0.5 * 21 + 0.5 * 960))));
    CHECK(g.with_snapshots > g.disk_only);
    // Without failures the snapshots' stall is all they do.
    CHECK(project_goodput(GoodputInputs{0, 0.5, 0, 60, 20, 2, 1800, 1, 1, 0.01}, 1000).with_snapshots <
          project_goodput(GoodputInputs{0, 0.5, 0, 60, 20, 2, 1800, 1, 1, 0.01}, 1000).disk_only);
  }
}
