// keel-bench-false-alarms: how often a healthy run raises an alarm
// (docs/architecture.md "Health"). Fault-free runs of the quickstart job
// under keeld, real processes on the fortunes corpus, over models (dense,
// MoE), warm-ups (1, 5 and the default) and layouts (DP, TP, PP, DP x TP),
// each with its own seed, and one long run of the quickstart job as it
// ships. For each run: the largest anomaly score the SDC rerun gave a step
// (metrics.jsonl's anomaly_score) against health.sdc_anomaly_z, and the
// count of each event kind. The target: no sdc_detected, step_skipped,
// straggler_flagged or hang_detected in any run, and no score above half
// the threshold. Progress goes to stderr, one JSON object to stdout;
// --check exits 1 when the target is missed.
#include "bench/blas_ceiling.h"
#include "common/config.h"
#include "tests/support/fortunes.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// The events a healthy run must not have, and those it may (a record).
const std::vector<std::string> kAlarms = {"sdc_detected", "step_skipped", "straggler_flagged", "hang_detected",
                                          "rank_failed"};
const std::vector<std::string> kRecords = {"loss_spike"};

struct Variant {
  std::string name;
  std::vector<std::string> sets;
};

struct Run {
  std::string name;
  int64_t steps = 0;
  std::vector<std::string> sets;
};

// Every model x warm-up x layout, each with a seed of its own.
std::vector<Run> sweep(int64_t steps) {
  const std::vector<Variant> models = {
      {"dense", {}},
      {"moe", {"model.n_expert=4", "model.top_k=2", "model.moe_every=2"}},
  };
  const std::vector<Variant> warmups = {
      {"warmup1", {"train.warmup_steps=1"}},
      {"warmup5", {"train.warmup_steps=5"}},
      {"warmup_default", {fmt::format("train.warmup_steps={}", keel::common::TrainConfig{}.warmup_steps)}},
  };
  const std::vector<Variant> layouts = {
      {"dp2_tp2", {"parallel.dp=2", "parallel.tp=2"}},
      {"dp2", {"parallel.dp=2", "parallel.tp=1"}},
      {"tp2", {"parallel.dp=1", "parallel.tp=2"}},
      {"pp2", {"parallel.dp=1", "parallel.tp=1", "parallel.pp=2", "parallel.micro_batches=4"}},
  };
  std::vector<Run> runs;
  for (const auto& model : models) {
    for (const auto& warmup : warmups) {
      for (const auto& layout : layouts) {
        Run run{fmt::format("{}_{}_{}", model.name, warmup.name, layout.name), steps, {}};
        for (const auto* v : {&model, &warmup, &layout}) run.sets.insert(run.sets.end(), v->sets.begin(), v->sets.end());
        // Experts over the DP ranks where there are two.
        if (model.name == "moe" && layout.name == "dp2") run.sets.push_back("parallel.ep=2");
        run.sets.push_back(fmt::format("job.seed={}", 1000 + runs.size()));
        runs.push_back(std::move(run));
      }
    }
  }
  return runs;
}

std::vector<nlohmann::json> json_lines(const std::filesystem::path& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded()) out.push_back(std::move(j));
  }
  return out;
}

// Runs keeld on the quickstart job with `run.sets` to its end and reads
// what the run left.
nlohmann::json measure(const Run& run, const std::filesystem::path& config, const keel::test::PreparedCorpus& corpus,
                       const std::filesystem::path& dir, double threshold) {
  std::filesystem::create_directories(dir);
  std::vector<std::string> argv = {keel::test::keel_binary("keeld").string(), "--config", config.string(),
                                   "--foreground"};
  std::vector<std::string> sets = {"job.run_dir=" + (dir / "run").string(),
                                   "daemon.socket=" + (dir / "keeld.sock").string(),
                                   "data.train=" + corpus.train_glob,
                                   "data.val=" + corpus.val_glob,
                                   "train.steps=" + std::to_string(run.steps),
                                   "faults.crash_rank=-1"};
  sets.insert(sets.end(), run.sets.begin(), run.sets.end());
  for (const auto& s : sets) argv.insert(argv.end(), {"--set", s});
  const auto result = keel::test::run_process(argv, {{"SPDLOG_LEVEL", "warn"}}, 7200);

  std::map<std::string, int64_t> counts;
  for (const auto& kind : kAlarms) counts[kind] = 0;
  for (const auto& kind : kRecords) counts[kind] = 0;
  for (const auto& e : json_lines(dir / "run" / "events.jsonl")) {
    const std::string kind = e.value("kind", "");
    if (counts.contains(kind)) ++counts[kind];
  }
  std::optional<double> max_score;
  int64_t max_step = -1, scored = 0, steps_done = 0;
  for (const auto& m : json_lines(dir / "run" / "metrics.jsonl")) {
    steps_done = std::max(steps_done, m.value("step", int64_t{-1}) + 1);
    if (!m.contains("anomaly_score")) continue;
    ++scored;
    const double score = m.at("anomaly_score").get<double>();
    if (!max_score || score > *max_score) {
      max_score = score;
      max_step = m.at("step").get<int64_t>();
    }
  }
  bool alarms = false;
  for (const auto& kind : kAlarms) alarms = alarms || counts[kind] > 0;
  const bool quiet = result.exit_code == 0 && steps_done == run.steps && !alarms &&
                     (!max_score || *max_score <= threshold / 2);
  nlohmann::json out = {{"run", run.name},   {"sets", run.sets},     {"steps", run.steps},
                        {"steps_done", steps_done}, {"exit_code", result.exit_code}, {"scored_steps", scored},
                        {"events", counts},  {"quiet", quiet}};
  out["max_score"] = max_score ? nlohmann::json(*max_score) : nlohmann::json(nullptr);
  out["max_score_step"] = max_step;
  if (result.exit_code != 0) out["output_tail"] = result.output.substr(result.output.size() - std::min<size_t>(result.output.size(), 2000));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"keel-bench-false-alarms: alarms and anomaly scores of fault-free runs under keeld"};
  int64_t steps = 300, long_steps = 2000;
  size_t runs_wanted = 0;
  bool quick = false, check = false;
  std::string config = KEEL_QUICKSTART_CONFIG, work, only;
  app.add_option("--steps", steps, "steps of each sweep run")->check(CLI::PositiveNumber);
  app.add_option("--runs", runs_wanted, "sweep runs to make, the first of the matrix (0: all 24)");
  app.add_option("--long-steps", long_steps, "steps of the long run of the quickstart job as shipped (0: none)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--quick", quick, "a short sweep: two runs of 150 steps (MoE PP2 warm-up 5, dense DP2 warm-up 1), no long run");
  app.add_flag("--check", check, "exit 1 unless every run is quiet");
  app.add_option("--config", config, "the job every run varies")->check(CLI::ExistingFile);
  app.add_option("--only", only, "only the runs whose name holds this (e.g. moe_, pp2, quickstart)");
  app.add_option("--work", work, "keep the runs in this directory (default: a temporary one, removed)");
  CLI11_PARSE(app, argc, argv);

  auto runs = sweep(quick ? 150 : steps);
  if (quick) {
    std::erase_if(runs, [](const Run& r) { return r.name != "moe_warmup5_pp2" && r.name != "dense_warmup1_dp2"; });
    long_steps = 0;
  } else if (runs_wanted > 0 && runs_wanted < runs.size()) {
    runs.resize(runs_wanted);
  }
  if (long_steps > 0) runs.push_back({"quickstart_as_shipped", long_steps, {}});
  std::erase_if(runs, [&](const Run& r) { return r.name.find(only) == std::string::npos; });
  if (runs.empty()) {
    std::cerr << "keel-bench-false-alarms: no run's name holds \"" << only << "\"\n";
    return 2;
  }

  const auto parsed = keel::common::Config::load(config);
  const double threshold = parsed.health.sdc_anomaly_z;
  std::optional<keel::test::TempDir> temp;
  std::filesystem::path root = work;
  if (work.empty()) root = temp.emplace().path();
  keel::test::PreparedCorpus corpus;
  try {
    corpus = keel::test::prepare_fortunes(root / "data");
  } catch (const std::exception& e) {
    std::cerr << "keel-bench-false-alarms: " << e.what() << "\n";
    return 2;
  }

  nlohmann::json results = nlohmann::json::array();
  int64_t steps_total = 0, steps_run = 0;
  for (const auto& r : runs) steps_total += r.steps;
  const auto start = Clock::now();
  for (const auto& run : runs) {
    results.push_back(measure(run, config, corpus, root / run.name, threshold));
    steps_run += run.steps;
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    const auto& r = results.back();
    std::cerr << fmt::format("keel-bench-false-alarms: {}/{} {}: {}, largest score {} | ETA {:.0f} s\n", results.size(),
                             runs.size(), run.name, r.at("quiet").get<bool>() ? "quiet" : "NOT QUIET",
                             r.at("max_score").dump(), elapsed / static_cast<double>(steps_run) * static_cast<double>(steps_total - steps_run));
  }

  std::optional<double> max_score;
  std::string max_run;
  std::map<std::string, int64_t> totals;
  bool all_quiet = true;
  for (const auto& r : results) {
    all_quiet = all_quiet && r.at("quiet").get<bool>();
    for (const auto& [kind, count] : r.at("events").items()) totals[kind] += count.get<int64_t>();
    if (r.at("max_score").is_number() && (!max_score || r.at("max_score").get<double>() > *max_score)) {
      max_score = r.at("max_score").get<double>();
      max_run = r.at("run").get<std::string>();
    }
  }
  nlohmann::json out = {{"bench", "false_alarms"},
                        {"threshold", threshold},
                        {"target", "no sdc_detected, step_skipped, straggler_flagged, hang_detected or rank_failed; "
                                   "every score at most half the threshold"},
                        {"runs", results.size()},
                        {"events", totals},
                        {"target_met", all_quiet},
                        {"blas", keel::bench::blas_ceiling(0)},
                        {"per_run", results}};
  out["max_score"] = max_score ? nlohmann::json(*max_score) : nlohmann::json(nullptr);
  out["max_score_over_threshold"] = max_score ? nlohmann::json(*max_score / threshold) : nlohmann::json(nullptr);
  out["max_score_run"] = max_run;
  std::cout << out.dump() << std::endl;
  return check && !all_quiet ? 1 : 0;
}
