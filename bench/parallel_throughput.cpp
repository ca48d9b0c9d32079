// keel-bench-parallel: training throughput of each parallel axis on this
// machine. Trains the train_throughput.py model (L=4, C=256, H=4, T=256,
// global batch 8, V=256, fp32) as DP1, DP2 at ZeRO 0-3, TP2, DP2 x TP2,
// PP2 and PP4 (1F1B, 8 microbatches), PP2 interleaved over 2 chunks per
// stage, PP2 and PP4 zero bubble (ZB-H1), CP2, CP4 and PP2 x CP2, and with
// four experts in every second block DP2 (the MoE reference), DP2 x EP2
// and DP4 x EP2 (ZeRO-1); then DP1 and the pipelines again on the balanced
// pipeline model (L=16, C=512), where the bubble is measured. The
// machine's cores are split evenly between the ranks. It prints one JSON
// object per run: tokens/s and its ratio to its model's DP1 run, and the
// bytes and calls each rank handed to each collective of each group in a
// step next to the formulas of tests/trainer/comm_formulas.h, and per
// group how long its collectives ran against how long training was
// blocked on them (exposed). Pipelines also report each stage's idle
// fraction against (p - 1) / (m + p - 1). Every layout with a DP group
// runs twice, with its collectives overlapped with compute and without
// (the reference), side by side. `--set` changes the model of every run.
// Ranks are real keel-trainer processes rendezvousing through an embedded
// Store, started by the test launcher (keeld does this in production).
#include "bench/blas_ceiling.h"
#include "bench/metrics_rows.h"
#include "bench/bench_model.h"
#include "common/config.h"
#include "common/error.h"
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
#include <map>
#include <thread>

namespace {

struct Measured {
  double tokens_per_s = 0;
  nlohmann::json comm_per_step = nlohmann::json::object();  // from the last step
  // Per group: mean busy and exposed milliseconds per timed step.
  nlohmann::json comm_ms_per_step = nlohmann::json::object();
};

Measured read_metrics(const std::filesystem::path& path, int warmup, double tokens_per_step) {
  const auto rows = keel::bench::timed_rows(path, warmup);
  Measured m{keel::bench::tokens_per_s(rows, tokens_per_step)};
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
  CLI::App app{"keel-bench-parallel: DP, TP, PP, CP and their compositions: training throughput and bytes per step"};
  int steps = 12, warmup = 2;
  int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  app.add_option("--steps", steps, "steps per run");
  app.add_option("--warmup", warmup, "first steps left out of the timing");
  app.add_option("--cores", cores, "cores to split between the ranks");
  std::string only;
  app.add_option("--only", only, "run only the layouts whose name contains this, e.g. moe_ or _pp");
  std::vector<std::string> model_sets;
  app.add_option("--set", model_sets, "override the bench model for every run, e.g. model.n_layer=8 (repeatable)");
  CLI11_PARSE(app, argc, argv);
  if (steps <= warmup) {
    std::cerr << "keel-bench-parallel: --steps must exceed --warmup\n";
    return 2;
  }

  keel::test::TempDir dir;
  keel::test::write_pattern_shard(dir / "train.bin", 1 << 20);
  const auto config_path = dir.write("bench.toml", keel::bench::kBenchModel);
  try {
    keel::common::Config::load(config_path, model_sets);
  } catch (const keel::common::Error& e) {
    std::cerr << "keel-bench-parallel: " << e.what() << "\n";
    return 2;
  }

  struct Run {
    int dp, tp, zero;
    bool overlap = true;
    int pp = 1, cp = 1, ep = 1;
    bool moe = false;
    int pp_virtual = 1;
    bool zero_bubble = false;
    bool balanced = false;  // on the balanced pipeline model below
  };
  std::vector<Run> runs;
  for (const Run layout : {Run{1, 1, 0}, Run{2, 1, 0}, Run{2, 1, 1}, Run{2, 1, 2}, Run{2, 1, 3}, Run{1, 2, 0},
                           Run{2, 2, 1}, Run{1, 1, 0, true, 2}, Run{1, 1, 0, true, 4}, Run{1, 1, 0, true, 1, 2},
                           Run{1, 1, 0, true, 1, 4}, Run{1, 1, 0, true, 2, 2}}) {
    runs.push_back(layout);
    if (layout.dp > 1) runs.push_back(Run{layout.dp, layout.tp, layout.zero, false});
  }
  runs.push_back(Run{1, 1, 0, true, 2, 1, 1, false, 2});
  for (const int pp : {2, 4}) runs.push_back(Run{1, 1, 0, true, pp, 1, 1, false, 1, true});
  for (const int ep : {1, 2}) runs.push_back(Run{2, 1, 1, true, 1, 1, ep, true});
  runs.push_back(Run{4, 1, 1, true, 1, 1, 2, true});
  // The pipeline bubble is the schedule's own where the stages cost the
  // same and a transfer is small beside a stage's compute. On the bench
  // model neither holds: the head and loss make the last stage about 4%
  // slower, and a microbatch's 256 KB boundary crossing loopback TCP
  // (about 0.5 ms, each one on 1F1B's critical path) is 3-4% of a stage's
  // forward and backward. The balanced model has sixteen blocks of
  // C = 512, where the head (V = 256) costs 0.5% of a PP2 stage and a
  // 512 KB transfer well under 1% of its compute per microbatch. With
  // eight blocks the head's 1% alone kept interleaving 1.12-1.17 times
  // its bubble (a 1% faster stage waits 15% longer for a bubble of 1/17).
  // Its DP1 run is its reference.
  std::vector<Run> balanced = {Run{1, 1, 0}};
  for (const Run& run : runs) {
    if (run.pp > 1 && run.cp == 1) balanced.push_back(run);
  }
  for (Run& run : balanced) {
    run.balanced = true;
    runs.push_back(run);
  }
  const std::vector<std::string> balanced_sets = {"model.n_layer=16", "model.n_embd=512", "model.n_head=8"};
  std::map<std::string, double> reference_tokens_per_s;
  std::map<int, nlohmann::json> blas_by_threads;  // measured once per thread count, not per run
  const std::vector<std::string> moe_sets = {"model.n_expert=4", "model.top_k=2", "model.moe_every=2"};
  for (const Run& run : runs) {
    const int world = run.dp * run.tp * run.pp * run.cp;
    // A pipeline runs 8 microbatches; the others one, as the formulas assume.
    const int micro_batches = run.pp > 1 ? 8 : 1;
    const std::string name =
        std::string(run.balanced ? "balanced_" : "") + (run.moe ? "moe_dp" : "dp") + std::to_string(run.dp) + "_tp" +
        std::to_string(run.tp) + (run.pp > 1 ? "_pp" + std::to_string(run.pp) : "") +
        (run.pp_virtual > 1 ? "_v" + std::to_string(run.pp_virtual) : "") + (run.zero_bubble ? "_zb" : "") +
        (run.cp > 1 ? "_cp" + std::to_string(run.cp) : "") + (run.ep > 1 ? "_ep" + std::to_string(run.ep) : "") +
        "_zero" + std::to_string(run.zero) + (run.overlap ? "" : "_serial");
    if (name.find(only) == std::string::npos) continue;
    // Each model's DP1 run, first among its runs, is the others' reference.
    const std::string reference = run.balanced ? "balanced_dp1_tp1_zero0" : "dp1_tp1_zero0";
    const int threads = std::max(1, cores / world);
    std::vector<std::string> args = {keel::test::keel_binary("keel-trainer").string(), "--config", config_path.string(),
                                     "--json"};
    for (const std::string& set :
         {"job.run_dir=" + (dir / name).string(), "train.steps=" + std::to_string(steps),
          "train.threads=" + std::to_string(threads), "parallel.dp=" + std::to_string(run.dp),
          "parallel.tp=" + std::to_string(run.tp), "parallel.pp=" + std::to_string(run.pp),
          "parallel.cp=" + std::to_string(run.cp), "parallel.ep=" + std::to_string(run.ep),
          "parallel.pp_virtual=" + std::to_string(run.pp_virtual),
          std::string("parallel.pp_schedule=") + (run.zero_bubble ? "zb-h1" : "1f1b"),
          "parallel.micro_batches=" + std::to_string(micro_batches), "parallel.zero=" + std::to_string(run.zero),
          std::string("parallel.overlap_comm=") + (run.overlap ? "true" : "false")}) {
      args.insert(args.end(), {"--set", set});
    }
    std::vector<std::string> run_sets = model_sets;
    if (run.moe) run_sets.insert(run_sets.end(), moe_sets.begin(), moe_sets.end());
    if (run.balanced) run_sets.insert(run_sets.begin(), balanced_sets.begin(), balanced_sets.end());
    for (const std::string& set : run_sets) args.insert(args.end(), {"--set", set});
    const auto run_config = keel::common::Config::load(config_path, run_sets);
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
    const Measured m = read_metrics(dir / name / "metrics.jsonl", warmup,
                                    static_cast<double>(run_config.train.batch_size) * run_config.model.seq_len);

    auto blas = blas_by_threads.find(threads);
    if (blas == blas_by_threads.end()) blas = blas_by_threads.emplace(threads, keel::bench::blas_ceiling(threads)).first;
    nlohmann::json out = {{"bench", "parallel_throughput"},
                          {"run", name},
                          {"dp", run.dp},
                          {"tp", run.tp},
                          {"pp", run.pp},
                          {"pp_virtual", run.pp_virtual},
                          {"pp_schedule", run.zero_bubble ? "zb-h1" : "1f1b"},
                          {"cp", run.cp},
                          {"ep", run.ep},
                          {"moe", run.moe},
                          {"zero", run.zero},
                          {"micro_batches", micro_batches},
                          {"overlap_comm", run.overlap},
                          {"threads_per_rank", threads},
                          {"blas", blas->second},
                          {"steps_timed", steps - warmup},
                          {"model",
                           {{"n_layer", run_config.model.n_layer},
                            {"n_embd", run_config.model.n_embd},
                            {"vocab_size", run_config.model.vocab_size}}},
                          {"tokens_per_s", m.tokens_per_s},
                          {"comm_per_step", m.comm_per_step},
                          {"comm_ms_per_step", m.comm_ms_per_step},
                          {"machine", {{"cores", std::thread::hardware_concurrency()}}}};
    if (run.moe) {
      // The dense formulas do not hold the router's and experts' units; the
      // EP group's all_to_all does (the EP group is the dp group itself
      // when ep = dp x cp, and shares its communicator).
      if (run.ep > 1) {
        const auto formula = keel::test::expert_comm_formula(run_config, run.dp * run.cp, run.ep, micro_batches);
        const std::string group = run.ep == run.dp * run.cp ? "dp" : "ep";
        const auto& measured = m.comm_per_step.at(group).at("all_to_all");
        const uint64_t bytes = measured.at("bytes");
        out["formula_all_to_all_per_step"] = {{"calls", formula.all_to_all_calls},
                                              {"min_bytes", formula.all_to_all_min_bytes},
                                              {"max_bytes", formula.all_to_all_max_bytes}};
        out["all_to_all_within_formula"] = measured.at("calls") == formula.all_to_all_calls &&
                                           bytes >= formula.all_to_all_min_bytes &&
                                           bytes <= formula.all_to_all_max_bytes;
      }
    } else if (run.pp == 1 && run.cp == 1) {
      const nlohmann::json formula = keel::test::step_comm_formula(run_config, run.dp, run.tp, run.zero);
      out["formula_comm_per_step"] = formula;
      out["comm_matches_formula"] = m.comm_per_step == formula;
    } else {
      // The stage and ring transfers; the groups' other collectives are
      // the DP formulas' scalars and votes.
      const nlohmann::json formula =
          keel::test::pipeline_comm_formula(run_config, run.pp, run.cp, micro_batches, run.pp_virtual);
      bool matches = true;
      for (const auto& [group, exchange] : formula.items()) {
        matches = matches && m.comm_per_step.contains(group) && m.comm_per_step.at(group).contains("exchange") &&
                  m.comm_per_step.at(group).at("exchange") == exchange;
      }
      out["formula_exchange_per_step"] = formula;
      out["exchange_matches_formula"] = matches;
    }
    if (run.pp > 1) {
      // Every rank's idle share of the pipeline (ranks in order: stage
      // outermost) against its schedule's bubble with stages of equal time:
      // 1F1B's (p - 1) / (v m + p - 1), v chunks per stage; ZB-H1's
      // (p - 1) / (3m + p - 1), F = B = W. The first stage's schedule spans
      // it. Equal stages are an assumption: the embedding and the head make
      // them a few percent unequal, so for 1F1B the idle each stage would
      // have at the stage times measured, with transfers free, is printed
      // beside it: the schedule spans (sum_s t_s + (v m - 1) max_s t_s) / v
      // for t_s a stage's compute per microbatch (exact for 1F1B;
      // interleaved, each stage's chunks taken as equal). What the measured
      // idle exceeds it by is the transfers' and the machine's.
      const int stages = run.pp, v = run.pp_virtual, m_total = v * micro_batches;
      const double one_f_one_b_bubble = static_cast<double>(stages - 1) / (m_total + stages - 1);
      const double bubble =
          run.zero_bubble ? static_cast<double>(stages - 1) / (3 * micro_batches + stages - 1) : one_f_one_b_bubble;
      const double span = keel::test::last_json_line(results.front().output).at("schedules").at("total_s");
      std::vector<double> stage_compute(static_cast<size_t>(stages), 0.0);
      std::vector<double> rank_compute;
      for (size_t r = 0; r < results.size(); ++r) {
        const double compute = keel::test::last_json_line(results[r].output).at("schedules").at("compute_s");
        rank_compute.push_back(compute);
        // Ranks are stage-outermost: world / pp consecutive ranks per stage.
        auto& slowest = stage_compute[r * static_cast<size_t>(stages) / results.size()];
        slowest = std::max(slowest, compute);
      }
      double sum = 0, slowest = 0;
      for (const double c : stage_compute) {
        sum += c / micro_batches;
        slowest = std::max(slowest, c / micro_batches);
      }
      const double ideal_span = (sum + (m_total - 1) * slowest) / v;
      nlohmann::json idle = nlohmann::json::array(), ideal = nlohmann::json::array();
      double worst = 0, worst_over_ideal = 0;
      for (const double compute : rank_compute) {
        const double measured = 1.0 - compute / span, expected = 1.0 - compute / ideal_span;
        idle.push_back(measured);
        ideal.push_back(expected);
        worst = std::max(worst, measured);
        worst_over_ideal = std::max(worst_over_ideal, measured / expected);
      }
      out["pipeline_idle_per_rank"] = idle;
      out["pipeline_bubble_formula"] = bubble;
      out["worst_idle_over_formula"] = worst / bubble;
      if (run.zero_bubble) {
        out["one_f_one_b_bubble_formula"] = one_f_one_b_bubble;
      } else {
        out["pipeline_idle_at_stage_times_per_rank"] = ideal;
        out["worst_idle_over_idle_at_stage_times"] = worst_over_ideal;
      }
    }
    if (reference_tokens_per_s.contains(reference)) {
      out["reference_run"] = reference;
      out["tokens_per_s_over_reference"] = m.tokens_per_s / reference_tokens_per_s.at(reference);
    }
    if (name == reference) reference_tokens_per_s[name] = m.tokens_per_s;
    std::cout << out.dump() << std::endl;
  }
  return 0;
}
