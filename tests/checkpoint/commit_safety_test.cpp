// The commit protocol never deletes or misreports a checkpoint
// (docs/architecture.md "Commit protocol", "Resume and retention"): an
// interrupted save is finished or removed only after it is checked, a save
// of a committed step replaces it atomically, retention counts only good
// checkpoints, a failed fsync after the rename is reported as what it is,
// and the disk reservation holds until the bulk writes are done. Faults
// come through a FileSystemWrapper that breaks one operation.
#include "checkpoint/catalog.h"
#include "checkpoint/checkpointer.h"
#include "checkpoint/file_system.h"
#include "checkpoint/manifest.h"
#include "checkpoint/paths.h"
#include "common/error.h"
#include "tests/support/checkpoint_fixture.h"
#include "tests/support/temp_dir.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <functional>

namespace fs = std::filesystem;
using keel::checkpoint::Checkpointer;
using keel::checkpoint::CheckpointerOptions;
using keel::checkpoint::FileSystem;
using keel::checkpoint::FileSystemWrapper;

namespace {

std::vector<std::string> event_kinds(const fs::path& run_dir) {
  std::vector<std::string> kinds;
  std::ifstream in(run_dir / "events.jsonl");
  for (std::string line; std::getline(in, line);) kinds.push_back(nlohmann::json::parse(line).at("kind"));
  return kinds;
}

bool verifies(const fs::path& dir) {
  return keel::checkpoint::verify_files(dir, keel::checkpoint::read_manifest(dir)).empty();
}

CheckpointerOptions options_for(const fs::path& root, FileSystem& fs, int64_t keep = 100) {
  CheckpointerOptions options;
  options.root = root;
  options.run_dir = root.parent_path();
  options.keep = keep;
  options.layout = {{"world_size", 1}};
  options.fs = &fs;
  return options;
}

// Saves one fixture-shaped checkpoint of `step` whose pieces hold `value`.
bool save(Checkpointer& checkpointer, int64_t step, float value, int64_t floats = 30) {
  auto staging = checkpointer.stage({{"model", "w", {floats}, 0, 0, floats, 1}});
  std::fill(staging[0], staging[0] + floats, value);
  checkpointer.save_async(step, step);
  return checkpointer.wait();
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("a finished save interrupted before its rename is committed at start and a damaged one removed") {
    keel::test::TempDir dir;
    keel::test::write_fixture_checkpoints(dir / "ckpt", {1, 2, 3});
    // Step 2 crashed after its manifest, step 3 too but with a torn file.
    fs::rename(keel::checkpoint::step_dir(dir / "ckpt", 2), keel::checkpoint::partial_dir(dir / "ckpt", 2));
    fs::rename(keel::checkpoint::step_dir(dir / "ckpt", 3), keel::checkpoint::partial_dir(dir / "ckpt", 3));
    const auto torn = keel::checkpoint::partial_dir(dir / "ckpt", 3) / "rank-00000.h5";
    fs::resize_file(torn, fs::file_size(torn) / 2);
    { Checkpointer restarted(options_for(dir / "ckpt", FileSystem::real()), nullptr); }
    CHECK(keel::test::committed_steps(dir / "ckpt") == std::vector<int64_t>{1, 2});
    CHECK(verifies(keel::checkpoint::step_dir(dir / "ckpt", 2)));
    CHECK_FALSE(fs::exists(keel::checkpoint::partial_dir(dir / "ckpt", 3)));
    const auto kinds = event_kinds(dir.path());
    CHECK(std::count(kinds.begin(), kinds.end(), "checkpoint_recovered") == 1);
  }

  TEST_CASE("a save of a step already committed exchanges it atomically and a crash after the exchange loses nothing") {
    keel::test::TempDir dir;
    fs::create_directories(dir / "ckpt");
    // The removal of the replaced copy "crashes": it never happens.
    struct NoRemoval : FileSystemWrapper {
      using FileSystemWrapper::FileSystemWrapper;
      std::vector<fs::path> exchanged;
      void exchange(const fs::path& a, const fs::path& b) override {
        FileSystemWrapper::exchange(a, b);
        exchanged.push_back(b);
      }
      void remove_all(const fs::path& path) override {
        if (path.string().ends_with(".partial")) throw keel::common::Error(keel::common::ErrorCode::kCheckpointFailure, "crash");
        FileSystemWrapper::remove_all(path);
      }
    } broken(FileSystem::real());
    {
      Checkpointer checkpointer(options_for(dir / "ckpt", broken), nullptr);
      REQUIRE(save(checkpointer, 5, 1.0f));
      REQUIRE(save(checkpointer, 5, 2.0f));
    }
    CHECK(broken.exchanged.size() == 1);
    const auto step5 = keel::checkpoint::step_dir(dir / "ckpt", 5);
    CHECK(verifies(step5));
    CHECK(fs::exists(keel::checkpoint::partial_dir(dir / "ckpt", 5)));  // the old copy, left by the "crash"
    // At the next start the committed step stays, the old copy goes.
    { Checkpointer restarted(options_for(dir / "ckpt", FileSystem::real()), nullptr); }
    CHECK(keel::test::committed_steps(dir / "ckpt") == std::vector<int64_t>{5});
    CHECK(verifies(step5));
    CHECK_FALSE(fs::exists(keel::checkpoint::partial_dir(dir / "ckpt", 5)));
  }

  TEST_CASE("retention keeps the checkpoint just committed when a newer one is damaged") {
    keel::test::TempDir dir;
    keel::test::write_fixture_checkpoints(dir / "ckpt", {10, 20});
    const auto damaged = keel::checkpoint::step_dir(dir / "ckpt", 20) / "rank-00000.h5";
    fs::resize_file(damaged, fs::file_size(damaged) / 2);
    // A run resumed from 10 (20 does not load) keeps one checkpoint.
    Checkpointer checkpointer(options_for(dir / "ckpt", FileSystem::real(), 1), nullptr);
    checkpointer.protect(10);
    REQUIRE(save(checkpointer, 15, 1.0f));
    // 15 is the newest good one; 10 goes now that a newer one committed;
    // the damaged 20 stays for an operator.
    CHECK(keel::test::committed_steps(dir / "ckpt") == std::vector<int64_t>{15, 20});
  }

  TEST_CASE("retention keeps the checkpoint a run resumed from until a newer one commits") {
    keel::test::TempDir dir;
    keel::test::write_fixture_checkpoints(dir / "ckpt", {10, 20, 30});
    Checkpointer checkpointer(options_for(dir / "ckpt", FileSystem::real(), 2), nullptr);
    checkpointer.protect(10);
    REQUIRE(save(checkpointer, 5, 1.0f));  // older than the resume point: no protection lifted
    CHECK(keel::test::committed_steps(dir / "ckpt") == std::vector<int64_t>{10, 20, 30});
    REQUIRE(save(checkpointer, 40, 1.0f));
    CHECK(keel::test::committed_steps(dir / "ckpt") == std::vector<int64_t>{30, 40});
  }

  TEST_CASE("a failed fsync after the rename reports a committed checkpoint that may not be durable") {
    keel::test::TempDir dir;
    keel::test::write_fixture_checkpoints(dir / "ckpt", {1});
    struct ParentSyncFails : FileSystemWrapper {
      using FileSystemWrapper::FileSystemWrapper;
      fs::path root;
      void sync(const fs::path& path) override {
        if (path == root) throw keel::common::Error(keel::common::ErrorCode::kCheckpointFailure, "fsync: EIO");
        FileSystemWrapper::sync(path);
      }
    } broken(FileSystem::real());
    broken.root = dir / "ckpt";
    Checkpointer checkpointer(options_for(dir / "ckpt", broken, 1), nullptr);
    CHECK(save(checkpointer, 2, 1.0f));
    CHECK(verifies(keel::checkpoint::step_dir(dir / "ckpt", 2)));
    // Retention did not run: the older, durable checkpoint stays.
    CHECK(keel::test::committed_steps(dir / "ckpt") == std::vector<int64_t>{1, 2});
    std::ifstream in(dir.path() / "events.jsonl");
    bool reported = false;
    for (std::string line; std::getline(in, line);) {
      const auto e = nlohmann::json::parse(line);
      CHECK(e.at("kind") != "checkpoint_abandoned");
      if (e.at("kind") == "checkpoint_committed" && e.at("step") == 2) reported = e.at("durable") == false;
    }
    CHECK(reported);
  }

  TEST_CASE("a non-finite value in the state fails the save and nothing is committed") {
    keel::test::TempDir dir;
    fs::create_directories(dir / "ckpt");
    Checkpointer checkpointer(options_for(dir / "ckpt", FileSystem::real()), nullptr);
    for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
      CAPTURE(bad);
      auto staging = checkpointer.stage({{"model", "w", {1000}, 0, 0, 1000, 1}});
      std::fill(staging[0], staging[0] + 1000, 0.5f);
      staging[0][777] = bad;
      checkpointer.save_async(3, 3);
      CHECK_FALSE(checkpointer.wait());
    }
    CHECK(keel::test::committed_steps(dir / "ckpt").empty());
  }

  TEST_CASE("the disk reservation made after the skeleton holds while another writer fills the disk") {
    keel::test::TempDir dir;
    const fs::path small = dir / "small";
    keel::test::SmallTmpfs tmpfs(small, "16m");
    if (!tmpfs.mounted()) {
      MESSAGE("skipped: " << tmpfs.why());
      return;
    }
    // After the reservation of the whole rank file, another writer takes
    // every free block; the bulk writes must still land in the reserved ones.
    struct FillsTheDisk : FileSystemWrapper {
      using FileSystemWrapper::FileSystemWrapper;
      fs::path filler;
      void reserve(const fs::path& file, uint64_t bytes) override {
        FileSystemWrapper::reserve(file, bytes);
        if (bytes != fs::file_size(file)) return;  // the upper-bound probe
        struct statvfs st{};
        REQUIRE(::statvfs(file.parent_path().c_str(), &st) == 0);
        const int fd = ::open(filler.c_str(), O_WRONLY | O_CREAT, 0644);
        ::posix_fallocate(fd, 0, static_cast<off_t>(st.f_bavail * st.f_frsize));
        ::close(fd);
      }
    } filling(FileSystem::real());
    filling.filler = small / "filler";
    fs::create_directories(small / "ckpt");
    Checkpointer checkpointer(options_for(small / "ckpt", filling), nullptr);
    CHECK(save(checkpointer, 1, 3.0f, int64_t{2} << 20));  // 8 MiB of floats
    CHECK(verifies(keel::checkpoint::step_dir(small / "ckpt", 1)));
  }
}
