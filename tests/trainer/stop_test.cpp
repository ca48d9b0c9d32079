// SIGTERM and SIGINT mean "stop": the trainer finishes the step in flight,
// keeps every metrics line it wrote, and exits 14 (docs/architecture.md "Worker contract").
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"
#include "tests/support/wait.h"
#include "tests/trainer/token_fixture.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <csignal>
#include <fstream>

namespace {

int metrics_lines(const std::filesystem::path& path) {
  std::ifstream in(path);
  int lines = 0;
  for (std::string line; std::getline(in, line);) {
    CHECK(nlohmann::json::accept(line));  // no torn line
    ++lines;
  }
  return lines;
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("a trainer asked to stop finishes its step and exits 14 with its metrics intact") {
    for (int signo : {SIGTERM, SIGINT}) {
      CAPTURE(signo);
      keel::test::TempDir dir;
      keel::test::write_pattern_shard(dir / "train.bin", 20000);
      dir.write("run.toml", R"(
[model]
seq_len = 32
n_layer = 1
n_head = 2
n_embd = 32
[data]
train = "train.bin"
[train]
steps = 1000000
batch_size = 2
warmup_steps = 1
val_every = 0
threads = 1
)");
      keel::test::ChildProcess trainer({keel::test::keel_binary("keel-trainer").string(), "--config",
                                        (dir / "run.toml").string(), "--set", "job.run_dir=" + (dir / "run").string()});
      const auto metrics = dir / "run" / "metrics.jsonl";
      REQUIRE(keel::test::wait_until([&] { return keel::test::complete_lines(metrics) >= 3; }, 120));
      trainer.signal(signo);
      auto result = trainer.wait(60);
      CAPTURE(result.output);
      CHECK(result.exit_code == 14);
      CHECK(result.output.find("training stopped after") != std::string::npos);
      const int lines = metrics_lines(metrics);
      CHECK(lines >= 3);
      CHECK(lines < 1000000);
    }
  }
}
