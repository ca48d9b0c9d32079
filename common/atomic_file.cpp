#include "common/atomic_file.h"

#include "common/write_all.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace keel::common {

void write_file_atomically(const std::filesystem::path& path, std::string_view bytes, mode_t mode, ErrorCode code) {
  const std::filesystem::path tmp = path.string() + ".tmp";
  auto fail = [&](const std::string& step, int err) {
    ::unlink(tmp.c_str());
    return Error(code, fmt::format("cannot write {}: {} failed ({}); check that its directory exists and is "
                                   "writable",
                                   path.string(), step, std::strerror(err)));
  };
  // A temporary left by a crash (or planted there) would make O_EXCL fail.
  ::unlink(tmp.c_str());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd < 0) throw fail("creating " + tmp.filename().string(), errno);
  if (const int err = write_all(fd, bytes.data(), bytes.size()); err != 0) {
    ::close(fd);
    throw fail("writing", err);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    throw fail("fsync", err);
  }
  if (::close(fd) != 0) throw fail("closing", errno);
  if (::rename(tmp.c_str(), path.c_str()) != 0) throw fail("renaming the temporary over it", errno);
  // The rename is durable only once the directory entry is on disk.
  const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  const int rc = dir_fd < 0 ? -1 : ::fsync(dir_fd);
  const int err = errno;
  if (dir_fd >= 0) ::close(dir_fd);
  if (rc != 0) throw Error(code, fmt::format("cannot fsync directory {} after writing {}: {}", dir.string(),
                                             path.string(), std::strerror(err)));
}

}  // namespace keel::common
