// The buddy copy of the in-memory snapshots on its own
// (daemon/snapshot_buddy.h): keelds' buddies in one process on loopback,
// each over memfds as RankSet holds them, and a raw client for the bad
// input a network may bring.
#include "daemon/snapshot_buddy.h"

#include <doctest/doctest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <cstring>
#include <future>
#include <string>
#include <vector>

#include "tests/support/wait.h"

namespace keel::test {
namespace {

using checkpoint::Piece;
using checkpoint::SnapshotArea;
using daemon::FetchedCopies;
using daemon::SnapshotBuddy;
namespace wire = daemon::buddy_wire;

struct Memfd {
  int fd = memfd_create("keel-buddy-test", MFD_CLOEXEC);
  ~Memfd() { close(fd); }
};

constexpr uint64_t kLayout = 0xb0dd;

// A rank's snapshot of step `step`, a copy step unless said otherwise:
// every float of piece i is step + i.
void snapshot(int fd, int64_t step, bool copy_step = true) {
  SnapshotArea area(fd, 2, /*copied=*/true);
  const std::vector<Piece> pieces = {{"model", "wte", {64, 16}, 0, 0, 64, 16},
                                     {"optim/exp_avg", "wte", {64, 16}, 0, 0, 64, 16}};
  const auto where = area.begin(pieces, kLayout, copy_step);
  for (size_t i = 0; i < pieces.size(); ++i) {
    for (size_t k = 0; k < pieces[i].numel(); ++k) where[i][k] = static_cast<float>(step + i);
  }
  REQUIRE(!area.commit(step, step * 10));
}

std::unique_ptr<SnapshotBuddy> buddy_over(const std::vector<int>& fds, uint16_t port = 0) {
  auto buddy = std::make_unique<SnapshotBuddy>(
      daemon::SnapshotBuddyOptions{"127.0.0.1", port, 2, 0, [](std::function<void()> f) { f(); }});
  buddy->attach_areas(fds);
  return buddy;
}

// Whether the rank's slot of `step` is marked held by the buddy, which the
// rank waits for before it votes for its next copy step.
bool marked_copied(int fd, int64_t step) {
  for (const auto& l : SnapshotArea(fd, 2).list()) {
    if (l.step == step) return l.copied;
  }
  return false;
}

std::vector<int64_t> held_steps(const SnapshotBuddy& buddy, int64_t rank) {
  std::vector<int64_t> steps;
  for (const auto& h : buddy.held()) {
    if (h.rank == rank) steps.push_back(h.step);
  }
  return steps;
}

int64_t held_step(const SnapshotBuddy& buddy, int64_t rank) {
  for (const auto& h : buddy.held()) {
    if (h.rank == rank) return h.step;
  }
  return -1;
}

FetchedCopies fetch(SnapshotBuddy& buddy, std::vector<int> locals, int64_t first_rank,
                    std::vector<SnapshotBuddy::Holder> holders,
                    std::chrono::milliseconds within = std::chrono::seconds(20)) {
  std::promise<FetchedCopies> got;
  buddy.fetch(std::move(locals), first_rank, std::move(holders), within,
              [&](const FetchedCopies& f) { got.set_value(f); });
  return got.get_future().get();
}

// A client speaking the wire format by hand.
class RawClient {
 public:
  explicit RawClient(const std::string& endpoint) : socket_(io_) {
    const size_t colon = endpoint.rfind(':');
    boost::asio::ip::tcp::resolver resolver(io_);
    boost::asio::connect(socket_, resolver.resolve(endpoint.substr(0, colon), endpoint.substr(colon + 1)));
  }
  void send(const void* data, size_t bytes) { boost::asio::write(socket_, boost::asio::buffer(data, bytes)); }
  // The answer frame and the sentence after a refusal; kind 0 when the
  // server hung up instead.
  std::pair<wire::Frame, std::string> answer() {
    wire::Frame f{};
    boost::system::error_code ec;
    boost::asio::read(socket_, boost::asio::buffer(&f, sizeof(f)), ec);
    if (ec) return {wire::Frame{}, ""};
    std::string said;
    if (f.kind == wire::kRefused) {
      said.resize(f.data_bytes);
      boost::asio::read(socket_, boost::asio::buffer(said.data(), said.size()), ec);
    }
    return {f, said};
  }

 private:
  boost::asio::io_context io_;
  boost::asio::ip::tcp::socket socket_;
};

wire::Frame frame(uint32_t kind, int64_t rank) {
  wire::Frame f{};
  std::memcpy(f.magic, wire::kMagic, sizeof(wire::kMagic));
  f.kind = kind;
  f.rank = rank;
  return f;
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("each copy step goes to the buddy and is marked held and a node with empty areas fills them from it") {
    Memfd rank2, rank3;
    auto sender = buddy_over({rank2.fd, rank3.fd});
    auto holder = buddy_over({});
    snapshot(rank2.fd, 4);  // before send_to: another numbering's, never sent
    sender->send_to("node-1", holder->endpoint(), 2);
    snapshot(rank2.fd, 5);
    snapshot(rank3.fd, 5);
    REQUIRE(wait_until([&] { return held_step(*holder, 2) == 5 && held_step(*holder, 3) == 5; }, 30));
    REQUIRE(wait_until([&] { return sender->sent()[1].has_value(); }, 30));
    CHECK(sender->sent()[1]->to == "node-1");
    CHECK(sender->sent()[1]->bytes == 2 * 64 * 16 * 4);
    REQUIRE(wait_until([&] { return marked_copied(rank2.fd, 5) && marked_copied(rank3.fd, 5); }, 30));
    CHECK_FALSE(marked_copied(rank2.fd, 4));
    // A snapshot that is no copy step stays on its node; a copy step goes
    // once every rank of the node has it, and the holder keeps as many
    // copies as the areas keep snapshots.
    snapshot(rank2.fd, 6, false);
    snapshot(rank3.fd, 6, false);
    snapshot(rank2.fd, 7);
    CHECK(held_step(*holder, 2) == 5);
    snapshot(rank3.fd, 7);
    REQUIRE(wait_until([&] { return held_step(*holder, 2) == 7 && held_step(*holder, 3) == 7; }, 30));
    CHECK(holder->held().size() == 4);
    CHECK_FALSE(marked_copied(rank2.fd, 6));

    // The node comes back with fresh areas: the copies fill them, and a
    // rank reads them as its own.
    Memfd fresh2, fresh3;
    auto back = buddy_over({fresh2.fd, fresh3.fd});
    const auto got = fetch(*back, {0, 1}, 2, {{"node-2", "127.0.0.1:1"}, {"node-1", holder->endpoint()}});
    INFO(got.problems.size());
    REQUIRE(got.filled.size() == 2);
    CHECK(got.filled[0].steps == std::vector<int64_t>{7, 5});
    CHECK(got.filled[0].from == "node-1");
    CHECK(got.filled[1].steps == std::vector<int64_t>{7, 5});
    CHECK(got.absent.empty());
    // node-2 was out of reach, and said so before node-1 was asked.
    REQUIRE(got.problems.size() == 1);
    CHECK(got.problems[0].find("node 'node-2'") != std::string::npos);
    const SnapshotArea restored(fresh2.fd, 2);
    const auto v = restored.verified(kLayout);
    REQUIRE(v.snapshots.size() == 2);
    CHECK(v.snapshots[0].listed.step == 7);
    CHECK(v.snapshots[0].listed.tokens == 70);
    CHECK(v.snapshots[0].data[1][100] == 8.0f);
  }

  TEST_CASE("a step taken again after the run went back is copied again and the copies after it are dropped") {
    Memfd rank0;
    auto holder = buddy_over({});
    auto sender = buddy_over({rank0.fd});
    sender->send_to("node-1", holder->endpoint(), 0);
    snapshot(rank0.fd, 4);
    REQUIRE(wait_until([&] { return held_step(*holder, 0) == 4; }, 30));
    snapshot(rank0.fd, 6);
    REQUIRE(wait_until([&] { return held_step(*holder, 0) == 6 && marked_copied(rank0.fd, 6); }, 30));
    // A new generation resumes from step 4, as the next one's keeld does:
    // the sender is pointed anew, then the rank quarantines step 6, a
    // history the run left, and takes steps 5 and 6 again.
    sender->send_to("node-1", holder->endpoint(), 0);
    SnapshotArea(rank0.fd, 2).quarantine_after(4);
    snapshot(rank0.fd, 5);
    REQUIRE(wait_until([&] { return held_step(*holder, 0) == 5; }, 30));
    CHECK(held_steps(*holder, 0) == std::vector<int64_t>{5, 4});
    snapshot(rank0.fd, 6);
    REQUIRE(wait_until([&] { return held_step(*holder, 0) == 6 && marked_copied(rank0.fd, 6); }, 30));
    CHECK(held_steps(*holder, 0) == std::vector<int64_t>{6, 5});
  }

  TEST_CASE("a copy step the buddy could not take is sent again until it holds it") {
    // The buddy's port, then the buddy gone from it.
    auto first = buddy_over({});
    const std::string endpoint = first->endpoint();
    const auto port = static_cast<uint16_t>(std::stoi(endpoint.substr(endpoint.rfind(':') + 1)));
    first.reset();
    Memfd rank0;
    auto sender = buddy_over({rank0.fd});
    sender->send_to("node-1", endpoint, 0);
    snapshot(rank0.fd, 3);
    // Tried and not held: the slot is not marked, and the sender says why.
    REQUIRE(wait_until([&] { return sender->failing().has_value(); }, 30));
    CHECK(sender->failing()->step == 3);
    CHECK(sender->failing()->tries >= 1);
    CHECK(!sender->failing()->why.empty());
    CHECK(!sender->sent()[0].has_value());
    CHECK_FALSE(marked_copied(rank0.fd, 3));
    // The buddy is back on its port: the same step goes to it.
    auto back = buddy_over({}, port);
    REQUIRE(wait_until([&] { return held_step(*back, 0) == 3 && marked_copied(rank0.fd, 3); }, 60));
    REQUIRE(wait_until([&] { return !sender->failing().has_value(); }, 30));
    CHECK(sender->sent()[0]->step == 3);
  }

  TEST_CASE("a node's own copies serve first and a rank nobody holds is absent and no problem") {
    Memfd area;
    auto holder = buddy_over({});
    Memfd other;
    auto sender = buddy_over({other.fd});
    sender->send_to("node-0", holder->endpoint(), 7);
    snapshot(other.fd, 9);
    REQUIRE(wait_until([&] { return held_step(*holder, 7) == 9; }, 30));
    holder->attach_areas({area.fd});
    // The numbering moved: local 0 of the holder is now global rank 7.
    const auto got = fetch(*holder, {0}, 7, {});
    REQUIRE(got.filled.size() == 1);
    CHECK(got.filled[0].from == "this node");
    const auto none = fetch(*holder, {0}, 8, {{"node-0", holder->endpoint()}});
    CHECK(none.filled.empty());
    CHECK(none.problems.empty());
    CHECK(none.absent == std::vector<int64_t>{8});
    // An SDC verdict's last good step drops the copies after it.
    CHECK(holder->drop_after(8) == 1);
    CHECK(holder->held().empty());
  }

  TEST_CASE("bad input on the copy port is refused with a sentence and the copy held before stays") {
    auto holder = buddy_over({});
    Memfd area;
    auto sender = buddy_over({area.fd});
    sender->send_to("node-0", holder->endpoint(), 0);
    snapshot(area.fd, 3);
    REQUIRE(wait_until([&] { return held_step(*holder, 0) == 3; }, 30));
    const auto image = SnapshotArea(area.fd, 2).image_of(3);
    REQUIRE(image);
    auto push_of = [&](int64_t step) {
      wire::Frame f = frame(wire::kPush, 0);
      f.pieces = image->pieces;
      f.step = step;
      f.layout_hash = image->layout_hash;
      f.table_bytes = image->table.size();
      f.data_bytes = image->data_bytes;
      return f;
    };
    struct Row {
      const char* name;
      std::function<void(RawClient&)> send;
      const char* said;  // in the refusal; empty: the server hangs up
    };
    const Row rows[] = {
        {"a frame of another protocol",
         [](RawClient& c) {
           const std::string junk(sizeof(wire::Frame), 'x');
           c.send(junk.data(), junk.size());
         },
         ""},
        {"a frame of an unknown kind",
         [](RawClient& c) {
           const auto f = frame(99, 0);
           c.send(&f, sizeof(f));
         },
         ""},
        {"a piece table past every bound",
         [&](RawClient& c) {
           auto f = push_of(4);
           f.table_bytes = 1ull << 40;
           c.send(&f, sizeof(f));
         },
         "past every bound"},
        {"more data than the node has memory",
         [&](RawClient& c) {
           auto f = push_of(4);
           f.data_bytes = 1ull << 60;
           c.send(&f, sizeof(f));
         },
         "more than half of the"},
        {"a copy whose byte flipped on the way",
         [&](RawClient& c) {
           const auto f = push_of(4);
           c.send(&f, sizeof(f));
           c.send(image->table.data(), image->table.size());
           std::vector<unsigned char> data(image->data.get(), image->data.get() + image->data_bytes);
           data[17] ^= 0x40;
           c.send(data.data(), data.size());
         },
         "does not match its checksum in /model/wte"},
        {"a copy cut short",
         [&](RawClient& c) {
           const auto f = push_of(4);
           c.send(&f, sizeof(f));
           c.send(image->table.data(), image->table.size() / 2);
         },
         ""},
    };
    for (const Row& row : rows) {
      CAPTURE(std::string(row.name));
      std::string said;
      uint32_t kind = 0;
      {
        RawClient c(holder->endpoint());
        row.send(c);
        if (std::string(row.name) != "a copy cut short") {
          auto [f, sentence] = c.answer();
          kind = f.kind;
          said = sentence;
        }
      }
      if (*row.said == '\0') {
        CHECK(kind == 0);
      } else {
        CHECK(kind == wire::kRefused);
        CHECK(said.find(row.said) != std::string::npos);
      }
      CHECK(held_step(*holder, 0) == 3);
    }
    // And the port still serves.
    RawClient c(holder->endpoint());
    const auto ask = frame(wire::kFetch, 5);
    c.send(&ask, sizeof(ask));
    CHECK(c.answer().first.kind == wire::kNoCopy);
  }

  TEST_CASE("a fetch from a holder that never answers ends within its bound with a sentence") {
    // A listener that accepts and says nothing.
    boost::asio::io_context io;
    boost::asio::ip::tcp::acceptor silent(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
    const std::string endpoint = "127.0.0.1:" + std::to_string(silent.local_endpoint().port());
    Memfd area;
    auto back = buddy_over({area.fd});
    const auto began = std::chrono::steady_clock::now();
    const auto got = fetch(*back, {0}, 0, {{"node-1", endpoint}}, std::chrono::milliseconds(1500));
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    CHECK(took < 10);
    CHECK(got.filled.empty());
    REQUIRE(got.problems.size() == 1);
    CHECK(got.problems[0].find("timed out") != std::string::npos);
  }
}

}  // namespace keel::test
