// keel-bench-sdc: what the trainer's SDC checks cost (docs/architecture.md
// "Health": SDC) on the train_throughput.py model (L=4, C=256, H=4, T=256,
// batch 8, V=256, fp32), one rank in this process:
//   * the step itself, with the rerun's local fingerprints on and off
//     (alternating steps of two identical loops, medians);
//   * one fingerprint: the sum of squares of every local gradient;
//   * one replica digest: XXH3 of the state ZeRO-0 replicates (parameters
//     and both moments), the most any rank hashes;
//   * one known-answer kernel test.
// and the share of step time they take at the default intervals
// (health.sdc_digest_every, health.sdc_kat_every_s). Prints one JSON object.
#include "bench/bench_model.h"
#include "common/config.h"
#include "tests/support/temp_dir.h"
#include "tests/trainer/token_fixture.h"
#include "trainer/kernels/backend_array.h"
#include "trainer/kernels/cpu_backend.h"
#include "trainer/kernels/known_answer.h"
#include "trainer/train/sdc_guard.h"
#include "trainer/train/train_loop.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <vector>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double time_ms(const std::function<void()>& body) {
  const auto start = std::chrono::steady_clock::now();
  body();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"keel-bench-sdc: the cost of the trainer's SDC checks per step"};
  int steps = 12, repeats = 20, threads = 0;
  app.add_option("--steps", steps, "steps per loop (the first two are left out)");
  app.add_option("--repeats", repeats, "timings of each check");
  app.add_option("--threads", threads, "kernel threads; 0: every core");
  CLI11_PARSE(app, argc, argv);
  if (steps < 3) {
    std::cerr << "keel-bench-sdc: --steps must be at least 3\n";
    return 2;
  }

  keel::test::TempDir dir;
  keel::test::write_pattern_shard(dir / "train.bin", 1 << 20);
  const auto path = dir.write("bench.toml", keel::bench::kBenchModel);
  const std::string threads_set = "train.threads=" + std::to_string(threads);
  const auto with = keel::common::Config::load(path, {"job.run_dir=" + (dir / "a").string(), threads_set});
  const auto without =
      keel::common::Config::load(path, {"job.run_dir=" + (dir / "b").string(), threads_set, "health.sdc_rerun=false"});
  keel::trainer::CpuBackend cpu(threads);
  keel::trainer::TrainLoop fingerprinted(with, cpu), plain(without, cpu);

  std::vector<double> on, off;
  for (int step = 0; step < steps; ++step) {
    const double a = fingerprinted.train_step(step).step_ms;
    const double b = plain.train_step(step).step_ms;
    if (step >= 2) {
      on.push_back(a);
      off.push_back(b);
    }
  }

  auto& storage = plain.storage();
  const size_t numel = storage.parameter_bytes() / sizeof(float);
  keel::trainer::BackendArray<float> exp_avg(cpu, numel), exp_avg_sq(cpu, numel);
  const std::vector<keel::trainer::FloatSpan> replicated = {
      {storage.params(), numel}, {exp_avg.data(), numel}, {exp_avg_sq.data(), numel}};
  std::vector<double> fingerprint, digest, kat;
  for (int i = 0; i < repeats; ++i) {
    fingerprint.push_back(time_ms([&] { cpu.sum_squares(storage.grads(), numel); }));
    digest.push_back(time_ms([&] { keel::trainer::digest_of(cpu, replicated); }));
    kat.push_back(keel::trainer::test_known_answers(cpu).seconds * 1e3);
  }

  const double step_ms = median(on), fingerprint_ms = median(fingerprint), digest_ms = median(digest);
  const double kat_ms = median(kat);
  const auto& health = with.health;
  const double per_step = fingerprint_ms + digest_ms / static_cast<double>(health.sdc_digest_every) +
                          kat_ms * step_ms / (health.sdc_kat_every_s * 1e3);
  std::cout << nlohmann::json{{"bench", "sdc_overhead"},
                              {"model", {{"n_layer", 4}, {"n_embd", 256}, {"seq_len", 256}, {"batch_size", 8}}},
                              {"threads", cpu.threads()},
                              {"parameters", numel},
                              {"step_ms", step_ms},
                              {"step_ms_without_fingerprints", median(off)},
                              {"fingerprint_ms", fingerprint_ms},
                              {"digest_ms", digest_ms},
                              {"digest_bytes", 3 * numel * sizeof(float)},
                              {"kat_ms", kat_ms},
                              {"sdc_digest_every", health.sdc_digest_every},
                              {"sdc_kat_every_s", health.sdc_kat_every_s},
                              {"overhead_at_defaults", per_step / step_ms}}
                   .dump()
            << std::endl;
  return 0;
}
