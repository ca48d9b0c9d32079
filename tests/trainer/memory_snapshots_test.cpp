// Rank 0's choice of the in-memory snapshot every rank holds
// (trainer/train/memory_snapshots.h), as data: the ranks' reports in, the
// step or the reason out; a report that is not one is a sentence; and a
// rank's vote for its next copy step.
#include "trainer/train/memory_snapshots.h"

#include <doctest/doctest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "tests/support/wait.h"
#include "trainer/kernels/cpu_backend.h"

using keel::checkpoint::SnapshotArea;
using keel::trainer::choose_snapshot;
using keel::trainer::MemorySnapshots;
using keel::trainer::SnapshotReport;

namespace {

struct Memfd {
  int fd = memfd_create("keel-snapshots-test", 0);
  ~Memfd() { close(fd); }
};

using Reports = std::vector<std::optional<SnapshotReport>>;

SnapshotReport holds(std::vector<int64_t> steps, std::vector<std::string> problems = {}) {
  return SnapshotReport{std::move(steps), std::move(problems)};
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("rank 0 takes the newest step every rank holds or says which rank lacks one") {
    struct Row {
      const char* name;
      Reports reports;
      std::optional<int64_t> step;
      std::string why;  // a part of it; empty: none
    };
    const Row rows[] = {
        {"every rank holds the same steps", {holds({9, 8}), holds({9, 8})}, 9, ""},
        {"one rank is a step behind", {holds({9, 8}), holds({8, 7})}, 8, ""},
        {"a corrupted newest on one rank",
         {holds({9, 8}),
          holds({8}, {"the in-memory snapshot of step 9 (slot 2) does not match its checksum in /model/wte"})},
         8,
         "rank 1: the in-memory snapshot of step 9 (slot 2) does not match its checksum"},
        {"a rank whose area is empty", {holds({9}), holds({})}, std::nullopt, "rank 1 holds no in-memory snapshot"},
        {"a rank whose only snapshot does not verify",
         {holds({9}), holds({}, {"the in-memory snapshot of step 9 (slot 0) is of another layout"})},
         std::nullopt,
         "rank 1 holds no in-memory snapshot that verifies: the in-memory snapshot of step 9 (slot 0) is of another "
         "layout"},
        {"a rank without an area", {holds({9}), std::nullopt}, std::nullopt, "rank 1 keeps no in-memory snapshots"},
        {"no step in common", {holds({9, 8}), holds({7, 6})}, std::nullopt, "no step is held in memory by every rank"},
        {"one rank", {holds({3, 2, 1})}, 3, ""},
    };
    for (const Row& row : rows) {
      CAPTURE(std::string(row.name));
      const auto choice = choose_snapshot(row.reports);
      CHECK(choice.step == row.step);
      if (row.why.empty()) {
        CHECK(choice.why.empty());
      } else {
        CHECK_MESSAGE(choice.why.find(row.why) != std::string::npos, choice.why);
      }
    }
  }

  TEST_CASE("a snapshot report that is not one is a peer failure naming the rank") {
    const char* bad[] = {R"({"steps": [1]})", R"({"steps": "1", "problems": []})", R"([1, 2])",
                         R"({"steps": [1.5], "problems": []})"};
    for (const char* text : bad) {
      CAPTURE(std::string(text));
      try {
        SnapshotReport::from_json(nlohmann::json::parse(text), 3);
        FAIL("accepted");
      } catch (const keel::common::Error& e) {
        CHECK(e.code() == keel::common::ErrorCode::kPeerFailure);
        CHECK(std::string(e.what()).find("rank 3") != std::string::npos);
      }
    }
    const auto good = holds({4, 3}, {"x"});
    const auto back = SnapshotReport::from_json(good.to_json(), 0);
    CHECK(back.steps == good.steps);
    CHECK(back.problems == good.problems);
  }

  TEST_CASE("a rank is ready for its next copy step once the buddy holds its last one") {
    keel::trainer::CpuBackend backend(1);
    const std::vector<keel::checkpoint::Piece> pieces = {{"model", "w", {4, 4}, 0, 0, 4, 4}};
    std::vector<float> state(16, 1.0f);
    MemorySnapshots::Options options{2, 1, 0.02, 0x1a, 1, false};
    // Snapshots keeld does not copy are never copy steps.
    Memfd alone;
    CHECK_FALSE(MemorySnapshots(alone.fd, options, backend).ready_to_copy());

    options.copied = true;
    Memfd area;
    MemorySnapshots snapshots(area.fd, options, backend);
    CHECK(snapshots.ready_to_copy());  // no copy step taken yet
    snapshots.save(pieces, {state.data()}, 1, 10, /*copy_step=*/false, {});
    CHECK(snapshots.ready_to_copy());
    snapshots.save(pieces, {state.data()}, 2, 20, /*copy_step=*/true, {});
    CHECK_FALSE(snapshots.ready_to_copy());
    // Committed, then held by the buddy: keeld marks the slot.
    std::optional<keel::checkpoint::SnapshotImage> image;
    REQUIRE(keel::test::wait_until([&] { return (image = SnapshotArea(area.fd, 2).image_of(2)).has_value(); }, 30));
    CHECK_FALSE(snapshots.ready_to_copy());
    REQUIRE(SnapshotArea(area.fd, 2).mark_copied(2, image->sequence));
    CHECK(snapshots.ready_to_copy());
    // More snapshots keep that copy step, and the next copy step waits again.
    for (int64_t step = 3; step <= 8; ++step) snapshots.save(pieces, {state.data()}, step, 10 * step, false, {});
    CHECK(snapshots.ready_to_copy());
    snapshots.save(pieces, {state.data()}, 9, 90, true, {});
    CHECK_FALSE(snapshots.ready_to_copy());
  }
}
