// keel-bench-parallel: data- and tensor-parallel training throughput on this
// machine. Trains the train_throughput.py model (L=4, C=256, H=4, T=256,
// global batch 8, V=256, fp32) as DP1, DP2 at ZeRO 0-3, TP2 and DP2 x TP2,
// with the machine's cores split evenly between the ranks, and prints one
// JSON object per run: tokens/s, and the bytes and calls each rank handed to
// each collective of each group in a step next to the formulas of
// tests/trainer/comm_formulas.h, and per group how long its collectives ran
// against how long training was blocked on them (exposed). Every layout
// with a DP group runs twice, with its collectives overlapped with compute
// and without (the reference), side by side. Ranks are real keel-trainer
// processes rendezvousing through an embedded Store, started by the test
// launcher (keeld does this in production).
#include "bench/metrics_rows.h"
#include "bench/bench_model.h"
#include "common/config.h"
#include "tests/support/process.h"
#include "tests/support/rank_launcher.h"
#include "tests/support/temp_dir.h"
#include "tests/trainer/comm_formulas.h"
#include "tests/trainer/token_fixture.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <thread>

namespace {

struct Measured {
  double tokens_per_s = 0;
  nlohmann::json comm_per_step = nlohmann::json::object();  // from the last step
  // Per group: mean busy and exposed milliseconds per timed step.
  nlohmann::json comm_ms_per_step = nlohmann::json::object();
};

Measured read_metrics(const std::filesystem::path& path, int warmup) {
  const auto rows = keel::bench::timed_rows(path, warmup);
  Measured m{keel::bench::tokens_per_s(rows, 8.0 * 256)};
  if (rows.back().contains("comm")) m.comm_per_step = rows.back().at("comm");
  for (const auto& row : rows) {
    if (!row.contains("comm_ms")) continue;
    for (const auto& [group, ms] : row.at("comm_ms").items()) {
      auto& mean = m.comm_ms_per_step[group];
      if (mean.is_null()) mean = {{"busy", 0.0}, {"exposed", 0.0}};
      for (const char* kind : {"busy", "exposed"}) {
        mean[kind] = mean[kind].get<double>() + ms.at(kind).get<double>() / static_cast<double>(rows.size());
      }
    }
  }
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"keel-bench-parallel: DP1, DP2 (ZeRO 0-3), TP2 and DP2 x TP2 training throughput and bytes per step"};
  int steps = 12, warmup = 2;
  int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  app.add_option("--steps", steps, "steps per run");
  app.add_option("--warmup", warmup, "first steps left out of the timing");
  app.add_option("--cores", cores, "cores to split between the ranks");
  CLI11_PARSE(app, argc, argv);
  if (steps <= warmup) {
    std::cerr << "keel-bench-parallel: --steps must exceed --warmup\n";
    return 2;
  }

  keel::test::TempDir dir;
  keel::test::write_pattern_shard(dir / "train.bin", 1 << 20);
  const auto config_path = dir.write("bench.toml", keel::bench::kBenchModel);
  const auto config = keel::common::Config::load(config_path);

  struct Run {
    int dp, tp, zero;
    bool overlap = true;
  };
  std::vector<Run> runs;
  for (const Run layout :
       {Run{1, 1, 0}, Run{2, 1, 0}, Run{2, 1, 1}, Run{2, 1, 2}, Run{2, 1, 3}, Run{1, 2, 0}, Run{2, 2, 1}}) {
    runs.push_back(layout);
    if (layout.dp > 1) runs.push_back(Run{layout.dp, layout.tp, layout.zero, false});
  }
  for (const Run& run : runs) {
    const int world = run.dp * run.tp;
    const std::string name = "dp" + std::to_string(run.dp) + "_tp" + std::to_string(run.tp) + "_zero" +
                             std::to_string(run.zero) + (run.overlap ? "" : "_serial");
    const int threads = std::max(1, cores / world);
    std::vector<std::string> args = {keel::test::keel_binary("keel-trainer").string(), "--config",
                                     config_path.string()};
    for (const std::string& set : {"job.run_dir=" + (dir / name).string(), "train.steps=" + std::to_string(steps),
                                   "train.threads=" + std::to_string(threads), "parallel.dp=" + std::to_string(run.dp),
                                   "parallel.tp=" + std::to_string(run.tp), "parallel.zero=" + std::to_string(run.zero),
                                   std::string("parallel.overlap_comm=") + (run.overlap ? "true" : "false")}) {
      args.insert(args.end(), {"--set", set});
    }
    std::vector<keel::test::ProcessResult> results;
    if (world == 1) {
      results.push_back(keel::test::run_process(args, {{"SPDLOG_LEVEL", "warn"}}));
    } else {
      keel::test::RankLauncher ranks(world, args, {{"SPDLOG_LEVEL", "warn"}});
      results = ranks.wait_all();
    }
    for (const auto& r : results) {
      if (r.exit_code != 0) {
        std::cerr << "keel-bench-parallel: " << name << " failed with exit " << r.exit_code << ":\n" << r.output;
        return 1;
      }
    }
    const Measured m = read_metrics(dir / name / "metrics.jsonl", warmup);

    const nlohmann::json formula = keel::test::step_comm_formula(config, run.dp, run.tp, run.zero);
    nlohmann::json out = {{"bench", "parallel_throughput"},
                          {"run", name},
                          {"dp", run.dp},
                          {"tp", run.tp},
                          {"zero", run.zero},
                          {"overlap_comm", run.overlap},
                          {"threads_per_rank", threads},
                          {"steps_timed", steps - warmup},
                          {"tokens_per_s", m.tokens_per_s},
                          {"comm_per_step", m.comm_per_step},
                          {"formula_comm_per_step", formula},
                          {"comm_matches_formula", m.comm_per_step == formula},
                          {"comm_ms_per_step", m.comm_ms_per_step},
                          {"machine", {{"cores", std::thread::hardware_concurrency()}}}};
    std::cout << out.dump() << std::endl;
  }
  return 0;
}
