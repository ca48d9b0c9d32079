// Collective communication within one process group (docs/architecture.md "Parallel layout and communication").
//
// Every call goes through one instrumented path in this base class: it takes
// the group's next sequence number, counts the payload bytes per operation,
// records the call in the flight recorder (in flight, then done or failed),
// shows it on the rank's progress board, and only then runs the backend's implementation (Gloo on CPU, NCCL on GPU).
// Backends override the protected do_* methods and nothing else.
//
// Every call has a timeout (the backend's). A failure raises Error with
// kPeerFailure (a peer died or the transport broke: exit 12) or
// kCollectiveHang (the collective outlived its timeout: exit 10). After
// either, the communicator is unusable: the rank exits and keeld restarts
// the generation.
//
// Buffers are float32 and element counts are per rank unless said otherwise.
#pragma once

#include "health/board_publisher.h"
#include "health/fault_injector.h"
#include "trainer/comm/flight_recorder.h"

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

namespace keel::trainer {

enum class CollectiveOp : int {
  kAllReduce,
  kReduceScatter,
  kAllGather,
  kBroadcast,
  kSend,
  kRecv,
  kAllToAll,
  kBarrier,
};
inline constexpr size_t kCollectiveOpCount = 8;
const char* collective_op_name(CollectiveOp op);

// Payload bytes this rank handed to each operation: the logical size of the
// buffers, not what the algorithm put on the wire, so tests can hold them
// against closed-form formulas.
struct CommStats {
  std::array<uint64_t, kCollectiveOpCount> bytes{};
  std::array<uint64_t, kCollectiveOpCount> calls{};
  int64_t wait_ns = 0;  // wall time inside the calls: what a rank's compute excludes
  uint64_t bytes_of(CollectiveOp op) const { return bytes[static_cast<size_t>(op)]; }
  uint64_t calls_of(CollectiveOp op) const { return calls[static_cast<size_t>(op)]; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  // `name` identifies the group in logs and the flight recorder ("dp",
  // "tp", "world", ...); `recorder` may be shared by all groups of a rank.
  Communicator(std::string name, int rank, int size, std::shared_ptr<FlightRecorder> recorder);

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  const CommStats& stats() const { return stats_; }
  // Every later call is shown on `board` (nullptr: none), under this
  // group's own slot of its group table; the board must outlive the
  // communicator's calls.
  void set_progress_board(health::BoardPublisher* board);
  // Every later call first passes `faults` (nullptr: none), which may hold
  // it forever ([faults] hang_rank): the call then never begins, as when a
  // rank never reaches a collective its peers wait in.
  void set_fault_injector(const health::FaultInjector* faults) { faults_ = faults; }
  void reset_stats() { stats_ = CommStats{}; }

  // data[count] = sum over the group, in place. Payload: count floats.
  void all_reduce(float* data, size_t count);
  // in[size * count] (block r for rank r); out[count] = the sum over the
  // group of every rank's block `rank()`. Payload: size * count floats.
  void reduce_scatter(const float* in, float* out, size_t count);
  // in[count] from every rank; out[size * count], block r from rank r.
  // Payload: count floats.
  void all_gather(const float* in, float* out, size_t count);
  // data[count] from `root` to every rank. Payload: count floats.
  void broadcast(float* data, size_t count, int root);
  // Point to point; the peer must post the matching call.
  void send(const float* data, size_t count, int peer);
  void recv(float* data, size_t count, int peer);
  // in[size * count]: block r goes to rank r; out[size * count]: block r
  // came from rank r. Payload: size * count floats.
  void all_to_all(const float* in, float* out, size_t count);
  void barrier();

  // Makes every pending and future call on this communicator fail quickly;
  // safe to call from another thread (the watchdog).
  virtual void abort() = 0;

  // This rank is about to exit because of `cause` (say, a failure in
  // another of its groups): tells the group's other ranks, so that they fail
  // with kPeerFailure at once instead of waiting out their timeouts, and
  // aborts. Without a way to tell them, the default only aborts.
  virtual void leave(const std::string& cause) {
    (void)cause;
    abort();
  }

  // Runs `handler` (on whatever thread noticed it) when this communicator
  // learns, while blocked or not, that a peer failed or left, just before
  // it aborts itself. keel-trainer leaves the rank's other groups from it, so
  // the news travels through every group to every rank, including ranks
  // blocked in a group the failed rank was never part of. Setting another
  // handler (or none) waits for a call of the old one to finish. The
  // handler must not throw.
  void set_peer_failure_handler(std::function<void(const std::string& cause)> handler);

 protected:
  virtual void do_all_reduce(float* data, size_t count) = 0;
  virtual void do_reduce_scatter(const float* in, float* out, size_t count) = 0;
  virtual void do_all_gather(const float* in, float* out, size_t count) = 0;
  virtual void do_broadcast(float* data, size_t count, int root) = 0;
  virtual void do_send(const float* data, size_t count, int peer) = 0;
  virtual void do_recv(float* data, size_t count, int peer) = 0;
  virtual void do_all_to_all(const float* in, float* out, size_t count) = 0;
  virtual void do_barrier() = 0;

  // For backends: reports a peer failure to the handler, if one is set.
  void notify_peer_failure(const std::string& cause);

 private:
  // Runs `body` as one instrumented call of `op` moving `bytes`.
  template <class Body> void instrumented(CollectiveOp op, uint64_t bytes, int peer, Body&& body);

  std::string name_;
  int rank_;
  int size_;
  std::shared_ptr<FlightRecorder> recorder_;
  health::BoardPublisher* board_ = nullptr;
  int board_group_ = -1;
  const health::FaultInjector* faults_ = nullptr;
  std::mutex handler_mutex_;
  std::function<void(const std::string&)> peer_failure_handler_;
  int64_t next_seq_ = 0;
  CommStats stats_;
};

}  // namespace keel::trainer
