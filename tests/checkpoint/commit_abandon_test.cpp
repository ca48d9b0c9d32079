// The commit protocol when a rank lets rank 0 down (docs/architecture.md "Commit protocol"): a
// rank that reports a failed file, and a rank that never reports within
// checkpoint.timeout_s. Rank 0 abandons the save: no committed directory,
// no .partial left behind, a checkpoint_abandoned event naming the cause,
// and the next save of the same Checkpointer commits. Two Checkpointers
// of a world of two share an in-memory Store, as two ranks share keeld's.
#include "checkpoint/catalog.h"
#include "checkpoint/manifest.h"
#include "checkpoint/paths.h"
#include "tests/support/checkpoint_fixture.h"
#include "tests/support/memory_store.h"
#include "tests/support/temp_dir.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <memory>

namespace fs = std::filesystem;
using keel::checkpoint::Checkpointer;

namespace {

std::vector<nlohmann::json> events_of(const fs::path& run_dir, const std::string& kind) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run_dir / "events.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto event = nlohmann::json::parse(line);
    if (event.at("kind") == kind) out.push_back(std::move(event));
  }
  return out;
}

std::vector<int64_t> committed_steps(const fs::path& root) {
  std::vector<int64_t> steps;
  for (const auto& e : keel::checkpoint::committed(root)) steps.push_back(e.step);
  return steps;
}

// Both ranks save `step`, rank 1 first and reported before rank 0 starts,
// so that rank 0's commit never depends on its timeout; rank 0 must commit.
void save_and_commit(Checkpointer& rank0, Checkpointer& rank1, const fs::path& root, int64_t step) {
  keel::test::save_fixture_async(rank1, keel::test::fixture_pieces_of_rank(1), step);
  REQUIRE(rank1.wait());
  keel::test::save_fixture_async(rank0, keel::test::fixture_pieces_of_rank(0), step);
  REQUIRE(rank0.wait());
  const fs::path dir = keel::checkpoint::step_dir(root, step);
  const auto manifest = keel::checkpoint::read_manifest(dir);
  CHECK(manifest.files.size() == 3);  // both rank files and the index
  CHECK(keel::checkpoint::verify_files(dir, manifest).empty());
}

void check_abandoned(const fs::path& root, const fs::path& run_dir, int64_t step, const std::string& cause) {
  CHECK(committed_steps(root).empty());
  CHECK_FALSE(fs::exists(keel::checkpoint::partial_dir(root, step)));
  const auto abandoned = events_of(run_dir, "checkpoint_abandoned");
  REQUIRE(abandoned.size() == 1);
  CHECK(abandoned[0].at("step") == step);
  CHECK(abandoned[0].at("rank") == 0);
  INFO(abandoned[0].dump());
  CHECK(abandoned[0].at("cause").get<std::string>().find(cause) != std::string::npos);
  CHECK(events_of(run_dir, "checkpoint_committed").empty());
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("a rank that reports a failed file makes rank 0 abandon the save and the next save commits") {
    keel::test::TempDir dir;
    const fs::path root = dir / "ckpt";
    fs::create_directories(root);
    keel::test::MemoryStore store;
    Checkpointer rank0(keel::test::two_rank_options(0, root, dir.path(), 60), &store);
    {
      // Rank 1's checkpoint directory cannot be made (its mount is a file,
      // as on a node whose shared filesystem went away): its save fails.
      const fs::path broken = dir.write("not-a-directory", "");
      Checkpointer rank1(keel::test::two_rank_options(1, broken / "ckpt", dir.path(), 60), &store);
      keel::test::save_fixture_async(rank1, keel::test::fixture_pieces_of_rank(1), 1);
      keel::test::save_fixture_async(rank0, keel::test::fixture_pieces_of_rank(0), 1);
      CHECK_FALSE(rank1.wait());
      CHECK_FALSE(rank0.wait());
    }
    check_abandoned(root, dir.path(), 1, keel::checkpoint::rank_file_name(1));

    // The run goes on: the same rank 0 commits the next save.
    Checkpointer rank1(keel::test::two_rank_options(1, root, dir.path(), 60), &store);
    save_and_commit(rank0, rank1, root, 2);
    CHECK(committed_steps(root) == std::vector<int64_t>{2});
    CHECK(events_of(dir.path(), "checkpoint_committed").size() == 1);
  }

  TEST_CASE("a rank that never reports makes rank 0 abandon the save after its timeout and the next save commits") {
    keel::test::TempDir dir;
    const fs::path root = dir / "ckpt";
    fs::create_directories(root);
    keel::test::MemoryStore store;
    const double timeout_s = 0.5;
    Checkpointer rank0(keel::test::two_rank_options(0, root, dir.path(), timeout_s), &store);
    Checkpointer rank1(keel::test::two_rank_options(1, root, dir.path(), timeout_s), &store);
    // Rank 1 is alive but never saves step 1, as a rank that hangs or died.
    const auto start = std::chrono::steady_clock::now();
    keel::test::save_fixture_async(rank0, keel::test::fixture_pieces_of_rank(0), 1);
    CHECK_FALSE(rank0.wait());
    CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >= timeout_s);
    check_abandoned(root, dir.path(), 1, "rank 1");

    save_and_commit(rank0, rank1, root, 2);
    CHECK(committed_steps(root) == std::vector<int64_t>{2});
  }
}
