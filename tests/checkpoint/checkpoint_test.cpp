// The checkpoint library on its own (docs/architecture.md "Checkpoints"): files and commit, reading
// blocks across pieces, verification, retention, malformed checkpoints
// and a staging buffer that does not grow. The write paths are in
// o_direct_test, abandoned commits in commit_abandon_test.
#include "checkpoint/catalog.h"
#include "checkpoint/manifest.h"
#include "checkpoint/paths.h"
#include "checkpoint/reader.h"
#include "common/error.h"
#include "tests/support/checkpoint_fixture.h"
#include "tests/support/temp_dir.h"

#include <doctest/doctest.h>

#include <fstream>
#include <functional>

namespace fs = std::filesystem;
using keel::test::fixture_value;
using keel::test::write_fixture_checkpoints;

namespace {

size_t resident_kib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.starts_with("VmRSS:")) return std::stoul(line.substr(6));
  }
  return 0;
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("a committed checkpoint holds its rank file and index and manifest and reads back every element") {
    keel::test::TempDir dir;
    write_fixture_checkpoints(dir / "ckpt", {3});
    const fs::path step = keel::checkpoint::step_dir(dir / "ckpt", 3);
    CHECK(fs::exists(step / "rank-00000.h5"));
    CHECK(fs::exists(step / "index.h5"));
    const auto manifest = keel::checkpoint::read_manifest(step);
    CHECK(manifest.step == 3);
    CHECK(manifest.tokens == 300);
    CHECK(manifest.files.size() == 2);
    CHECK(keel::checkpoint::verify_files(step, manifest).empty());
    CHECK_FALSE(fs::exists(keel::checkpoint::partial_dir(dir / "ckpt", 3)));

    keel::checkpoint::CheckpointReader reader(step);
    CHECK(reader.tensors() == std::vector<std::string>{"/model/b", "/model/w"});
    CHECK(reader.global_shape("/model/w") == std::vector<int64_t>{6, 5});
    // A block that spans both pieces of w.
    std::vector<float> block(3 * 4);
    reader.read("/model/w", 2, 1, 3, 4, block.data());
    for (int64_t r = 0; r < 3; ++r) {
      for (int64_t c = 0; c < 4; ++c) CHECK(block[r * 4 + c] == fixture_value(0, 2 + r, 1 + c, 3));
    }
    std::vector<float> b(7);
    reader.read("/model/b", 0, 0, 7, 1, b.data());
    for (int64_t r = 0; r < 7; ++r) CHECK(b[r] == fixture_value(1, r, 0, 3));
    CHECK_THROWS_AS(reader.read("/model/w", 5, 0, 2, 5, block.data()), keel::common::Error);
    CHECK_THROWS_AS(reader.read("/model/nope", 0, 0, 1, 1, block.data()), keel::common::Error);
  }

  TEST_CASE("verify names the damaged file for a flipped bit and a truncation and a missing file") {
    struct Damage {
      const char* what;
      std::function<void(const fs::path&)> apply;
      const char* expected;
    };
    const Damage damages[] = {
        {"flipped bit",
         [](const fs::path& f) {
           std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
           io.seekp(100);
           io.put('\x7f');
         },
         "checksum"},
        {"truncated", [](const fs::path& f) { fs::resize_file(f, fs::file_size(f) / 2); }, "bytes"},
        {"missing", [](const fs::path& f) { fs::remove(f); }, "missing"},
    };
    for (const Damage& d : damages) {
      for (const char* file : {"rank-00000.h5", "index.h5"}) {
        CAPTURE(d.what);
        CAPTURE(file);
        keel::test::TempDir dir;
        write_fixture_checkpoints(dir / "ckpt", {1, 2});
        const fs::path newest = keel::checkpoint::step_dir(dir / "ckpt", 2);
        d.apply(newest / file);
        const auto problems = keel::checkpoint::verify_files(newest, keel::checkpoint::read_manifest(newest));
        REQUIRE(problems.size() == 1);
        CHECK(problems[0].find(file) != std::string::npos);
        CHECK(problems[0].find(d.expected) != std::string::npos);
        std::vector<std::string> skipped;
        const auto loadable = keel::checkpoint::choose_resume(
            dir / "ckpt", {}, [&](const fs::path& p, const std::string&) { skipped.push_back(p.string()); });
        REQUIRE(loadable);
        CHECK(loadable->step == 1);
        CHECK(skipped.size() == 1);
      }
    }
  }

  TEST_CASE("a directory with a malformed or missing manifest is not a checkpoint") {
    struct Bad {
      const char* what;
      std::function<void(const fs::path&)> apply;
    };
    const Bad bads[] = {
        {"no manifest", [](const fs::path& d) { fs::remove(d / "manifest.json"); }},
        {"not JSON", [](const fs::path& d) { std::ofstream(d / "manifest.json") << "{\"step\": "; }},
        {"unknown format", [](const fs::path& d) { std::ofstream(d / "manifest.json") << R"({"format": "other"})"; }},
        {"wrong step",
         [](const fs::path& d) {
           auto m = keel::checkpoint::read_manifest(d);
           m.step = 7;
           keel::checkpoint::write_manifest(d, m);
         }},
        {"no files",
         [](const fs::path& d) {
           auto m = keel::checkpoint::read_manifest(d);
           m.files.clear();
           std::ofstream(d / "manifest.json") << m.to_json().dump();
         }},
    };
    for (const Bad& bad : bads) {
      CAPTURE(bad.what);
      keel::test::TempDir dir;
      write_fixture_checkpoints(dir / "ckpt", {1, 2});
      bad.apply(keel::checkpoint::step_dir(dir / "ckpt", 2));
      const auto loadable = keel::checkpoint::choose_resume(
          dir / "ckpt", {keel::checkpoint::Depth::kSizes}, [](const fs::path&, const std::string&) {});
      REQUIRE(loadable);
      CHECK(loadable->step == 1);
    }
  }

  TEST_CASE("only a directory named exactly step_ and eight digits is a checkpoint") {
    // keeld moves suspect checkpoints aside by renaming them
    // (step_00000002.suspect-g3); the catalog, the resume choice and
    // retention must then pass them over however complete they are.
    const char* names[] = {"step_00000002.suspect-g3", "step_00000002.suspect-g3.1", "step_00000002.partial",
                           "step_00000002.deleting",   "step_0000002",               "step_000000002",
                           "step_0000000x",            "STEP_00000002",              "xstep_00000002",
                           "step_00000002 "};
    for (const char* name : names) {
      CAPTURE(name);
      keel::test::TempDir dir;
      write_fixture_checkpoints(dir / "ckpt", {1, 2});
      fs::rename(keel::checkpoint::step_dir(dir / "ckpt", 2), dir / "ckpt" / name);
      CHECK(keel::test::committed_steps(dir / "ckpt") == std::vector<int64_t>{1});
      const auto loadable = keel::checkpoint::choose_resume(dir / "ckpt", {keel::checkpoint::Depth::kChecksums},
                                                            [](const fs::path&, const std::string&) {});
      REQUIRE(loadable);
      CHECK(loadable->step == 1);
      // Retention keeping one checkpoint removes nothing but committed ones.
      const auto doomed = keel::checkpoint::prune_candidates(keel::checkpoint::committed(dir / "ckpt"), {1, 0, -1},
                                                             [](const keel::checkpoint::CatalogEntry&) { return true; });
      CHECK(doomed.empty());
    }
  }

  TEST_CASE("retention keeps the newest good checkpoints and every keep_every-th") {
    keel::test::TempDir dir;
    write_fixture_checkpoints(dir / "ckpt", {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, 2);
    // keep = 2 and no keep_every while saving: the newest two remain.
    CHECK(keel::test::committed_steps(dir / "ckpt") == std::vector<int64_t>{9, 10});
    keel::test::TempDir other;
    write_fixture_checkpoints(other / "ckpt", {1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
    const auto doomed = keel::checkpoint::prune_candidates(keel::checkpoint::committed(other / "ckpt"),
                                                           keel::checkpoint::RetentionPolicy{2, 4},
                                                           [](const keel::checkpoint::CatalogEntry&) { return true; });
    std::vector<int64_t> doomed_steps;
    for (const auto& e : doomed) doomed_steps.push_back(e.step);
    CHECK(doomed_steps == std::vector<int64_t>{1, 2, 3, 5, 6, 7});
    for (const auto& e : doomed) keel::checkpoint::remove_checkpoint(e.dir);
    CHECK(keel::test::committed_steps(other / "ckpt") == std::vector<int64_t>{4, 8, 9, 10});
  }

  TEST_CASE("the staging buffer is reused so memory does not grow over a thousand saves") {
#if defined(__SANITIZE_ADDRESS__)
    MESSAGE("skipped: AddressSanitizer's quarantine keeps freed memory resident, so RSS says nothing here");
    return;
#endif
    keel::test::TempDir dir;
    write_fixture_checkpoints(dir / "warmup", {1, 2, 3});
    const size_t before = resident_kib();
    std::vector<int64_t> steps;
    for (int64_t s = 1; s <= 1000; ++s) steps.push_back(s);
    write_fixture_checkpoints(dir / "ckpt", steps, 2);
    const size_t after = resident_kib();
    CAPTURE(before);
    CAPTURE(after);
    CHECK(after < before + 2048);  // KiB
    CHECK(keel::test::committed_steps(dir / "ckpt") == std::vector<int64_t>{999, 1000});
  }
}
