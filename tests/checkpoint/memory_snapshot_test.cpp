// In-memory snapshots on their own (checkpoint/memory_snapshot.h): a memfd
// as keeld would hold it, written by a forked child as a rank would and
// read back by the test as the next generation's rank or keeld would.
#include "checkpoint/memory_snapshot.h"

#include <doctest/doctest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <limits>
#include <string>
#include <vector>

#include "tests/support/process.h"

using keel::checkpoint::Piece;
using keel::checkpoint::SnapshotArea;

namespace {

// keeld's side: a memfd that outlives the ranks that write into it.
struct Memfd {
  int fd = memfd_create("keel-snapshot-test", 0);
  ~Memfd() { close(fd); }
};

// A rank's state: a 2-D parameter block and its moment, and a 1-D bias.
std::vector<Piece> state_pieces() {
  return {{"model", "wte", {8, 4}, 4, 0, 4, 4},
          {"optim/exp_avg", "wte", {8, 4}, 4, 0, 4, 4},
          {"model", "ln_f.bias", {4}, 0, 0, 4, 1}};
}

constexpr uint64_t kLayout = 0x5eed;

// Snapshots step `step`: every float of piece i is step + i / 10.
void snapshot(SnapshotArea& area, int64_t step, bool copy_step = false) {
  const auto pieces = state_pieces();
  const auto where = area.begin(pieces, kLayout, copy_step);
  for (size_t i = 0; i < pieces.size(); ++i) {
    for (size_t k = 0; k < pieces[i].numel(); ++k) where[i][k] = static_cast<float>(step) + 0.1f * i;
  }
  area.commit(step, step * 100);
}

std::vector<int64_t> steps_of(const SnapshotArea::Verified& v) {
  std::vector<int64_t> steps;
  for (const auto& s : v.snapshots) steps.push_back(s.listed.step);
  return steps;
}

// Flips one byte of the first piece of the snapshot of `step`.
void flip_a_byte(const SnapshotArea& area, int64_t step) {
  for (const auto& s : area.verified(kLayout).snapshots) {
    if (s.listed.step == step) const_cast<unsigned char*>(reinterpret_cast<const unsigned char*>(s.data[0]))[5] ^= 0x10;
  }
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("a snapshot committed by a rank that is gone is read back whole and verified") {
    Memfd memfd;
    const std::string said = keel::test::run_in_child([&] {
      SnapshotArea area(memfd.fd, 2);
      snapshot(area, 7);
      return std::string("ok");
    });
    REQUIRE(said == "ok");
    SnapshotArea next(memfd.fd, 2);
    const auto v = next.verified(kLayout);
    CHECK(v.problems.empty());
    REQUIRE(v.snapshots.size() == 1);
    const auto& s = v.snapshots[0];
    CHECK(s.listed.step == 7);
    CHECK(s.listed.tokens == 700);
    REQUIRE(s.pieces.size() == 3);
    CHECK(s.pieces[1].tensor_path() == "/optim/exp_avg/wte");
    CHECK(s.pieces[0].row == 4);
    CHECK(s.pieces[2].global_shape == std::vector<int64_t>{4});
    CHECK(s.data[0][15] == 7.0f);
    CHECK(s.data[2][3] == doctest::Approx(7.2f));
  }

  TEST_CASE("a slot a rank was writing when it died is never read and the snapshots before it stay whole") {
    Memfd memfd;
    const std::string said = keel::test::run_in_child([&] {
      SnapshotArea area(memfd.fd, 2);
      snapshot(area, 1);
      snapshot(area, 2);
      area.begin(state_pieces(), kLayout);  // killed in the middle of the copy
      _exit(0);
      return std::string();
    });
    CHECK(said.empty());
    SnapshotArea next(memfd.fd, 2);
    CHECK(steps_of(next.verified(kLayout)) == std::vector<int64_t>{2, 1});
  }

  TEST_CASE("the keep newest snapshots survive every later begin and the oldest make room") {
    Memfd memfd;
    SnapshotArea area(memfd.fd, 2);
    for (int64_t step = 1; step <= 5; ++step) snapshot(area, step);
    // Three slots: the two kept and the one the next snapshot goes into.
    CHECK(steps_of(area.verified(kLayout)) == std::vector<int64_t>{5, 4, 3});
    area.begin(state_pieces(), kLayout);  // step 6 under way, over step 3
    CHECK(steps_of(area.verified(kLayout)) == std::vector<int64_t>{5, 4});
    area.commit(6, 600);
    CHECK(steps_of(area.verified(kLayout)) == std::vector<int64_t>{6, 5, 4});
  }

  TEST_CASE("an area whose snapshots are copied keeps its two newest copy steps beside the keep newest") {
    Memfd memfd;
    SnapshotArea area(memfd.fd, 2, /*copied=*/true);
    snapshot(area, 1, true);
    snapshot(area, 2, true);
    for (int64_t step = 3; step <= 12; ++step) snapshot(area, step);
    // Five slots: the two kept, the two copy steps, the next snapshot's.
    CHECK(steps_of(area.verified(kLayout)) == std::vector<int64_t>{12, 11, 10, 2, 1});
    area.begin(state_pieces(), kLayout);  // over step 10
    CHECK(steps_of(area.verified(kLayout)) == std::vector<int64_t>{12, 11, 2, 1});
    area.commit(13, 1300);
    // A third copy step lets the first go.
    snapshot(area, 14, true);
    for (int64_t step = 15; step <= 20; ++step) snapshot(area, step);
    CHECK(steps_of(area.verified(kLayout)) == std::vector<int64_t>{20, 19, 18, 14, 2});
    const auto listed = area.list();
    CHECK(std::count_if(listed.begin(), listed.end(), [](const SnapshotArea::Listed& l) { return l.copy_step; }) == 2);
    // An area whose snapshots are not copied keeps no copy step longer.
    Memfd plain_fd;
    SnapshotArea plain(plain_fd.fd, 2);
    snapshot(plain, 1, true);
    for (int64_t step = 2; step <= 6; ++step) snapshot(plain, step);
    CHECK(steps_of(plain.verified(kLayout)) == std::vector<int64_t>{6, 5, 4});
  }

  TEST_CASE("a slot is marked copied only while it holds the snapshot that was copied") {
    Memfd memfd;
    SnapshotArea area(memfd.fd, 2, /*copied=*/true);
    snapshot(area, 1, true);
    snapshot(area, 2);
    const auto copy_step = area.image_of(1);
    const auto plain = area.image_of(2);
    REQUIRE(copy_step.has_value());
    REQUIRE(plain.has_value());
    auto copied = [&](int64_t step) {
      for (const auto& l : area.list()) {
        if (l.step == step) return l.copied;
      }
      return false;
    };
    CHECK_FALSE(copied(1));
    // keeld marks it through its own view of the file, as the sender does.
    CHECK(SnapshotArea(memfd.fd, 2).mark_copied(1, copy_step->sequence));
    CHECK(copied(1));
    // Step 2's slot is written again before its copy is marked: the mark
    // misses, and a mark under an old sequence never counts.
    for (int64_t step = 3; step <= 8; ++step) snapshot(area, step);
    CHECK_FALSE(SnapshotArea(memfd.fd, 2).mark_copied(2, plain->sequence));
    const auto newest = area.image_of(8);
    REQUIRE(newest.has_value());
    CHECK_FALSE(SnapshotArea(memfd.fd, 2).mark_copied(8, plain->sequence));
    CHECK_FALSE(copied(8));
    CHECK(copied(1));
    // The file counts sequences across lay-outs, so a slot of the next one
    // is never taken for one keeld saw before.
    CHECK(area.last_sequence() == newest->sequence);
    const auto before = area.last_sequence();
    area.reserve({{"model", "other", {64, 64}, 0, 0, 64, 64}});  // larger: laid out afresh
    CHECK(area.list().empty());
    CHECK(SnapshotArea(memfd.fd, 2).last_sequence() == before);
    snapshot(area, 9, true);
    REQUIRE(area.image_of(9));
    CHECK(area.image_of(9)->sequence == before + 1);
  }

  TEST_CASE("a flipped byte or another layout makes a snapshot unusable with a sentence and the older one serves") {
    Memfd memfd;
    SnapshotArea area(memfd.fd, 2);
    snapshot(area, 1);
    snapshot(area, 2);
    flip_a_byte(area, 2);
    const auto v = area.verified(kLayout);
    CHECK(steps_of(v) == std::vector<int64_t>{1});
    REQUIRE(v.problems.size() == 1);
    CHECK(v.problems[0] == "the in-memory snapshot of step 2 (slot 1) does not match its checksum in /model/wte");
    const auto other = area.verified(kLayout + 1);
    CHECK(other.snapshots.empty());
    CHECK(other.problems.size() == 2);
    CHECK(other.problems[0].find("is of another layout") != std::string::npos);
  }

  TEST_CASE("a snapshot holding a non-finite value is not committed and the one before it serves") {
    Memfd memfd;
    SnapshotArea area(memfd.fd, 2);
    snapshot(area, 1);
    const auto where = area.begin(state_pieces(), kLayout);
    for (size_t i = 0; i < state_pieces().size(); ++i) std::fill(where[i], where[i] + state_pieces()[i].numel(), 1.0f);
    where[1][9] = std::numeric_limits<float>::quiet_NaN();
    const auto problem = area.commit(2, 200);
    REQUIRE(problem.has_value());
    CHECK(*problem == "the state of step 2 holds a non-finite value (nan in /optim/exp_avg/wte)");
    CHECK(steps_of(area.verified(kLayout)) == std::vector<int64_t>{1});
    snapshot(area, 3);
    CHECK(steps_of(area.verified(kLayout)) == std::vector<int64_t>{3, 1});
  }

  TEST_CASE("snapshots after the last good step are quarantined and never read again") {
    Memfd memfd;
    {
      SnapshotArea rank(memfd.fd, 3);
      for (int64_t step = 1; step <= 4; ++step) snapshot(rank, step);
    }
    SnapshotArea keeld(memfd.fd, 3);
    CHECK(keeld.quarantine_after(2) == 2);
    CHECK(steps_of(SnapshotArea(memfd.fd, 3).verified(kLayout)) == std::vector<int64_t>{2, 1});
    CHECK(keeld.list().size() == 2);
  }

  TEST_CASE("an area whose bytes do not add up reads as empty or names the slot and never crashes") {
    struct Row {
      const char* name;
      size_t offset;  // of the byte set, from the start of the file
      unsigned char byte;
      bool area_usable;  // whether the area header still adds up
    };
    // The file: a page of area header, then slots of a header page, a table
    // page and the data.
    const Row rows[] = {
        {"a wrong magic", 0, 'X', false},
        {"another version", 8, 9, false},
        {"a slot count past every bound", 15, 0xff, false},
        {"a slot size past the file", 23, 0x7f, false},
        {"a piece count past the table", 4096 + 4 + 3, 0x7f, true},
        {"a table size past the table", 4096 + 40 + 3, 0x7f, true},
        {"a piece table that is not JSON", 4096 + 4096 + 8 * 3, '}', true},
    };
    for (const Row& row : rows) {
      CAPTURE(row.name);
      Memfd memfd;
      {
        SnapshotArea rank(memfd.fd, 2);
        snapshot(rank, 1);
      }
      unsigned char* file =
          static_cast<unsigned char*>(mmap(nullptr, 4096 * 4, PROT_READ | PROT_WRITE, MAP_SHARED, memfd.fd, 0));
      REQUIRE(file != MAP_FAILED);
      file[row.offset] = row.byte;
      munmap(file, 4096 * 4);
      SnapshotArea next(memfd.fd, 2);
      const auto v = next.verified(kLayout);
      CHECK(v.snapshots.empty());
      CHECK(v.problems.size() == (row.area_usable ? 1u : 0u));
      if (!v.problems.empty()) CHECK(v.problems[0].find("step 1 (slot 0)") != std::string::npos);
      // The next snapshot lays the area out afresh where it must, and serves.
      snapshot(next, 2);
      CHECK(steps_of(next.verified(kLayout)) == std::vector<int64_t>{2});
    }
  }

  TEST_CASE("the newest snapshot copied out of one area and into an empty one reads back there whole") {
    Memfd holder;
    SnapshotArea rank(holder.fd, 2);
    for (int64_t step = 1; step <= 3; ++step) snapshot(rank, step);
    const auto image = rank.image_of(3);
    REQUIRE(image);
    CHECK(image->step == 3);
    CHECK(!rank.image_of(9));  // no such step
    CHECK(!image->check());
    Memfd fresh;
    SnapshotArea other(fresh.fd, 2);
    other.import({&*image});
    const auto v = other.verified(kLayout);
    CHECK(v.problems.empty());
    REQUIRE(steps_of(v) == std::vector<int64_t>{3});
    CHECK(v.snapshots[0].listed.tokens == 300);
    CHECK(v.snapshots[0].pieces == rank.verified(kLayout).snapshots[0].pieces);
    CHECK(v.snapshots[0].data[2][3] == doctest::Approx(3.2));
    // A copy is of a copy step, and the buddy that sent it holds it.
    CHECK(v.snapshots[0].listed.copy_step);
    CHECK(v.snapshots[0].listed.copied);
    // A rank of that layout takes the area as it is and snapshots on in it.
    snapshot(other, 4);
    CHECK(steps_of(other.verified(kLayout)) == std::vector<int64_t>{4, 3});
    // An area that held another rank's snapshots holds the copy alone.
    const auto three = other.image_of(3), four = other.image_of(4);
    rank.import({&*three, &*four});
    CHECK(steps_of(rank.verified(kLayout)) == std::vector<int64_t>{4, 3});
    // An area with nothing complete has nothing to copy.
    Memfd empty;
    CHECK(!SnapshotArea(empty.fd, 2).image_of(1));
  }

  TEST_CASE("a copy that does not add up is refused by check with a sentence and never crashes") {
    Memfd memfd;
    SnapshotArea rank(memfd.fd, 2);
    snapshot(rank, 5);
    struct Row {
      const char* name;
      std::function<void(keel::checkpoint::SnapshotImage&)> spoil;
      const char* said;
    };
    const Row rows[] = {
        {"a flipped byte of data", [](auto& i) { i.data[5] ^= 0x10; }, "does not match its checksum in /model/wte"},
        {"a flipped hash", [](auto& i) { i.table[9] ^= 0x01; }, "does not match its checksum in /optim/exp_avg/wte"},
        {"a table cut short", [](auto& i) { i.table.resize(10); }, "piece table"},
        {"more pieces than the table holds", [](auto& i) { i.pieces = 1 << 30; }, "larger than its slot"},
        {"fewer pieces than the table lists", [](auto& i) { i.pieces = 2; }, "cannot be read"},
        {"less data than the table lists", [](auto& i) { i.data_bytes = 64; }, "more data than its slot holds"},
        {"more data than the table lists", [](auto& i) { i.data_bytes += 64; }, "bytes of data where its table lists"},
    };
    for (const Row& row : rows) {
      CAPTURE(std::string(row.name));
      auto image = rank.image_of(5);
      REQUIRE(image);
      if (std::string(row.name) == "more data than the table lists") {
        std::unique_ptr<unsigned char[]> bigger(new unsigned char[image->data_bytes + 64]());
        std::memcpy(bigger.get(), image->data.get(), image->data_bytes);
        image->data = std::move(bigger);
      }
      row.spoil(*image);
      const auto said = image->check();
      REQUIRE(said);
      CHECK(said->find(row.said) != std::string::npos);
      CHECK(said->find("step 5") != std::string::npos);
    }
  }
}
