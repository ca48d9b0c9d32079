// The ranks' reports in the commit protocol (docs/architecture.md "Commit
// protocol"): rank 0 writes index.h5 from the piece lists the reports carry,
// so it never opens a file another rank (on another node) wrote; and a
// report that is not one, from the Store, abandons the save with a sentence
// naming the rank, never a crash.
#include <doctest/doctest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "checkpoint/manifest.h"
#include "checkpoint/paths.h"
#include "checkpoint/rank_report.h"
#include "checkpoint/reader.h"
#include "common/error.h"
#include "tests/support/checkpoint_fixture.h"
#include "tests/support/memory_store.h"
#include "tests/support/temp_dir.h"

namespace fs = std::filesystem;
using keel::checkpoint::Checkpointer;
using keel::checkpoint::RankReport;

namespace {

std::string last_event_cause(const fs::path& run_dir) {
  std::string cause;
  std::ifstream in(run_dir / "events.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto event = nlohmann::json::parse(line);
    if (event.at("kind") == "checkpoint_abandoned") cause = event.at("cause");
  }
  return cause;
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("rank 0 commits from the reports alone without opening the file another node's rank wrote") {
    keel::test::TempDir dir;
    const fs::path root = dir / "ckpt";
    // Rank 1 writes to its own disk: rank 0 could not open its file if it tried.
    const fs::path elsewhere = dir / "other-node";
    keel::test::MemoryStore store;
    Checkpointer rank0(keel::test::two_rank_options(0, root, dir.path(), 60), &store);
    Checkpointer rank1(keel::test::two_rank_options(1, elsewhere, dir.path(), 60), &store);
    keel::test::save_fixture_async(rank1, keel::test::fixture_pieces_of_rank(1), 4);
    REQUIRE(rank1.wait());
    keel::test::save_fixture_async(rank0, keel::test::fixture_pieces_of_rank(0), 4);
    REQUIRE(rank0.wait());

    // What a shared filesystem would have shown rank 0 all along.
    const fs::path step = keel::checkpoint::step_dir(root, 4);
    const std::string file1 = keel::checkpoint::rank_file_name(1);
    fs::copy_file(keel::checkpoint::partial_dir(elsewhere, 4) / file1, step / file1);
    CHECK(keel::checkpoint::verify_files(step, keel::checkpoint::read_manifest(step)).empty());
    // index.h5 maps each rank's pieces as a listing of its file would.
    std::vector<keel::checkpoint::StoredPiece> listed;
    for (int r : {0, 1}) {
      auto pieces = keel::checkpoint::list_pieces(step, keel::checkpoint::rank_file_name(r));
      listed.insert(listed.end(), pieces.begin(), pieces.end());
    }
    CHECK(listed.size() == 4);
    keel::checkpoint::CheckpointReader reader(step);
    std::vector<float> w(30);
    reader.read("/model/w", 0, 0, 6, 5, w.data());
    for (int64_t r = 0; r < 6; ++r) {
      for (int64_t c = 0; c < 5; ++c) CHECK(w[r * 5 + c] == keel::test::fixture_value(0, r, c, 4));
    }
  }

  TEST_CASE("a report from the store that is not a report abandons the save naming the rank") {
    const std::string good =
        RankReport{true, "rank-00001.h5", 10, "0123456789abcdef", "", keel::test::fixture_pieces_of_rank(1)}
            .to_json()
            .dump();
    struct Case {
      const char* what;
      std::string report;
      const char* says;
    };
    auto with = [&](const char* pointer, nlohmann::json value) {
      auto j = nlohmann::json::parse(good);
      j[nlohmann::json::json_pointer(pointer)] = std::move(value);
      return j.dump();
    };
    for (const Case& c : std::vector<Case>{
             {"not JSON", "{\"ok\": tru", "parse error"},
             {"no ok", R"({"file": "rank-00001.h5"})", "ok"},
             {"a path for a file", with("/file", "../../etc/passwd"), "not a name in the checkpoint directory"},
             {"bytes as text", with("/bytes", "ten"), "bytes"},
             {"no pieces",
              [&] {
                auto j = nlohmann::json::parse(good);
                j.erase("pieces");
                return j.dump();
              }(),
              "pieces"},
             {"a piece outside its tensor", with("/pieces/0/at", nlohmann::json::array({5, 0})), "lies outside"},
             {"a piece of three dimensions", with("/pieces/0/shape", nlohmann::json::array({6, 5, 1})), "3 dimensions"},
             {"a piece of no rows", with("/pieces/0/size", nlohmann::json::array({0, 5})), "lies outside"},
         }) {
      CAPTURE(c.what);
      keel::test::TempDir dir;
      const fs::path root = dir / "ckpt";
      keel::test::MemoryStore store;
      Checkpointer rank0(keel::test::two_rank_options(0, root, dir.path(), 60), &store);
      store.set("ckpt/g0/1/1", c.report);
      keel::test::save_fixture_async(rank0, keel::test::fixture_pieces_of_rank(0), 1);
      CHECK_FALSE(rank0.wait());
      CHECK_FALSE(fs::exists(keel::checkpoint::step_dir(root, 1)));
      CHECK_FALSE(fs::exists(keel::checkpoint::partial_dir(root, 1)));
      const std::string cause = last_event_cause(dir.path());
      CHECK_MESSAGE(cause.find("rank 1's checkpoint report is malformed") != std::string::npos, cause);
      CHECK_MESSAGE(cause.find(c.says) != std::string::npos, cause);
    }
    // The good one parses back to what was sent.
    const RankReport back = RankReport::parse(good, 1);
    CHECK(back.ok);
    CHECK(back.bytes == 10);
    REQUIRE(back.pieces.size() == 2);
    CHECK(back.pieces[1].global_name == "b");
    CHECK(back.pieces[1].row == 3);
    CHECK(back.pieces[1].rows == 4);
  }
}
