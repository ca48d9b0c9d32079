// keel-trainer processes on the GPU (train.device = "cuda") held against
// the same config on the CPU, through checkpoints in both directions
// (docs/architecture.md "Kernels", "Checkpoints"). Skipped with the reason
// where no device can be used.
#ifdef KEEL_HAVE_CUDA

#include "checkpoint/paths.h"
#include "tests/trainer/cuda_fixture.h"
#include "tests/trainer/trainer_runs.h"

#include <doctest/doctest.h>

#include <cmath>

namespace fs = std::filesystem;
using keel::test::device_or_skip;
using keel::test::Layout;
using keel::test::Run;
using keel::test::TrainerRuns;

namespace {

const std::vector<std::string> kCpu = {"train.steps=12", "train.val_every=0", "checkpoint.every_steps=4",
                                       "train.device=cpu"};
// The GPU's default precision (bf16 GEMM inputs) and float32 throughout.
const std::vector<std::string> kGpu = {"train.steps=12", "train.val_every=0", "checkpoint.every_steps=4",
                                       "train.device=cuda"};
const std::vector<std::string> kGpuFp32 = {"train.steps=12", "train.val_every=0", "checkpoint.every_steps=4",
                                           "train.device=cuda", "train.precision=fp32"};
// The bounds between the backends on each step's loss (relative).
constexpr double kFp32Bound = 1e-4;
constexpr double kBf16Bound = 2e-2;

void check_losses_close(const std::vector<double>& got, const std::vector<double>& want, double bound,
                        size_t want_from = 0) {
  REQUIRE(want.size() >= want_from + got.size());
  for (size_t s = 0; s < got.size(); ++s) {
    CAPTURE(s);
    CHECK(std::fabs(got[s] - want[want_from + s]) <= bound * std::fabs(want[want_from + s]));
  }
}

fs::path checkpoint_of(const TrainerRuns& f, const std::string& run, int64_t step) {
  return keel::checkpoint::step_dir(f.dir() / run / "checkpoints", step);
}

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE("a keel-trainer run on the GPU follows the CPU run of the same config in float32 and in bf16") {
    if (!device_or_skip()) return;
    TrainerRuns f;
    const Run cpu = f.run(Layout{}, "cpu", kCpu);
    const Run fp32 = f.run(Layout{}, "fp32", kGpuFp32);
    REQUIRE(fp32.losses.size() == 12);
    check_losses_close(fp32.losses, cpu.losses, kFp32Bound);
    const Run bf16 = f.run(Layout{}, "bf16", kGpu);
    REQUIRE(bf16.losses.size() == 12);
    check_losses_close(bf16.losses, cpu.losses, kBf16Bound);
    CHECK(bf16.exact != fp32.exact);  // the default really is the bf16 path
  }

  TEST_CASE("a GPU run stopped and resumed is bit-identical to one that never stopped and to a second run") {
    if (!device_or_skip()) return;
    TrainerRuns f;
    const Run whole = f.run(Layout{}, "whole", kGpu);
    const Run again = f.run(Layout{}, "again", kGpu);
    f.run(Layout{}, "resumed", kGpu, {"--stop-after", "6"}, 14);
    const Run resumed = f.run(Layout{}, "resumed", kGpu);
    CHECK(keel::test::last_json_line(resumed.outputs[0]).at("first_step") == 6);
    CHECK(again.exact == whole.exact);
    CHECK(resumed.exact == whole.exact);
    CHECK(keel::test::last_json_line(resumed.outputs[0]).at("parameter_digest") ==
          keel::test::last_json_line(whole.outputs[0]).at("parameter_digest"));
  }

  TEST_CASE("a checkpoint saved on the GPU continues on the CPU and one saved on the CPU continues on the GPU") {
    if (!device_or_skip()) return;
    TrainerRuns f;
    const Run cpu = f.run(Layout{}, "cpu", kCpu);
    f.run(Layout{}, "gpu_saved", kGpu, {"--stop-after", "6"}, 14);
    const Run on_cpu = f.run(Layout{}, "on_cpu", kCpu, {"--init-from", checkpoint_of(f, "gpu_saved", 6).string()});
    REQUIRE(on_cpu.losses.size() == 6);  // steps 6 to 11
    check_losses_close(on_cpu.losses, cpu.losses, kBf16Bound, 6);

    f.run(Layout{}, "cpu_saved", kCpu, {"--stop-after", "6"}, 14);
    const Run on_gpu = f.run(Layout{}, "on_gpu", kGpu, {"--init-from", checkpoint_of(f, "cpu_saved", 6).string()});
    REQUIRE(on_gpu.losses.size() == 6);
    check_losses_close(on_gpu.losses, cpu.losses, kBf16Bound, 6);
  }
}

#endif  // KEEL_HAVE_CUDA
