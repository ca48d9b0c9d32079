// Real keel-trainer runs of one small model in a temporary directory, in
// any DP x TP x PP x CP x ZeRO layout, with their metrics read back: the fixture of
// the layout parity and checkpoint tests.
#pragma once

#include "checkpoint/reader.h"
#include "common/config.h"
#include "tests/support/process.h"
#include "tests/support/rank_launcher.h"
#include "tests/support/temp_dir.h"
#include "tests/trainer/token_fixture.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace keel::test {

// n_head = 4 so that TP4 holds one head per rank; vocab 256 splits evenly.
inline const char* kTrainerRunsConfig = R"(
[model]
seq_len = 32
n_layer = 2
n_head = 4
n_embd = 32
[data]
train = "train.bin"
val = "train.bin"
[train]
steps = 20
batch_size = 8
lr = 3e-3
warmup_steps = 2
val_every = 10
val_batches = 4
threads = 1
)";

struct Layout {
  int dp = 1;
  int tp = 1;
  int zero = 0;
  int micro_batches = 1;
  int pp = 1;
  int cp = 1;
  int ep = 1;
  int pp_virtual = 1;
  bool zero_bubble = false;  // parallel.pp_schedule = "zb-h1"

  int world() const { return dp * tp * pp * cp; }
  std::string name() const {
    return "dp" + std::to_string(dp) + "tp" + std::to_string(tp) + (pp > 1 ? "pp" + std::to_string(pp) : "") +
           (pp_virtual > 1 ? "v" + std::to_string(pp_virtual) : "") + (cp > 1 ? "cp" + std::to_string(cp) : "") +
           (ep > 1 ? "ep" + std::to_string(ep) : "") + (zero_bubble ? "zb" : "") + "z" + std::to_string(zero) + "m" +
           std::to_string(micro_batches);
  }
  std::vector<std::string> sets() const {
    return {"parallel.dp=" + std::to_string(dp),
            "parallel.tp=" + std::to_string(tp),
            "parallel.pp=" + std::to_string(pp),
            "parallel.cp=" + std::to_string(cp),
            "parallel.ep=" + std::to_string(ep),
            "parallel.zero=" + std::to_string(zero),
            "parallel.micro_batches=" + std::to_string(micro_batches),
            "parallel.pp_virtual=" + std::to_string(pp_virtual),
            std::string("parallel.pp_schedule=") + (zero_bubble ? "zb-h1" : "1f1b")};
  }
  // Rank r's coordinates (docs/architecture.md "Parallel layout and
  // communication": TP innermost, PP outermost; an EP group is ep
  // consecutive dp x cp ranks).
  int tp_rank(int r) const { return r % tp; }
  int pp_rank(int r) const { return r / (dp * cp * tp); }
  int ep_rank(int r) const { return (r / tp) % (dp * cp) % ep; }
};

struct Run {
  std::vector<double> losses, grad_norms;
  std::vector<std::string> exact;  // the printed values, for bit-identity
  std::vector<nlohmann::json> records;
  double val_loss = NAN;
  std::vector<std::string> outputs;  // each rank's stdout and stderr
};

class TrainerRuns {
 public:
  TrainerRuns() {
    write_pattern_shard(dir_ / "train.bin", 30000);
    config_ = dir_.write("run.toml", kTrainerRunsConfig);
  }

  keel::common::Config config(const std::vector<std::string>& sets = {}) const {
    return keel::common::Config::load(config_, sets);
  }
  const std::filesystem::path& dir() const { return dir_.path(); }

  // keel-trainer's command line for run directory `run`: the config,
  // --json, the gradient dump of the first step into run/grads, `sets` as
  // --set arguments, then `args`.
  std::vector<std::string> argv(const std::string& run, const std::vector<std::string>& sets,
                                const std::vector<std::string>& args = {}) const {
    std::vector<std::string> argv = {keel_binary("keel-trainer").string(), "--config", config_.string(),
                                     "--set", "job.run_dir=" + (dir_ / run).string(), "--json",
                                     "--dump-gradients", (dir_ / run / "grads").string()};
    for (const auto& s : sets) argv.insert(argv.end(), {"--set", s});
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
  }

  // Runs `layout` to completion in run directory `name` (a single rank
  // without the worker environment, which is how the oracle runs); every
  // rank must exit with `exit_code`. `env` adds to the ranks' environment.
  Run run(const Layout& layout, const std::string& name, std::vector<std::string> extra = {},
          const std::vector<std::string>& args = {}, int exit_code = 0,
          std::map<std::string, std::string> env = {}) const {
    auto sets = layout.sets();
    sets.insert(sets.end(), extra.begin(), extra.end());
    Run run;
    if (layout.world() == 1) {
      auto result = run_process(argv(name, sets, args), {{"SPDLOG_LEVEL", "warn"}});
      REQUIRE_MESSAGE(result.exit_code == exit_code, result.output);
      run.outputs.push_back(result.output);
    } else {
      env.try_emplace("SPDLOG_LEVEL", "warn");
      RankLauncher ranks(layout.world(), argv(name, sets, args), env);
      for (const auto& result : ranks.wait_all(300)) {
        CAPTURE(run.outputs.size());
        REQUIRE_MESSAGE(result.exit_code == exit_code, result.output);
        run.outputs.push_back(result.output);
      }
    }
    std::ifstream in(dir_ / name / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      auto record = nlohmann::json::parse(line);
      run.losses.push_back(record.at("loss").get<double>());
      run.grad_norms.push_back(record.at("grad_norm").get<double>());
      run.exact.push_back(record.at("loss").dump() + " " + record.at("grad_norm").dump());
      if (record.contains("val_loss")) run.val_loss = record.at("val_loss").get<double>();
      run.records.push_back(std::move(record));
    }
    return run;
  }

 private:
  TempDir dir_;
  std::filesystem::path config_;
};

// Every tensor of a checkpoint, read whole through keel's reader.
inline std::map<std::string, std::vector<float>> all_tensors(const std::filesystem::path& dir) {
  checkpoint::CheckpointReader reader(dir);
  std::map<std::string, std::vector<float>> tensors;
  for (const auto& name : reader.tensors()) {
    const auto shape = reader.global_shape(name);
    const int64_t cols = shape.size() == 2 ? shape[1] : 1;
    auto& data = tensors[name];
    data.resize(static_cast<size_t>(shape[0] * cols));
    reader.read(name, 0, 0, shape[0], cols, data.data());
  }
  return tensors;
}

inline std::vector<nlohmann::json> events(const std::filesystem::path& run_dir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run_dir / "events.jsonl");
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

inline int count_events(const std::filesystem::path& run_dir, const std::string& kind) {
  int n = 0;
  for (const auto& e : events(run_dir)) n += e.at("kind") == kind ? 1 : 0;
  return n;
}

}  // namespace keel::test
