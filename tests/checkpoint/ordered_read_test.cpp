// read_in_order, the checksum pass's reader (checkpoint/ordered_read.h): every
// byte of the file once, in order, whatever its size against the chunks
// and the reads in flight, and a clear error instead of a crash.
#include "checkpoint/file_system.h"
#include "checkpoint/ordered_read.h"
#include "common/error.h"
#include "tests/support/temp_dir.h"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <xxhash.h>

#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using keel::checkpoint::kOrderedReadChunk;
using keel::checkpoint::kOrderedReadDepth;

std::vector<std::byte> pattern(size_t size) {
  std::vector<std::byte> bytes(size);
  uint64_t x = 0x9e3779b97f4a7c15ULL;
  for (auto& b : bytes) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<std::byte>(x);
  }
  return bytes;
}

void write_file(const std::filesystem::path& path, const std::vector<std::byte>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("a file read in order hands over every byte once and in order - at every size against the chunks") {
    const keel::test::TempDir dir;
    const size_t chunk = kOrderedReadChunk;
    // Empty, under a block, one block, around a chunk, and more chunks
    // than reads in flight, with and without a tail.
    for (const size_t size :
         {size_t{0}, size_t{1}, size_t{4095}, size_t{4096}, chunk - 1, chunk, chunk + 1, 3 * chunk + 12345,
          (kOrderedReadDepth + 1) * chunk, (kOrderedReadDepth + 2) * chunk + 7}) {
      CAPTURE(size);
      const auto bytes = pattern(size);
      const auto path = dir / fmt::format("file-{}", size);
      write_file(path, bytes);
      std::vector<std::byte> seen;
      keel::checkpoint::read_in_order(
          path, [&](const std::byte* data, size_t n) { seen.insert(seen.end(), data, data + n); });
      CHECK(seen.size() == bytes.size());
      CHECK(seen == bytes);
      const std::string want = fmt::format("{:016x}", XXH3_64bits(bytes.data(), bytes.size()));
      CHECK(keel::checkpoint::FileSystem::real().checksum(path) == want);
    }
  }

  TEST_CASE("a file that cannot be read is an error naming it - and a consumer that throws leaves no read behind") {
    const keel::test::TempDir dir;
    const auto missing = dir / "missing.h5";
    try {
      keel::checkpoint::read_in_order(missing, [](const std::byte*, size_t) {});
      FAIL("a missing file was read");
    } catch (const keel::common::Error& e) {
      CHECK(e.code() == keel::common::ErrorCode::kCheckpointFailure);
      CHECK(std::string(e.what()).find(missing.string()) != std::string::npos);
    }
    // Thrown at the second chunk, with the later ones in flight: the
    // exception comes out, and a second read of the same file still works.
    const auto path = dir / "file";
    write_file(path, pattern(5 * kOrderedReadChunk));
    size_t calls = 0;
    CHECK_THROWS_AS(keel::checkpoint::read_in_order(path,
                                                    [&](const std::byte*, size_t) {
                                                      if (++calls == 2) throw std::runtime_error("consumer failed");
                                                    }),
                    std::runtime_error);
    CHECK(calls == 2);
    size_t total = 0;
    keel::checkpoint::read_in_order(path, [&](const std::byte*, size_t n) { total += n; });
    CHECK(total == 5 * kOrderedReadChunk);
  }
}
