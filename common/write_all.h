// Writing a whole buffer to a file descriptor: write(2) may write less than
// asked or be interrupted, so every writer loops; this is that loop once.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <cstddef>

namespace keel::common {

// Writes all `n` bytes of `data` to `fd`, retrying on EINTR. Returns 0, or
// the errno of the write that failed; the caller names the file.
inline int write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t wrote = ::write(fd, p, n);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote < 0) return errno;
    p += wrote;
    n -= static_cast<size_t>(wrote);
  }
  return 0;
}

}  // namespace keel::common
