// keel-bench-dp: data-parallel training throughput on this machine. Trains
// the train_throughput.py model (L=4, C=256, H=4, T=256, global batch 8,
// V=256, fp32) as DP1 and as DP2 at ZeRO-0 and ZeRO-1, with the machine's
// cores split evenly between the ranks, and prints one JSON object per run:
// tokens/s, and the all-reduce and all-gather bytes each rank moved per step
// next to the ZeRO formulas (DESIGN §3.4). Ranks are real keel-trainer
// processes rendezvousing through an embedded Store, started by the test
// launcher (keeld will do this in production).
#include "common/config.h"
#include "tests/support/process.h"
#include "tests/support/rank_launcher.h"
#include "tests/support/temp_dir.h"
#include "tests/trainer/token_fixture.h"
#include "trainer/model/parameters.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <thread>

namespace {

const char* kConfig = R"(
[model]
vocab_size = 256
seq_len = 256
n_layer = 4
n_head = 4
n_embd = 256
[data]
train = "train.bin"
[train]
batch_size = 8
lr = 6e-4
warmup_steps = 1
val_every = 0
)";

struct Measured {
  double tokens_per_s = 0;
  nlohmann::json comm_per_step = nlohmann::json::object();  // from the last step
};

Measured read_metrics(const std::filesystem::path& path, int warmup) {
  std::ifstream in(path);
  std::vector<nlohmann::json> rows;
  for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::json::parse(line));
  if (static_cast<int>(rows.size()) <= warmup) throw std::runtime_error("too few steps in " + path.string());
  double tokens = 0, seconds = 0;
  for (size_t i = static_cast<size_t>(warmup); i < rows.size(); ++i) {
    tokens += 8.0 * 256;
    seconds += rows[i].at("step_ms").get<double>() / 1e3;
  }
  Measured m{tokens / seconds};
  if (rows.back().contains("comm")) m.comm_per_step = rows.back().at("comm");
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"keel-bench-dp: DP1 vs DP2 (ZeRO-0 and ZeRO-1) training throughput and bytes per step"};
  int steps = 12, warmup = 2;
  int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  app.add_option("--steps", steps, "steps per run");
  app.add_option("--warmup", warmup, "first steps left out of the timing");
  app.add_option("--cores", cores, "cores to split between the ranks");
  CLI11_PARSE(app, argc, argv);
  if (steps <= warmup) {
    std::cerr << "keel-bench-dp: --steps must exceed --warmup\n";
    return 2;
  }

  keel::test::TempDir dir;
  keel::test::write_pattern_shard(dir / "train.bin", 1 << 20);
  const auto config_path = dir.write("bench.toml", kConfig);
  const auto config = keel::common::Config::load(config_path);
  const keel::trainer::ParameterTable table(config.model);

  struct Run {
    int dp, zero;
  };
  for (const Run run : {Run{1, 0}, Run{2, 0}, Run{2, 1}}) {
    const std::string name = "dp" + std::to_string(run.dp) + "_zero" + std::to_string(run.zero);
    const int threads = std::max(1, cores / run.dp);
    std::vector<std::string> args = {keel::test::keel_binary("keel-trainer").string(), "--config",
                                     config_path.string()};
    for (const std::string& set : {"job.run_dir=" + (dir / name).string(), "train.steps=" + std::to_string(steps),
                                   "train.threads=" + std::to_string(threads), "parallel.dp=" + std::to_string(run.dp),
                                   "parallel.zero=" + std::to_string(run.zero)}) {
      args.insert(args.end(), {"--set", set});
    }
    std::vector<keel::test::ProcessResult> results;
    if (run.dp == 1) {
      results.push_back(keel::test::run_process(args, {{"SPDLOG_LEVEL", "warn"}}));
    } else {
      keel::test::RankLauncher ranks(run.dp, args, {{"SPDLOG_LEVEL", "warn"}});
      results = ranks.wait_all();
    }
    for (const auto& r : results) {
      if (r.exit_code != 0) {
        std::cerr << "keel-bench-dp: " << name << " failed with exit " << r.exit_code << ":\n" << r.output;
        return 1;
      }
    }
    const Measured m = read_metrics(dir / name / "metrics.jsonl", warmup);

    // The formulas, per rank and step: the flat gradient buffer plus loss,
    // aux and the stop vote through all-reduce; with ZeRO-1 every tensor's
    // padded dim-0 shard through all-gather.
    nlohmann::json formula = nlohmann::json::object();
    if (run.dp > 1) {
      formula["all_reduce"] = 4 * (table.total() + 3);
      if (run.zero >= 1) {
        uint64_t shard = 0;
        for (const auto& spec : table.specs()) {
          const uint64_t rows = static_cast<uint64_t>(spec.shape[0]);
          shard += (rows + run.dp - 1) / run.dp * (spec.numel / rows);
        }
        formula["all_gather"] = 4 * shard;
      }
    }
    nlohmann::json measured_bytes = nlohmann::json::object();
    for (const auto& [op, counts] : m.comm_per_step.items()) measured_bytes[op] = counts.at("bytes");
    nlohmann::json out = {{"bench", "dp_throughput"},
                          {"run", name},
                          {"dp", run.dp},
                          {"zero", run.zero},
                          {"threads_per_rank", threads},
                          {"steps_timed", steps - warmup},
                          {"tokens_per_s", m.tokens_per_s},
                          {"bytes_per_step", measured_bytes},
                          {"formula_bytes_per_step", formula},
                          {"bytes_match_formula", measured_bytes == formula},
                          {"machine", {{"cores", std::thread::hardware_concurrency()}}}};
    std::cout << out.dump() << std::endl;
  }
  return 0;
}
