// Suspect checkpoints moved aside (daemon/checkpoint_quarantine.h) on real
// checkpoint directories: renamed out of the step_%08d pattern, never
// deleted, invisible to the resume choice, left alone by the checkpointer
// that starts next.
#include "daemon/checkpoint_quarantine.h"
#include "tests/support/checkpoint_fixture.h"
#include "tests/support/temp_dir.h"

#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace keel::daemon {
namespace fs = std::filesystem;

TEST_SUITE("unit") {
  TEST_CASE("checkpoints after the last good step are moved aside and never deleted") {
    test::TempDir dir;
    const fs::path root = dir / "checkpoints";
    test::write_fixture_checkpoints(root, {4, 8, 12, 16});
    fs::create_directories(root / "step_00000020.partial");  // a save in flight when the ranks were killed
    fs::create_directories(root / "step_00000006.partial");
    fs::create_directories(root / "unrelated");

    const Quarantine q = quarantine_checkpoints(root, 8, 3);
    CHECK(q.errors.empty());
    CHECK(q.steps == std::vector<int64_t>{12, 16});
    CHECK(q.moved == std::vector<std::string>{"step_00000012.suspect-g3", "step_00000016.suspect-g3",
                                              "step_00000020.partial.suspect-g3"});
    CHECK(test::committed_steps(root) == std::vector<int64_t>{4, 8});
    for (const char* kept : {"step_00000012.suspect-g3/manifest.json", "step_00000016.suspect-g3/rank-00000.h5",
                             "step_00000020.partial.suspect-g3", "step_00000006.partial", "unrelated"}) {
      CAPTURE(kept);
      CHECK(fs::exists(root / kept));
    }
    const auto resume =
        checkpoint::choose_resume(root, {checkpoint::Depth::kChecksums}, [](const fs::path&, const std::string&) {});
    REQUIRE(resume);
    CHECK(resume->step == 8);

    // The next run saves step 12 again beside the suspect one, and its
    // start-up clean-up leaves the moved .partial alone.
    test::write_fixture_checkpoints(root, {12});
    CHECK(test::committed_steps(root) == std::vector<int64_t>{4, 8, 12});
    CHECK(fs::exists(root / "step_00000020.partial.suspect-g3"));

    // Moved aside again under the same generation's name: a counter, nothing replaced.
    const Quarantine again = quarantine_checkpoints(root, 8, 3);
    CHECK(again.errors.empty());
    CHECK(again.moved == std::vector<std::string>{"step_00000012.suspect-g3.1"});
    CHECK(fs::exists(root / "step_00000012.suspect-g3/manifest.json"));

    // Nothing known good: every checkpoint goes.
    const Quarantine all = quarantine_checkpoints(root, -1, 4);
    CHECK(all.steps == std::vector<int64_t>{4, 8});
    CHECK(test::committed_steps(root).empty());

    // Nothing to move, or no directory at all: nothing happens.
    CHECK(quarantine_checkpoints(root, -1, 5).moved.empty());
    const Quarantine missing = quarantine_checkpoints(dir / "none", 0, 1);
    CHECK(missing.moved.empty());
    CHECK(missing.errors.empty());
  }
}

}  // namespace keel::daemon
