// A training step on one rank, in this process, on a backend that counts
// how often the host waits for it: the scalars of a step (each
// microbatch's loss, the SDC fingerprints, the gradient norm) are queued
// and taken at once (docs/architecture.md "GPU step").
#include "common/config.h"
#include "trainer/kernels/backend_wrapper.h"
#include "trainer/kernels/cpu_backend.h"
#include "trainer/train/train_loop.h"
#include "tests/support/temp_dir.h"
#include "tests/trainer/token_fixture.h"

#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

using namespace keel::trainer;

namespace {

// Every call after which the host holds a value the device computed, and
// every upload the GPU backend does not queue.
class CountingWaits : public BackendWrapper {
 public:
  CountingWaits() : BackendWrapper(cpu_) {}
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override {
    waits += bytes > kQueuedUploadBytes ? 1 : 0;
    cpu_.copy_from_host(dst, host_src, bytes);
  }
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override {
    ++waits;
    cpu_.copy_to_host(host_dst, src, bytes);
  }
  double sum(const float* x, size_t n) override {
    ++waits;
    return cpu_.sum(x, n);
  }
  double sum_squares(const float* x, size_t n) override {
    ++waits;
    return cpu_.sum_squares(x, n);
  }
  std::vector<double> take_queued_sums() override {
    ++waits;
    std::vector<double> sums = cpu_.take_queued_sums();
    taken = sums.size();
    return sums;
  }
  int waits = 0;
  size_t taken = 0;  // by the last take_queued_sums

 private:
  CpuBackend cpu_{1};
};

constexpr const char* kModel = R"(
[model]
vocab_size = 256
seq_len = 16
n_layer = 2
n_head = 2
n_embd = 32
[data]
train = "train.bin"
[train]
batch_size = 4
warmup_steps = 1
val_every = 0
)";

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("a training step waits for the device once - whatever its microbatches and the SDC fingerprints") {
    keel::test::TempDir dir;
    keel::test::write_pattern_shard(dir / "train.bin", 1 << 14);
    const auto path = dir.write("job.toml", kModel);
    std::map<std::string, size_t> taken;  // sums a step took, by SDC setting and microbatches
    for (const std::string sdc : {"true", "false"}) {
      for (const std::string micro_batches : {"1", "4"}) {
        CAPTURE(sdc);
        CAPTURE(micro_batches);
        const auto config =
            keel::common::Config::load(path, {"job.run_dir=" + (dir / ("run-" + sdc + micro_batches)).string(),
                                              "health.sdc_rerun=" + sdc, "parallel.micro_batches=" + micro_batches});
        CountingWaits backend;
        TrainLoop loop(config, backend);
        for (int64_t step = 0; step < 3; ++step) {
          backend.waits = 0;
          const StepStats stats = loop.train_step(step);
          CHECK(std::isfinite(stats.loss));
          CHECK(backend.waits == 1);
        }
        taken[sdc + micro_batches] = backend.taken;
      }
    }
    // The one wait took the losses (one more a microbatch) and the
    // fingerprints (more with the guard on) with the norm's squares.
    CHECK(taken["false4"] == taken["false1"] + 3);
    CHECK(taken["true1"] > taken["false1"]);
  }
}
