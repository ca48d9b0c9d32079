#include "common/atomic_file.h"
#include "tests/support/temp_dir.h"

#include <doctest/doctest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

using keel::common::Error;
using keel::common::ErrorCode;
using keel::common::write_file_atomically;
namespace fs = std::filesystem;

namespace {

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

fs::perms permissions(const fs::path& path) { return fs::symlink_status(path).permissions() & fs::perms::all; }

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("an atomic write replaces the file with its mode whatever the umask and leaves no temporary") {
    keel::test::TempDir dir;
    const fs::path path = dir / "store.secret";
    dir.write("store.secret", "old and readable by all");
    fs::permissions(path, fs::perms::all);
    const mode_t old_umask = umask(0);
    write_file_atomically(path, "new\n", 0600, ErrorCode::kBadConfig);
    umask(old_umask);
    CHECK(read_text(path) == "new\n");
    CHECK(permissions(path) == (fs::perms::owner_read | fs::perms::owner_write));
    CHECK(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()) == 1);
  }

  TEST_CASE("an atomic write never writes through a link planted at its temporary") {
    keel::test::TempDir dir;
    const fs::path target = dir.write("elsewhere", "untouched");
    fs::create_symlink(target, dir / "store.secret.tmp");
    write_file_atomically(dir / "store.secret", "secret", 0600, ErrorCode::kBadConfig);
    CHECK(read_text(target) == "untouched");
    CHECK(read_text(dir / "store.secret") == "secret");
    CHECK_FALSE(fs::exists(fs::symlink_status(dir / "store.secret.tmp")));
  }

  TEST_CASE("an atomic write into a missing directory is an error with the caller's code naming the file") {
    keel::test::TempDir dir;
    const fs::path path = dir / "missing" / "store.secret";
    try {
      write_file_atomically(path, "x", 0600, ErrorCode::kBadConfig);
      FAIL("written");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kBadConfig);
      CHECK(std::string(e.what()).find(path.string()) != std::string::npos);
    }
  }
}
