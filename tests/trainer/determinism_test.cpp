// The same config, seed and build give bit-identical losses run after run
// (docs/architecture.md "Kernels"): two real keel-trainer processes are compared line by line.
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"
#include "tests/trainer/token_fixture.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <fstream>

namespace {

std::vector<std::string> losses_of(const std::filesystem::path& metrics) {
  std::vector<std::string> losses;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    auto record = nlohmann::json::parse(line);
    // Compare the exact printed value, not a rounded one.
    losses.push_back(record.at("loss").dump() + " " + record.at("grad_norm").dump());
  }
  return losses;
}

keel::test::ProcessResult train(const keel::test::TempDir& dir, const std::string& run, const std::string& seed) {
  return keel::test::run_process({keel::test::keel_binary("keel-trainer").string(), "--config",
                                  (dir / "run.toml").string(), "--set", "job.run_dir=" + (dir / run).string(),
                                  "--set", "job.seed=" + seed});
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("two runs of one config give bit-identical loss sequences and another seed does not") {
    keel::test::TempDir dir;
    keel::test::write_pattern_shard(dir / "train.bin", 20000);
    dir.write("run.toml", R"(
[model]
seq_len = 32
n_layer = 2
n_head = 2
n_embd = 32
n_expert = 4
moe_every = 2
[data]
train = "train.bin"
val = "train.bin"
[parallel]
micro_batches = 2
[train]
steps = 12
batch_size = 4
warmup_steps = 2
val_every = 6
val_batches = 2
threads = 2
)");
    auto first = train(dir, "a", "1");
    auto second = train(dir, "b", "1");
    auto other = train(dir, "c", "2");
    REQUIRE_MESSAGE(first.exit_code == 0, first.output);
    REQUIRE_MESSAGE(second.exit_code == 0, second.output);
    REQUIRE_MESSAGE(other.exit_code == 0, other.output);
    auto a = losses_of(dir / "a" / "metrics.jsonl");
    auto b = losses_of(dir / "b" / "metrics.jsonl");
    auto c = losses_of(dir / "c" / "metrics.jsonl");
    CHECK(a.size() == 12);
    CHECK(a == b);
    CHECK(a != c);
  }
}
