// ShardWriter's two bulk write paths on real filesystems (docs/architecture.md "Write path"):
// pieces of several MiB on a disk go out with O_DIRECT, and a filesystem
// that refuses O_DIRECT gets buffered writes. Either way the file's
// checksum matches and every piece reads back at the offset HDF5 gave it.
// The fixture of checkpoint_test is too small for this: pieces under 4 KiB
// have no aligned body, so they never issue an O_DIRECT write.
#include "checkpoint/manifest.h"
#include "checkpoint/paths.h"
#include "checkpoint/reader.h"
#include "checkpoint/shard_writer.h"
#include "tests/support/checkpoint_fixture.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <nlohmann/json.hpp>
#include <sched.h>
#include <sys/mount.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace fs = std::filesystem;
using keel::checkpoint::Piece;

namespace {

constexpr uint64_t kBlock = 4096;  // O_DIRECT's unit

// Two pieces of 2 MiB made of whole blocks, and one of about 3 MiB with an
// unaligned tail that goes buffered.
std::vector<Piece> large_pieces() {
  return {{"model", "w", {1024, 1024}, 0, 0, 512, 1024},
          {"model", "w", {1024, 1024}, 512, 0, 512, 1024},
          {"model", "b", {777777}, 0, 0, 777777, 1}};
}

// What O_DIRECT writes when every piece starts on a block, as HDF5's
// alignment makes them.
uint64_t aligned_body_bytes() {
  uint64_t n = 0;
  for (const Piece& p : large_pieces()) n += p.bytes() / kBlock * kBlock;
  return n;
}

struct Outcome {
  uint64_t direct_bytes = 0;
  std::vector<std::string> problems;  // empty when the file verifies and reads back
};

// Writes the large pieces as dir/rank-00000.h5 and checks the file: its
// size and checksum against what write() reported, and every piece's bytes
// at the offset HDF5 lists for it against values computed afresh.
Outcome write_and_read_back(const fs::path& dir) {
  const auto pieces = large_pieces();
  const int64_t step = 7;
  keel::checkpoint::ShardWriter writer(/*o_direct=*/true, keel::checkpoint::FileSystem::real());
  writer.prepare(pieces);
  std::vector<float*> staging;
  for (size_t i = 0; i < pieces.size(); ++i) staging.push_back(writer.staging(i));
  keel::test::fill_fixture(pieces, staging, step);
  const std::string file = keel::checkpoint::rank_file_name(0);
  const auto written = writer.write(dir / file, {{"step", step}, {"tokens", 700}, {"rank", 0}, {"layout", {}}});

  Outcome outcome{written.direct_bytes, {}};
  auto& problems = outcome.problems;
  if (written.bytes != fs::file_size(dir / file)) problems.push_back("the file's size is not the size reported");
  if (written.xxh3 != keel::checkpoint::file_xxh3(dir / file)) problems.push_back("the checksum does not match the file");
  const auto stored = keel::checkpoint::list_pieces(dir, file);
  if (stored.size() != pieces.size()) problems.push_back(std::to_string(stored.size()) + " pieces listed");
  std::ifstream in(dir / file, std::ios::binary);
  for (const auto& s : stored) {
    const auto& p = s.piece;
    std::vector<float> expected(p.numel()), read(p.numel());
    keel::test::fill_fixture({p}, {expected.data()}, step);
    in.seekg(static_cast<std::streamoff>(s.offset));
    in.read(reinterpret_cast<char*>(read.data()), static_cast<std::streamsize>(p.bytes()));
    if (!in || std::memcmp(read.data(), expected.data(), p.bytes()) != 0) {
      problems.push_back(s.dataset + " does not read back");
    }
  }
  return outcome;
}

std::optional<int64_t> filesystem_type(const fs::path& dir) {
  struct statfs info {};
  if (statfs(dir.c_str(), &info) != 0) return std::nullopt;
  return static_cast<int64_t>(info.f_type);
}

bool accepts_o_direct(const fs::path& dir) {
  const fs::path probe = dir / ".keel-o-direct-probe";
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_DIRECT | O_CLOEXEC, 0600);
  if (fd >= 0) ::close(fd);
  ::unlink(probe.c_str());
  return fd >= 0;
}

// The first of the build tree (ctest's working directory), the temp dir
// and /var/tmp that sits on a disk filesystem accepting O_DIRECT.
std::optional<fs::path> disk_directory() {
  for (const fs::path& dir : {fs::current_path(), fs::temp_directory_path(), fs::path("/var/tmp")}) {
    const auto type = filesystem_type(dir);
    if (!type || *type == TMPFS_MAGIC || *type == RAMFS_MAGIC) continue;
    if (accepts_o_direct(dir)) return dir;
  }
  return std::nullopt;
}

bool write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  return static_cast<bool>(out.flush());
}

// Runs write_and_read_back in a child process on a ramfs mounted at `dir`
// in a mount namespace of its own (and a user namespace when not root), so
// that nothing is mounted on the machine. ramfs refuses O_DIRECT on every
// kernel. The outcome, or the reason it could not run.
std::variant<Outcome, std::string> on_ramfs(const fs::path& dir) {
  const uid_t uid = geteuid();
  const gid_t gid = getegid();
  const std::string text = keel::test::run_in_child([&] {
    auto refused = [](const std::string& step) {
      return nlohmann::json{{"skipped", step + ": " + std::strerror(errno)}}.dump();
    };
    if (unshare(uid == 0 ? CLONE_NEWNS : CLONE_NEWUSER | CLONE_NEWNS) != 0) return refused("no mount namespace (unshare)");
    if (uid != 0 && !(write_text("/proc/self/setgroups", "deny") &&
                      write_text("/proc/self/uid_map", "0 " + std::to_string(uid) + " 1") &&
                      write_text("/proc/self/gid_map", "0 " + std::to_string(gid) + " 1"))) {
      return refused("no uid map in the user namespace");
    }
    if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return refused("cannot make the mounts private");
    if (mount("ramfs", dir.c_str(), "ramfs", 0, nullptr) != 0) return refused("cannot mount a ramfs");
    const Outcome o = write_and_read_back(dir);
    return nlohmann::json{{"direct_bytes", o.direct_bytes}, {"problems", o.problems}}.dump();
  });
  INFO("the ramfs child said: " << text);
  const auto reply = nlohmann::json::parse(text);
  if (reply.contains("skipped")) return reply.at("skipped").get<std::string>();
  return Outcome{reply.at("direct_bytes"), reply.at("problems")};
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("pieces of several MiB on a disk are written with O_DIRECT and verify and read back") {
    const auto parent = disk_directory();
    if (!parent) {
      MESSAGE("skipped: no directory on a disk filesystem that accepts O_DIRECT (the build tree, the temp dir "
              "and /var/tmp are tmpfs or refuse it)");
      return;
    }
    keel::test::TempDir dir(*parent);
    const Outcome outcome = write_and_read_back(dir.path());
    CHECK(outcome.problems.empty());
    for (const auto& problem : outcome.problems) MESSAGE(problem);
    CHECK(outcome.direct_bytes == aligned_body_bytes());
  }

  TEST_CASE("a filesystem that refuses O_DIRECT gets buffered writes that verify and read back") {
    // tmpfs refused O_DIRECT until Linux 6.6; where /dev/shm still does, it
    // is the filesystem of this test, otherwise a private ramfs.
    Outcome outcome;
    if (fs::is_directory("/dev/shm") && !accepts_o_direct("/dev/shm")) {
      keel::test::TempDir dir("/dev/shm");
      outcome = write_and_read_back(dir.path());
    } else {
      keel::test::TempDir dir;
      auto result = on_ramfs(dir.path());
      if (auto* why = std::get_if<std::string>(&result)) {
        MESSAGE("skipped: /dev/shm accepts O_DIRECT and no ramfs could be mounted: " << *why);
        return;
      }
      outcome = std::get<Outcome>(result);
    }
    CHECK(outcome.problems.empty());
    for (const auto& problem : outcome.problems) MESSAGE(problem);
    CHECK(outcome.direct_bytes == 0);
  }
}
