// Data parallelism end to end with real processes: N keel-trainer ranks
// rendezvous through an embedded Store and all-reduce over Gloo, and must
// reproduce the single-rank run (DESIGN §3.4: the single-rank run of the
// same config is the oracle for every layout).
#include "tests/support/process.h"
#include "tests/support/rank_launcher.h"
#include "tests/support/temp_dir.h"
#include "common/config.h"
#include "tests/trainer/token_fixture.h"
#include "trainer/model/parameters.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <csignal>
#include <fstream>
#include <thread>

namespace fs = std::filesystem;

namespace {

const char* kConfig = R"(
[model]
seq_len = 32
n_layer = 2
n_head = 2
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

struct Run {
  std::vector<double> losses, grad_norms;
  std::vector<std::string> exact;  // the printed values, for bit-identity
  double val_loss = NAN;
};

Run read_metrics(const fs::path& path) {
  Run run;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    auto record = nlohmann::json::parse(line);
    run.losses.push_back(record.at("loss").get<double>());
    run.grad_norms.push_back(record.at("grad_norm").get<double>());
    run.exact.push_back(record.at("loss").dump() + " " + record.at("grad_norm").dump());
    if (record.contains("val_loss")) run.val_loss = record.at("val_loss").get<double>();
  }
  return run;
}

class Fixture {
 public:
  Fixture() {
    keel::test::write_pattern_shard(dir_ / "train.bin", 30000);
    config_ = dir_.write("run.toml", kConfig);
  }

  std::vector<std::string> argv(const std::string& run, const std::vector<std::string>& sets) const {
    std::vector<std::string> args = {keel::test::keel_binary("keel-trainer").string(), "--config", config_.string(),
                                     "--set", "job.run_dir=" + (dir_ / run).string()};
    for (const auto& s : sets) args.insert(args.end(), {"--set", s});
    return args;
  }

  Run single(const std::string& run, const std::vector<std::string>& sets = {}) const {
    auto result = keel::test::run_process(argv(run, sets), {{"SPDLOG_LEVEL", "warn"}});
    REQUIRE_MESSAGE(result.exit_code == 0, result.output);
    return read_metrics(dir_ / run / "metrics.jsonl");
  }

  // Runs dp ranks to completion and returns each rank's output.
  std::vector<std::string> data_parallel_outputs(int dp, const std::string& run, std::vector<std::string> sets) const {
    sets.push_back("parallel.dp=" + std::to_string(dp));
    auto args = argv(run, sets);
    args.push_back("--json");
    keel::test::RankLauncher ranks(dp, args, {{"SPDLOG_LEVEL", "warn"}});
    std::vector<std::string> outputs;
    for (const auto& result : ranks.wait_all(300)) {
      CAPTURE(outputs.size());
      REQUIRE_MESSAGE(result.exit_code == 0, result.output);
      outputs.push_back(result.output);
    }
    return outputs;
  }

  Run data_parallel(int dp, const std::string& run, std::vector<std::string> sets = {}) const {
    data_parallel_outputs(dp, run, std::move(sets));
    return read_metrics(dir_ / run / "metrics.jsonl");
  }

  const fs::path& dir() const { return dir_.path(); }

 private:
  keel::test::TempDir dir_;
  fs::path config_;
};

void check_parity(const Run& reference, const Run& parallel) {
  REQUIRE(parallel.losses.size() == reference.losses.size());
  for (size_t s = 0; s < reference.losses.size(); ++s) {
    CAPTURE(s);
    CHECK(std::fabs(parallel.losses[s] - reference.losses[s]) <= 1e-5 * std::fabs(reference.losses[s]));
    CHECK(std::fabs(parallel.grad_norms[s] - reference.grad_norms[s]) <= 1e-4 * std::fabs(reference.grad_norms[s]));
  }
  CHECK(std::fabs(parallel.val_loss - reference.val_loss) <= 1e-5 * std::fabs(reference.val_loss));
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("DP2 and DP4 with ZeRO-0 and ZeRO-1 reproduce the single-rank loss sequence over 20 steps") {
    Fixture f;
    const Run reference = f.single("single");
    REQUIRE(reference.losses.size() == 20);
    SUBCASE("dp2") { check_parity(reference, f.data_parallel(2, "dp2")); }
    SUBCASE("dp2 with two microbatches") {
      check_parity(reference, f.data_parallel(2, "dp2m2", {"parallel.micro_batches=2"}));
    }
    SUBCASE("dp4") { check_parity(reference, f.data_parallel(4, "dp4")); }
    SUBCASE("dp2 zero1") { check_parity(reference, f.data_parallel(2, "dp2z1", {"parallel.zero=1"})); }
    SUBCASE("dp4 zero1 with two microbatches") {
      check_parity(reference, f.data_parallel(4, "dp4z1m2", {"parallel.zero=1", "train.batch_size=8",
                                                               "parallel.micro_batches=2"}));
    }
  }

  TEST_CASE("each rank holds the fp32 ZeRO-0 and ZeRO-1 bytes for parameters and gradients and optimizer state") {
    Fixture f;
    keel::common::Config config = keel::common::Config::load(f.dir() / "run.toml");
    const double P = static_cast<double>(keel::trainer::ParameterTable(config.model).parameter_count());
    for (int zero : {0, 1}) {
      for (int dp : {2, 4}) {
        CAPTURE(zero);
        CAPTURE(dp);
        auto outputs = f.data_parallel_outputs(dp, "mem" + std::to_string(zero) + std::to_string(dp),
                                               {"parallel.zero=" + std::to_string(zero), "train.steps=2"});
        for (const auto& output : outputs) {
          auto memory = keel::test::last_json_line(output).at("memory");
          // Formulas: parameters and gradients 4P each; Adam moments 8P, or
          // 8P/dp when sharded (ZeRO-1).
          const double optimizer = zero >= 1 ? 8 * P / dp : 8 * P;
          CHECK(std::fabs(memory.at("params_bytes").get<double>() - 4 * P) <= 0.05 * 4 * P);
          CHECK(std::fabs(memory.at("grads_bytes").get<double>() - 4 * P) <= 0.05 * 4 * P);
          CHECK(std::fabs(memory.at("optimizer_bytes").get<double>() - optimizer) <= 0.05 * optimizer);
        }
      }
    }
  }

  TEST_CASE("a DP step's byte counters equal the ZeRO-0 and ZeRO-1 formulas") {
    Fixture f;
    keel::common::Config config = keel::common::Config::load(f.dir() / "run.toml");
    const keel::trainer::ParameterTable table(config.model);
    const int dp = 2;
    // All-reduce: the flat gradient buffer (alignment gaps included) in
    // 16 MiB buckets, then loss and aux loss, then the stop vote; a
    // validation step adds the validation sum.
    const uint64_t gradient_floats = table.total();
    const uint64_t buckets = (gradient_floats + (uint64_t{4} << 20) - 1) / (uint64_t{4} << 20);
    // ZeRO-1 all-gather: every tensor's dim-0 shard padded to ceil(rows/dp) rows.
    uint64_t shard_floats = 0;
    for (const auto& spec : table.specs()) {
      const uint64_t rows = static_cast<uint64_t>(spec.shape[0]);
      shard_floats += (rows + dp - 1) / dp * (spec.numel / rows);
    }
    for (int zero : {0, 1}) {
      CAPTURE(zero);
      const std::string run = "volume" + std::to_string(zero);
      f.data_parallel(dp, run, {"parallel.zero=" + std::to_string(zero)});
      std::ifstream in(f.dir() / run / "metrics.jsonl");
      int steps = 0;
      for (std::string line; std::getline(in, line); ++steps) {
        auto comm = nlohmann::json::parse(line)["comm"];
        const int validated = line.find("val_loss") != std::string::npos ? 1 : 0;
        CAPTURE(line);
        CHECK(comm["all_reduce"]["bytes"] == 4 * (gradient_floats + 2 + 1 + validated));
        CHECK(comm["all_reduce"]["calls"] == buckets + 2 + validated);
        if (zero == 0) {
          CHECK(comm.size() == 1);
        } else {
          CHECK(comm["all_gather"]["bytes"] == 4 * shard_floats);
          CHECK(comm["all_gather"]["calls"] == 1);
          CHECK(comm.size() == 2);
        }
      }
      CHECK(steps == 20);
    }
  }

  TEST_CASE("two DP2 runs of one config are bit-identical") {
    Fixture f;
    CHECK(f.data_parallel(2, "a").exact == f.data_parallel(2, "b").exact);
  }

  TEST_CASE("a rank killed mid-step makes every survivor exit 12 within the timeout and dump its flight recorder") {
    Fixture f;
    const double timeout_s = 5;
    keel::test::RankLauncher ranks(
        3, f.argv("killed", {"parallel.dp=3", "train.batch_size=3", "train.steps=1000000", "train.val_every=0",
                              "parallel.timeout_s=" + std::to_string(timeout_s)}),
        {{"SPDLOG_LEVEL", "warn"}});
    const fs::path metrics = f.dir() / "killed" / "metrics.jsonl";
    for (int i = 0; i < 600; ++i) {
      std::ifstream in(metrics);
      if (std::count(std::istreambuf_iterator<char>(in), {}, '\n') >= 3) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    const auto killed_at = std::chrono::steady_clock::now();
    ranks.rank(1).signal(SIGKILL);
    for (int r : {0, 2}) {
      CAPTURE(r);
      auto result = ranks.rank(r).wait(timeout_s + 30);
      const double after = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
      CAPTURE(result.output);
      CHECK(result.exit_code == 12);
      CHECK(after <= timeout_s + 5);
      const fs::path dump = f.dir() / "killed" / "flight" / (r == 0 ? "rank-00000.json" : "rank-00002.json");
      REQUIRE(fs::exists(dump));
      std::ifstream in(dump);
      auto flight = nlohmann::json::parse(in);
      CHECK_FALSE(flight.dump().find("failed") == std::string::npos);
    }
    CHECK(ranks.rank(1).wait(5).exit_code == 128 + SIGKILL);
  }
}
