// The buddy copy of the in-memory snapshots (docs/architecture.md
// "In-memory snapshots", "Many nodes"). A node lost takes its keeld's
// snapshot areas with it, so every keeld also holds copies of the newest
// copy steps (`keep` of them, as the areas keep; the ranks agree on which
// snapshots are copy steps, checkpoint/memory_snapshot.h) of each rank of
// the node before it in the generation's order (it is that node's buddy), and a
// keeld whose areas lack its ranks' state (it restarted, or its node is a
// spare in a lost one's place) fetches their copies into its areas before
// its ranks start: they resume from memory with the others, as if the node
// had never gone.
//
// None of it runs on keeld's loop: a server thread takes the copies pushed
// to it and answers fetches (a thread per connection, every read and write
// bounded), a sender thread pushes the newest step every local area holds
// once the node's ranks have all committed it, at low priority (nice 19,
// DSCP CS1, paced), and
// fetches run in turn on a thread of their own and post their outcome to
// the loop. Each copy the buddy accepted is marked in its slot, which the
// rank waits for before it votes for the next copy step.
//
// A copy is checked (every piece's XXH3) where it arrives, and again by
// the rank that restores it; one that does not verify is refused and the
// copy before it kept. The port is bound on the node's [cluster] address,
// the job's network, which is trusted as Gloo's and NCCL's connections are.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/memory_snapshot.h"
#include "common/unique_fd.h"

namespace keel::daemon {

// What goes over the wire between keelds: a frame, then `table_bytes` of
// piece table and `data_bytes` of data (a refusal: its sentence). Both ends
// are keelds of one job, built alike; the floats go as the slots hold them.
// A connection carries any number of frames in turn.
namespace buddy_wire {
constexpr char kMagic[8] = {'K', 'E', 'E', 'L', 'B', 'D', 'Y', '1'};
enum FrameKind : uint32_t {
  kPush = 1,      // a copy of global rank `rank`'s newest snapshot, for the buddy to hold
  kAccepted = 2,  // the push verified and is held
  kRefused = 3,   // the push is not held, and why; the connection ends after it
  kFetch = 4,     // the copy of `rank`, please
  kCopy = 5,      // here it is
  kNoCopy = 6,    // none held
};
struct Frame {
  char magic[8];
  uint32_t kind;
  uint32_t pieces;
  int64_t rank;
  int64_t step;
  int64_t tokens;
  uint64_t layout_hash;
  uint64_t table_bytes;
  uint64_t data_bytes;
};
}  // namespace buddy_wire

struct SnapshotBuddyOptions {
  std::string address;      // bound for the copies: the node's [cluster] address
  uint16_t port = 0;        // 0: any free one
  int keep = 2;             // checkpoint.memory_keep: areas written from copies keep as many
  double max_mb_per_s = 0;  // the pace of the copies sent; 0: as fast as the network takes them
  // Runs a function on keeld's loop: a fetch's outcome goes there.
  std::function<void(std::function<void()>)> post;
};

// A copy this node holds of another node's rank.
struct HeldCopy {
  int64_t rank = 0;  // global
  int64_t step = 0;
  uint64_t bytes = 0;
};

// The last copy of a local rank's snapshot its buddy accepted.
struct SentCopy {
  int64_t rank = 0;  // global
  int64_t step = 0;
  uint64_t bytes = 0;
  double seconds = 0;  // from the first byte sent to the buddy's answer
  std::string to;      // the buddy's node name
};

// A copy step the buddy does not hold yet: the ranks take no copy step
// after it until it does, and it is sent again at growing intervals.
struct CopyFailure {
  int64_t step = 0;
  int tries = 0;
  std::string why;  // the last try's
};

// A fetch's outcome: each local rank's area filled from a copy, and a
// sentence for each that could not be.
struct FetchedCopies {
  struct Filled {
    int local = 0;
    int64_t rank = 0;            // global
    std::vector<int64_t> steps;  // of the copies written, newest first
    uint64_t bytes = 0;          // of them all
    std::string from;            // the node that held them
    double received_s = 0;       // their transfer and check
    // Writing it into the area, which includes laying the area out afresh
    // (its pages taken and touched), as a rank does for a fresh area anyway.
    double written_s = 0;
  };
  std::vector<Filled> filled;
  std::vector<int64_t> absent;        // global ranks no node held a copy of (a new job: none has any)
  std::vector<std::string> problems;  // holders out of reach, copies that did not verify or fit
  double seconds = 0;
};

class SnapshotBuddy {
 public:
  // Listens on address:port and starts the server and sender threads.
  // Error(kBadConfig) when the address cannot be bound.
  explicit SnapshotBuddy(SnapshotBuddyOptions options);
  // Stops every thread within about a second; a fetch under way ends
  // with a problem and calls back nonetheless.
  ~SnapshotBuddy();
  SnapshotBuddy(const SnapshotBuddy&) = delete;
  SnapshotBuddy& operator=(const SnapshotBuddy&) = delete;

  // "address:port", for the node's join record.
  std::string endpoint() const;

  // Each local rank's area (RankSet's memfds, which this duplicates), once,
  // before anything is sent or fetched: the endpoint is needed before the
  // job that makes them exists.
  void attach_areas(const std::vector<int>& area_fds);

  // From now on, every copy step the local ranks commit goes to the keeld
  // at `endpoint` (node `node`) as global rank `first_rank` + local. A
  // snapshot already in an area when this is called is not sent: it may
  // belong to another rank numbering. An empty endpoint stops the sending.
  void send_to(const std::string& node, const std::string& endpoint, int64_t first_rank);

  // Fills each area `locals` names with the newest copy of global rank
  // `first_rank` + local held by the first of `holders` (node name and
  // endpoint, tried in order; this node's own copies are looked at first)
  // that has one, within `within`. `done` gets the outcome on keeld's loop.
  // Only while no rank of this node runs.
  struct Holder {
    std::string node;
    std::string endpoint;
  };
  void fetch(std::vector<int> locals, int64_t first_rank, std::vector<Holder> holders, std::chrono::milliseconds within,
             std::function<void(FetchedCopies)> done);

  // What this node holds for others, and what its buddy last accepted of
  // each local rank (absent: nothing yet).
  std::vector<HeldCopy> held() const;
  std::vector<std::optional<SentCopy>> sent() const;
  // The copy step the buddy could not take yet (nullopt: none).
  std::optional<CopyFailure> failing() const;
  // Drops the copies held of steps after `step` (an SDC verdict's last good
  // step); returns how many.
  int drop_after(int64_t step);

  // The server's and the connections' bookkeeping, in snapshot_buddy.cpp.
  struct Server;

 private:
  void send_until_stopped();
  void fetch_until_stopped();
  // The newest copy step of this generation (a slot sequence above the
  // area's floor) every local area holds complete: the node's copies go in
  // lockstep, so that the holder has one step of all of them. `held`: per
  // area, whether the buddy holds its slot of the step.
  struct CommonStep {
    int64_t step;
    std::vector<bool> held;
  };
  std::optional<CommonStep> common_step() const;
  // Sends every local rank's snapshot of `step` to the buddy, but those it
  // holds already; nullopt when it holds them all, else why not.
  std::optional<std::string> send_step(int64_t step, const std::vector<bool>& already_held);

  SnapshotBuddyOptions options_;
  std::shared_ptr<Server> server_;
  std::vector<common::UniqueFd> areas_;  // set once by attach_areas()

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::string buddy_node_;
  std::string buddy_endpoint_;
  int64_t first_rank_ = 0;
  uint64_t pointed_ = 0;  // how many times send_to() was called
  // Per local area, the last sequence it had given when the generation
  // began: its slots up to it are another generation's and never sent.
  std::vector<uint64_t> floors_;
  // Per local rank, what the buddy last accepted.
  std::vector<std::optional<SentCopy>> sent_;
  // When the step last sent is not held by the buddy (failing_): when to
  // send it again, and how long the wait before that was.
  std::optional<std::chrono::steady_clock::time_point> retry_at_;
  std::chrono::steady_clock::duration retry_wait_{};
  std::optional<CopyFailure> failing_;
  std::deque<std::function<void()>> fetches_;  // asked for, not yet begun
  std::thread sender_;
  std::thread fetcher_;
};

}  // namespace keel::daemon
