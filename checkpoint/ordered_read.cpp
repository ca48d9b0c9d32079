#include "checkpoint/ordered_read.h"

#include "common/error.h"
#include "common/unique_fd.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace keel::checkpoint {
namespace {

[[noreturn]] void fail(const std::string& what) { throw common::Error(common::ErrorCode::kCheckpointFailure, what); }

// consume() on the bytes from `offset` to the end, one buffered read at a time.
void read_buffered(int fd, const std::filesystem::path& path, uint64_t offset,
                   const std::function<void(const std::byte*, size_t)>& consume) {
  std::vector<std::byte> buffer(kOrderedReadChunk);
  for (;;) {
    const ssize_t n = ::pread(fd, buffer.data(), buffer.size(), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(fmt::format("cannot read {}: {}", path.string(), std::strerror(errno)));
    if (n == 0) return;
    consume(buffer.data(), static_cast<size_t>(n));
    offset += static_cast<uint64_t>(n);
  }
}

struct Ring {
  io_uring ring{};
  bool ready = false;
  ~Ring() {
    if (ready) io_uring_queue_exit(&ring);
  }
};

}  // namespace

void read_in_order(const std::filesystem::path& path, const std::function<void(const std::byte*, size_t)>& consume) {
  constexpr size_t kAlign = 4096;
  common::UniqueFd buffered(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (buffered.get() < 0) fail(fmt::format("cannot open {}: {}", path.string(), std::strerror(errno)));
  struct stat st {};
  if (::fstat(buffered.get(), &st) != 0) fail(fmt::format("cannot stat {}: {}", path.string(), std::strerror(errno)));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  common::UniqueFd direct(::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC));
  // Declared before the ring, so the ring is gone before they are freed.
  std::unique_ptr<std::byte, decltype(&std::free)> buffers(
      static_cast<std::byte*>(std::aligned_alloc(kAlign, kOrderedReadChunk * kOrderedReadDepth)), &std::free);
  if (!buffers) fail(fmt::format("cannot allocate the buffers to read {}", path.string()));
  Ring ring;
  ring.ready = direct.get() >= 0 && io_uring_queue_init(kOrderedReadDepth, &ring.ring, 0) == 0;
  if (!ring.ready) {
    read_buffered(buffered.get(), path, 0, consume);
    return;
  }
  const uint64_t chunks = (size + kOrderedReadChunk - 1) / kOrderedReadChunk;
  // Chunk c reads into slot c % depth; a slot is reused once consumed.
  std::vector<int> result(kOrderedReadDepth, 0);
  std::vector<bool> landed(kOrderedReadDepth, false);
  unsigned in_flight = 0;
  uint64_t submitted = 0;
  auto submit = [&] {
    const unsigned slot = static_cast<unsigned>(submitted % kOrderedReadDepth);
    io_uring_sqe* sqe = io_uring_get_sqe(&ring.ring);
    io_uring_prep_read(sqe, direct.get(), buffers.get() + slot * kOrderedReadChunk,
                       static_cast<unsigned>(kOrderedReadChunk), submitted * kOrderedReadChunk);
    io_uring_sqe_set_data64(sqe, slot);
    ++submitted;
    ++in_flight;
  };
  // False when the ring itself fails.
  auto reap_one = [&] {
    io_uring_cqe* cqe = nullptr;
    int rc = 0;
    do {
      rc = io_uring_wait_cqe(&ring.ring, &cqe);
    } while (rc == -EINTR);
    if (rc < 0) return false;
    const auto slot = static_cast<unsigned>(io_uring_cqe_get_data64(cqe));
    result[slot] = cqe->res;
    landed[slot] = true;
    io_uring_cqe_seen(&ring.ring, cqe);
    --in_flight;
    return true;
  };
  // Reads in flight target `buffers`: they land before anything leaves.
  auto drain = [&] {
    while (in_flight > 0 && reap_one()) {
    }
  };
  try {
    while (submitted < std::min<uint64_t>(chunks, kOrderedReadDepth)) submit();
    io_uring_submit(&ring.ring);
    for (uint64_t c = 0; c < chunks; ++c) {
      const unsigned slot = static_cast<unsigned>(c % kOrderedReadDepth);
      while (!landed[slot]) {
        if (!reap_one()) fail(fmt::format("io_uring failed while reading {}", path.string()));
      }
      landed[slot] = false;
      const int res = result[slot];
      if (res < 0) fail(fmt::format("cannot read {}: {}", path.string(), std::strerror(-res)));
      const uint64_t offset = c * kOrderedReadChunk;
      const size_t expected = static_cast<size_t>(std::min<uint64_t>(kOrderedReadChunk, size - offset));
      const size_t got = std::min(static_cast<size_t>(res), expected);
      consume(buffers.get() + slot * kOrderedReadChunk, got);
      if (got < expected) {
        // A short read before the end: the rest buffered, to wherever the
        // file now ends.
        drain();
        read_buffered(buffered.get(), path, offset + got, consume);
        return;
      }
      if (submitted < chunks) {
        submit();
        io_uring_submit(&ring.ring);
      }
    }
  } catch (...) {
    drain();
    throw;
  }
}

}  // namespace keel::checkpoint
