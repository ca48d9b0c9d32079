#include "checkpoint/file_system.h"

#include "checkpoint/ordered_read.h"

#include "common/error.h"
#include "common/unique_fd.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <stdio.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

namespace keel::checkpoint {
namespace {

[[noreturn]] void fail(const std::string& what) { throw common::Error(common::ErrorCode::kCheckpointFailure, what); }

class RealFileSystem final : public FileSystem {
 public:
  void reserve(const std::filesystem::path& file, uint64_t bytes) override {
    // Read-write: where the filesystem has no fallocate (ramfs), glibc
    // emulates it with reads and writes.
    common::UniqueFd fd(::open(file.c_str(), O_RDWR | O_CLOEXEC));
    if (fd.get() < 0) fail(fmt::format("cannot open {}: {}", file.string(), std::strerror(errno)));
    const int rc = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(bytes));
    if (rc != 0) fail(fmt::format("no room for the {} bytes of {}: {}", bytes, file.string(), std::strerror(rc)));
  }

  void sync(const std::filesystem::path& path) override {
    common::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) fail(fmt::format("cannot open {} to fsync it: {}", path.string(), std::strerror(errno)));
    if (::fsync(fd.get()) != 0) fail(fmt::format("fsync of {} failed: {}", path.string(), std::strerror(errno)));
  }

  void rename(const std::filesystem::path& from, const std::filesystem::path& to) override {
    if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) != 0) {
      fail(fmt::format("cannot rename {} to {}: {}", from.string(), to.string(), std::strerror(errno)));
    }
  }

  void exchange(const std::filesystem::path& a, const std::filesystem::path& b) override {
    if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) != 0) {
      fail(fmt::format("cannot exchange {} and {}: {}", a.string(), b.string(), std::strerror(errno)));
    }
  }

  void remove_all(const std::filesystem::path& path) override {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
    if (ec) fail(fmt::format("cannot remove {}: {}", path.string(), ec.message()));
  }

  std::string checksum(const std::filesystem::path& file) override {
    std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), &XXH3_freeState);
    XXH3_64bits_reset(state.get());
    read_in_order(file, [&](const std::byte* data, size_t bytes) { XXH3_64bits_update(state.get(), data, bytes); });
    return fmt::format("{:016x}", XXH3_64bits_digest(state.get()));
  }
};

}  // namespace

FileSystem& FileSystem::real() {
  static RealFileSystem real;
  return real;
}

}  // namespace keel::checkpoint
