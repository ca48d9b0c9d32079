// keel-bench-buddy: the buddy copy of the in-memory snapshots
// (docs/architecture.md "In-memory snapshots", "Many nodes") between two
// keelds' SnapshotBuddy on this machine's loopback: how long a rank's
// snapshot takes to reach its buddy, unpaced and at the default pace, and
// how long a node that comes back takes to fill its fresh area from the
// copy (fetched, checked and written into the memfd, laid out afresh),
// against laying out the same fresh area, which its rank pays in any case:
// the difference is what a lost node adds to its restart. One JSON object
// per figure. Over loopback the network costs next to nothing: on a real
// one add bytes / its bandwidth.
#include <sys/mman.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstring>
#include <future>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "checkpoint/memory_snapshot.h"
#include "common/clock.h"
#include "daemon/snapshot_buddy.h"

namespace {

using keel::checkpoint::Piece;
using keel::checkpoint::SnapshotArea;
using keel::daemon::SnapshotBuddy;
using Clock = std::chrono::steady_clock;

struct Memfd {
  int fd = memfd_create("keel-bench-buddy", MFD_CLOEXEC);
  ~Memfd() { close(fd); }
};

// `bytes` of state in 32 MiB pieces.
std::vector<Piece> pieces_of(uint64_t bytes) {
  std::vector<Piece> pieces;
  constexpr int64_t kCols = 8 << 20;  // floats a row: 32 MiB
  for (uint64_t at = 0; at < bytes; at += kCols * 4) {
    pieces.push_back({"model", "w" + std::to_string(pieces.size()), {1, kCols}, 0, 0, 1, kCols});
  }
  return pieces;
}

// That state snapshotted as step `step`, a copy step (only those are copied).
void snapshot(int fd, uint64_t bytes, int64_t step) {
  const auto pieces = pieces_of(bytes);
  SnapshotArea area(fd, 2, /*copied=*/true);
  const auto where = area.begin(pieces, 1, /*copy_step=*/true);
  for (size_t i = 0; i < pieces.size(); ++i) std::fill_n(where[i], pieces[i].numel(), static_cast<float>(step + i));
  if (const auto why = area.commit(step, 0, 0)) throw std::runtime_error(*why);
}

std::unique_ptr<SnapshotBuddy> buddy(const std::vector<int>& fds, double mb_per_s) {
  auto b = std::make_unique<SnapshotBuddy>(
      keel::daemon::SnapshotBuddyOptions{"127.0.0.1", 0, 2, mb_per_s, [](std::function<void()> f) { f(); }});
  b->attach_areas(fds);
  return b;
}

// Seconds from a commit to the holder's copy of it.
double push(uint64_t bytes, double mb_per_s) {
  Memfd area;
  snapshot(area.fd, bytes, 1);  // the area's pages taken before the clock starts, as a rank does
  auto holder = buddy({}, 0);
  auto sender = buddy({area.fd}, mb_per_s);
  sender->send_to("holder", holder->endpoint(), 0);
  snapshot(area.fd, bytes, 2);
  const auto began = Clock::now();
  while (holder->held().empty() || holder->held()[0].step != 2)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return keel::common::seconds_since(began);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"keel-bench-buddy: the in-memory snapshots' copy to the next node, and a lost node's fetch of it"};
  double mb = 1100;
  app.add_option("--mb", mb, "a rank's state in MB (1100: keel-bench-keeld's large model)");
  double warm_gib = 0;
  app.add_option("--warm-gib", warm_gib,
                 "touch and free this much memory first: on a VM whose host backs a page at its first touch in the "
                 "guest (the CI VM: about 1.5 s a GB), the figures are then those of a node whose memory is backed");
  CLI11_PARSE(app, argc, argv);
  const auto bytes = static_cast<uint64_t>(mb * 1e6);
  if (warm_gib > 0) {
    const auto warm = static_cast<size_t>(warm_gib * (1ull << 30));
    void* at = mmap(nullptr, warm, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (at != MAP_FAILED) {
      std::memset(at, 1, warm);
      munmap(at, warm);
    }
  }
  try {
    for (double pace : {0.0, 1000.0}) {
      const double s = push(bytes, pace);
      std::cout << nlohmann::json{{"figure", "push"},
                                  {"bytes", bytes},
                                  {"pace_mb_per_s", pace},
                                  {"seconds", s},
                                  {"mb_per_s", bytes / s / 1e6}}
                       .dump()
                << std::endl;
    }
    // What a fresh area costs its rank in any case: laid out, its pages
    // taken and touched, when its first generation starts.
    {
      Memfd fresh;
      const auto began = Clock::now();
      SnapshotArea(fresh.fd, 2, /*copied=*/true).reserve(pieces_of(bytes));
      const double s = keel::common::seconds_since(began);
      std::cout << nlohmann::json{{"figure", "fresh_area"}, {"bytes", bytes}, {"slots", 5}, {"seconds", s}}.dump()
                << std::endl;
    }
    // A node back with a fresh area fills it from the holder's copy.
    Memfd area, fresh;
    snapshot(area.fd, bytes, 1);
    auto holder = buddy({}, 0);
    auto sender = buddy({area.fd}, 0);
    sender->send_to("holder", holder->endpoint(), 0);
    snapshot(area.fd, bytes, 2);
    while (holder->held().empty() || holder->held()[0].step != 2)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    auto back = buddy({fresh.fd}, 0);
    std::promise<keel::daemon::FetchedCopies> got;
    back->fetch({0}, 0, {{"holder", holder->endpoint()}}, std::chrono::seconds(600),
                [&](const keel::daemon::FetchedCopies& f) { got.set_value(f); });
    const auto fetched = got.get_future().get();
    if (fetched.filled.size() != 1) throw std::runtime_error("the fetch filled nothing");
    const auto began = Clock::now();
    const SnapshotArea restored(fresh.fd, 2);
    const auto verified = restored.verified(1, 0);
    const double verify_s = keel::common::seconds_since(began);
    if (verified.snapshots.size() != 1 || verified.snapshots[0].listed.step != 2) {
      throw std::runtime_error("the area filled from the copy does not verify");
    }
    const auto& filled = fetched.filled[0];
    std::cout << nlohmann::json{{"figure", "fetch"},
                                {"bytes", bytes},
                                {"seconds", fetched.seconds},
                                {"received_s", filled.received_s},
                                {"received_mb_per_s", bytes / filled.received_s / 1e6},
                                {"written_s", filled.written_s},
                                {"rank_verify_seconds", verify_s}}
                     .dump()
              << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "keel-bench-buddy: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
