// The staging buffer's pinning hooks (checkpoint/shard_writer.h): a GPU
// backend page-locks the buffer its snapshots land in, so every pin must be
// matched by an unpin of the same memory before that memory is freed, and
// a run's saves of one size must not pin again.
#include "checkpoint/shard_writer.h"

#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

using keel::checkpoint::Piece;
using keel::checkpoint::ShardWriter;
using keel::checkpoint::StagingPinning;

namespace {

struct PinEvent {
  std::string what;  // "pin" or "unpin"
  void* data;
  size_t bytes;
};

std::vector<Piece> pieces(int64_t rows) { return {{"model", "w", {rows, 64}, 0, 0, rows, 64}}; }

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("the staging buffer is pinned once per allocation and unpinned before it is freed") {
    std::vector<PinEvent> events;
    {
      ShardWriter writer(false, keel::checkpoint::FileSystem::real(),
                         StagingPinning{[&](void* data, size_t bytes) { events.push_back({"pin", data, bytes}); },
                                        [&](void* data) { events.push_back({"unpin", data, 0}); }});
      writer.prepare(pieces(100));
      REQUIRE(events.size() == 1);
      CHECK(events[0].what == "pin");
      CHECK(events[0].bytes == writer.staging_bytes());
      const auto* first = static_cast<std::byte*>(events[0].data);
      const auto* staged = reinterpret_cast<std::byte*>(writer.staging(0));
      CHECK(staged >= first);
      CHECK(staged + pieces(100)[0].bytes() <= first + events[0].bytes);

      writer.prepare(pieces(100));  // the same size: the same buffer
      CHECK(events.size() == 1);

      writer.prepare(pieces(1000));  // larger: the old buffer goes first
      REQUIRE(events.size() == 3);
      CHECK(events[1].what == "unpin");
      CHECK(events[1].data == events[0].data);
      CHECK(events[2].what == "pin");
      CHECK(events[2].bytes == writer.staging_bytes());
    }
    REQUIRE(events.size() == 4);
    CHECK(events[3].what == "unpin");
    CHECK(events[3].data == events[2].data);
  }

}
