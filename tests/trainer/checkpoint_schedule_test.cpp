// Saves by time (docs/architecture.md "Commit protocol"): with only
// checkpoint.every_seconds set, the ranks of a multi-rank run commit
// checkpoints, and the vote makes every rank save the same steps.
#include "checkpoint/catalog.h"
#include "checkpoint/manifest.h"
#include "checkpoint/paths.h"
#include "tests/support/wait.h"
#include "tests/trainer/trainer_runs.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <csignal>
#include <fstream>
#include <set>

namespace fs = std::filesystem;
using keel::test::Layout;
using keel::test::TrainerRuns;

TEST_SUITE("integration") {
  TEST_CASE("a multi-rank run with only checkpoint.every_seconds commits checkpoints that every rank saved") {
    TrainerRuns f;
    const Layout layout{2, 1, 0};
    auto sets = layout.sets();
    // keep: every save stays, to be checked; timeout_s: a save that one
    // rank skips is abandoned within the test, not after ten minutes.
    sets.insert(sets.end(), {"train.steps=1000000", "train.val_every=0", "checkpoint.every_steps=0",
                             "checkpoint.keep=1000", "checkpoint.timeout_s=10"});
    // The ranks' deadlines differ on purpose, as clocks and start times do
    // between machines: rank 0 wants a save every 0.25 s, rank 1 every
    // 0.4 s. Only the vote makes them save the same steps.
    keel::test::RankLauncher ranks(
        layout.world(),
        [&](int rank) {
          return f.argv("timed", sets, {"--set", rank == 0 ? "checkpoint.every_seconds=0.25" : "checkpoint.every_seconds=0.4"});
        },
        {{"SPDLOG_LEVEL", "warn"}});
    const fs::path root = f.dir() / "timed" / "checkpoints";
    auto count_events = [&](const std::string& kind) {
      int n = 0;
      std::ifstream in(f.dir() / "timed" / "events.jsonl");
      for (std::string line; std::getline(in, line);) n += nlohmann::json::parse(line).at("kind") == kind;
      return n;
    };
    // Until three saves by time are committed, or one is abandoned.
    REQUIRE_MESSAGE(keel::test::wait_until(
                        [&] {
                          return keel::checkpoint::committed(root).size() >= 3 || count_events("checkpoint_abandoned") > 0;
                        },
                        300),
                    "three checkpoints by time were never committed");
    for (int r = 0; r < layout.world(); ++r) ranks.rank(r).signal(SIGTERM);
    for (const auto& result : ranks.wait_all(120)) {
      CAPTURE(result.output);
      CHECK(result.exit_code == 14);
    }

    const auto committed = keel::checkpoint::committed(root);
    CHECK(committed.size() >= 4);  // three by time, and the final save of the stop
    const std::set<std::string> every_file = {keel::checkpoint::rank_file_name(0), keel::checkpoint::rank_file_name(1),
                                              keel::checkpoint::kIndexFile};
    for (const auto& entry : committed) {
      CAPTURE(entry.step);
      const auto manifest = keel::checkpoint::read_manifest(entry.dir);
      CHECK(manifest.step == entry.step);
      std::set<std::string> files;
      for (const auto& file : manifest.files) files.insert(file.name);
      CHECK(files == every_file);
      CHECK(keel::checkpoint::verify_files(entry.dir, manifest).empty());
    }
    // No save was abandoned: no rank saved a step the other skipped.
    CHECK(count_events("checkpoint_abandoned") == 0);
    CHECK(count_events("checkpoint_committed") == static_cast<int>(committed.size()));
  }
}
