// Real keel-trainer ranks of a TrainerRuns fixture, each with the progress
// board keeld would give it (KEEL_BOARD), read back through the
// ProgressBoard API: the fixture of the SDC and fault-injection tests.
#pragma once

#include "health/progress_board.h"
#include "tests/support/process.h"
#include "tests/support/rank_launcher.h"
#include "tests/trainer/trainer_runs.h"

#include <doctest/doctest.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <vector>

namespace keel::test {

// One board per rank, created as keeld creates them and removed at the end.
class Boards {
 public:
  explicit Boards(int world) {
    static std::atomic<int> made{0};
    const std::string prefix = "/keel-test." + std::to_string(getpid()) + "." + std::to_string(made++) + ".";
    for (int r = 0; r < world; ++r) {
      names_.push_back(prefix + std::to_string(r));
      boards_.push_back(health::ProgressBoard::create(names_.back()));
    }
  }
  ~Boards() {
    for (const auto& name : names_) health::ProgressBoard::remove(name);
  }
  Boards(const Boards&) = delete;
  Boards& operator=(const Boards&) = delete;

  // `argv` run with KEEL_BOARD naming rank `rank`'s board.
  std::vector<std::string> wrap(int rank, const std::vector<std::string>& argv) const {
    std::vector<std::string> wrapped = {"env", "KEEL_BOARD=" + names_.at(static_cast<size_t>(rank))};
    wrapped.insert(wrapped.end(), argv.begin(), argv.end());
    return wrapped;
  }
  health::ProgressBoard& board(int rank) { return boards_.at(static_cast<size_t>(rank)); }
  health::BoardSnapshot read(int rank) const {
    auto snapshot = boards_.at(static_cast<size_t>(rank)).read();
    REQUIRE(snapshot.has_value());
    return *snapshot;
  }

 private:
  std::vector<std::string> names_;
  std::vector<health::ProgressBoard> boards_;
};

// What each rank of a run printed, with its --json summary.
struct RankResults {
  std::vector<ProcessResult> ranks;
  std::filesystem::path run_dir;
  nlohmann::json summary(int rank) const { return last_json_line(ranks.at(static_cast<size_t>(rank)).output); }
  std::vector<std::string> digests() const {
    std::vector<std::string> out;
    for (size_t r = 0; r < ranks.size(); ++r) out.push_back(summary(static_cast<int>(r)).at("parameter_digest"));
    return out;
  }
  std::vector<std::string> losses() const {
    std::vector<std::string> out;
    std::ifstream in(run_dir / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line).at("loss").dump());
    return out;
  }
};

// Runs `layout` of the fixture to completion in run directory `name`, as
// generation `generation`, with boards when `boards` is given; every rank
// must exit with `exit_code`.
inline RankResults run_ranks(const TrainerRuns& f, const Layout& layout, const std::string& name,
                             std::vector<std::string> sets, Boards* boards = nullptr, int exit_code = 0,
                             const std::map<std::string, std::string>& env = {{"SPDLOG_LEVEL", "warn"}},
                             int64_t generation = 0) {
  auto all = layout.sets();
  all.insert(all.end(), sets.begin(), sets.end());
  const auto argv = f.argv(name, all);
  RankLauncher launcher(
      layout.world(), [&](int r) { return boards != nullptr ? boards->wrap(r, argv) : argv; }, env, generation);
  RankResults results{launcher.wait_all(300), f.dir() / name};
  for (size_t r = 0; r < results.ranks.size(); ++r) {
    CAPTURE(r);
    REQUIRE_MESSAGE(results.ranks[r].exit_code == exit_code, results.ranks[r].output);
  }
  return results;
}

}  // namespace keel::test
