// keel-bench-detectors: what detecting hangs, stragglers and silent data
// corruption costs a training step (docs/architecture.md "Health"), on the
// train_throughput.py model (L=4, C=256, H=4, T=256, batch 8, V=256, fp32),
// one rank in this process. keeld's detectors run in keeld, off the
// training stream; a rank pays only for what it publishes and checks:
//   * the progress board the hang and straggler detectors read: a step's
//     phases, its timing (with the two CPU-wait reads) and
//     --collectives-per-step collectives begun and ended (each with its
//     CPU-wait reads), on a real shared-memory board;
//   * the step itself, with the rerun's local fingerprints on and off
//     (alternating steps of two identical loops, medians);
//   * one fingerprint: the sum of squares of every local gradient, of the
//     residual stream leaving the last block and of the logits;
//   * one replica digest: XXH3 of the state ZeRO-0 replicates (parameters
//     and both moments), the most any rank hashes;
//   * one known-answer kernel test.
// and the share of step time they take at the default intervals
// (health.sdc_digest_every, health.sdc_kat_every_s). Prints one JSON object.
#include "bench/bench_model.h"
#include "common/config.h"
#include "health/board_publisher.h"
#include "trainer/train/blas_core_start.h"
#include "health/progress_board.h"
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
#include <string>
#include <unistd.h>
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

// Milliseconds one step's board publishing takes: phases, `collectives`
// collectives of two groups, the step's timing and its end.
double board_ms_per_step(int collectives, int steps) {
  using keel::health::Phase;
  const std::string name = "/keel-bench-board-" + std::to_string(::getpid());
  auto keeld_side = keel::health::ProgressBoard::create(name);
  double ms = 0;
  {
    keel::health::BoardPublisher rank(keel::health::ProgressBoard::open(name), 0, 0);
    const int groups[2] = {rank.add_group("g0.dp.0", 0, 2), rank.add_group("g0.tp.0", 0, 2)};
    ms = time_ms([&] {
      int64_t seq = 0;
      for (int step = 0; step < steps; ++step) {
        rank.begin_step(step);
        rank.set_phase(Phase::kData);
        rank.set_phase(Phase::kForward);
        for (int c = 0; c < collectives; ++c, ++seq) {
          if (c == collectives / 2) rank.set_phase(Phase::kBackward);
          rank.begin_collective(groups[c % 2], seq, "all_reduce", 1 << 16);
          rank.end_collective(groups[c % 2], seq, true);
        }
        rank.record_step_timing();
        rank.set_phase(Phase::kOptimizer);
        rank.finish_step(step + 1, 1.0f, 1.0f, 1.0, 1.0);
      }
    }) / steps;
  }
  keel::health::ProgressBoard::remove(name);
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"keel-bench-detectors: the cost per step of the board the detectors read and of the SDC checks"};
  int steps = 12, repeats = 20, threads = 0, collectives = 64;
  app.add_option("--steps", steps, "steps per loop (the first two are left out)");
  app.add_option("--repeats", repeats, "timings of each check");
  app.add_option("--threads", threads, "kernel threads; 0: every core");
  app.add_option("--collectives-per-step", collectives,
                 "collectives a step publishes (DP2 x TP2 of this model: 4 TP all-reduces per block and step, "
                 "forward and backward, plus the gradient sums)");
  CLI11_PARSE(app, argc, argv);
  if (steps < 3) {
    std::cerr << "keel-bench-detectors: --steps must be at least 3\n";
    return 2;
  }

  keel::test::TempDir dir;
  keel::test::write_pattern_shard(dir / "train.bin", 1 << 20);
  const auto path = dir.write("bench.toml", keel::bench::kBenchModel);
  const std::string threads_set = "train.threads=" + std::to_string(threads);
  const auto with = keel::common::Config::load(path, {"job.run_dir=" + (dir / "a").string(), threads_set});
  const auto without =
      keel::common::Config::load(path, {"job.run_dir=" + (dir / "b").string(), threads_set, "health.sdc_rerun=false"});
  // The kernels keel-trainer would run here (this process is a trainer too).
  const std::optional<keel::trainer::BlasCore> blas = keel::trainer::settle_blas_core(with.train.blas_core, argv);
  keel::trainer::CpuBackend cpu(threads);
  keel::trainer::prove_blas_core(*blas, cpu, false, argv);
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
  const auto& model = with.model;
  const size_t positions = static_cast<size_t>(with.train.batch_size * model.seq_len);
  keel::trainer::BackendArray<float> residual(cpu, positions * static_cast<size_t>(model.n_embd)),
      logits(cpu, positions * static_cast<size_t>(model.padded_vocab()));
  std::vector<double> fingerprint, digest, kat;
  for (int i = 0; i < repeats; ++i) {
    fingerprint.push_back(time_ms([&] {
      cpu.sum_squares(storage.grads(), numel);
      cpu.sum_squares(residual.data(), residual.size());
      cpu.sum_squares(logits.data(), logits.size());
    }));
    digest.push_back(time_ms([&] { keel::trainer::digest_of(cpu, replicated); }));
    kat.push_back(keel::trainer::test_known_answers(cpu).seconds * 1e3);
  }

  std::vector<double> board;
  for (int i = 0; i < repeats; ++i) board.push_back(board_ms_per_step(collectives, 1000));

  const double step_ms = median(on), fingerprint_ms = median(fingerprint), digest_ms = median(digest);
  const double kat_ms = median(kat), board_ms = median(board);
  const auto& health = with.health;
  const double sdc_per_step = fingerprint_ms + digest_ms / static_cast<double>(health.sdc_digest_every) +
                              kat_ms * step_ms / (health.sdc_kat_every_s * 1e3);
  std::cout << nlohmann::json{{"bench", "detector_overhead"},
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
                              {"board_collectives_per_step", collectives},
                              {"board_ms_per_step", board_ms},
                              {"sdc_overhead_at_defaults", sdc_per_step / step_ms},
                              {"board_overhead", board_ms / step_ms},
                              {"overhead_at_defaults", (sdc_per_step + board_ms) / step_ms},
                              {"blas", keel::trainer::blas_report(blas, cpu)}}
                   .dump()
            << std::endl;
  return 0;
}
