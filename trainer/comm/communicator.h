// Collective communication within one process group (docs/architecture.md "Parallel layout and communication").
//
// Every call goes through one instrumented path in this base class: it takes
// the group's next sequence number and counts the payload bytes per
// operation when it is issued; when it runs, it is recorded in the flight
// recorder (in flight, then done or failed) and shown on the rank's progress
// board; only then does the backend's implementation run (Gloo on CPU, NCCL
// on GPU). Backends override the protected do_* methods and nothing else.
//
// The group's collectives run in issue order on its communication stream
// (docs/architecture.md "Streams"): a thread of the communicator's own. A
// blocking call issues its collective and waits for it; a start_* call
// issues it and returns a CommWork at once, so the caller can compute while
// the collective runs (gradient buckets reduced while backward goes on, the
// next layer's parameters gathered while this one computes). A blocking call
// with nothing in flight runs on the calling thread, which saves the hand
// over. One thread issues a communicator's calls; abort() and leave() may
// come from any thread.
//
// Every call has a timeout (the backend's). A failure raises Error with
// kPeerFailure (a peer died or the transport broke: exit 12) or
// kCollectiveHang (the collective outlived its timeout: exit 10), from the
// blocking call or from CommWork::wait(). After either, the communicator is
// unusable: the rank exits and keeld restarts the generation.
//
// Buffers are typed (dtype.h: a float* is float32, a bf16* bfloat16; the
// inputs and outputs of one call share a dtype), and element counts are per
// rank unless said otherwise. Payloads are counted in bytes. A backend says
// which dtypes it carries (carries()); another is refused as an argument
// error.
#pragma once

#include "health/board_publisher.h"
#include "health/fault_injector.h"
#include "trainer/comm/flight_recorder.h"
#include "trainer/kernels/dtype.h"
#include "trainer/kernels/stream.h"

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace boost::asio {
class thread_pool;
}

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
  kExchange,
};
inline constexpr size_t kCollectiveOpCount = 9;
const char* collective_op_name(CollectiveOp op);

// Payload bytes this rank handed to each operation: the logical size of the
// buffers, not what the algorithm put on the wire, so tests can hold them
// against closed-form formulas.
struct CommStats {
  std::array<uint64_t, kCollectiveOpCount> bytes{};
  std::array<uint64_t, kCollectiveOpCount> calls{};
  // Wall time the issuing thread spent blocked on the group's collectives:
  // the exposed communication time, which a rank's compute excludes.
  int64_t wait_ns = 0;
  // Wall time the collectives ran, overlapped with compute or not.
  int64_t busy_ns = 0;
  uint64_t bytes_of(CollectiveOp op) const { return bytes[static_cast<size_t>(op)]; }
  uint64_t calls_of(CollectiveOp op) const { return calls[static_cast<size_t>(op)]; }
};

class Communicator;

// A collective issued by a start_* call. Its buffers belong to it until
// wait() has returned: the caller must neither read its output nor change
// its input before. wait() raises the collective's failure, if any; a
// CommWork never waited for is abandoned (its failure unseen), so wait for
// every one. A default CommWork is complete.
class CommWork {
 public:
  CommWork() = default;
  CommWork(CommWork&&) noexcept = default;
  CommWork& operator=(CommWork&&) noexcept = default;

  // Blocks until the collective has completed; the time blocked is the
  // group's exposed wait. Does nothing when already waited for.
  void wait();
  // Issued and not waited for yet.
  bool pending() const { return result_.valid(); }

 private:
  friend class Communicator;
  CommWork(Communicator* comm, std::future<void> result) : comm_(comm), result_(std::move(result)) {}
  Communicator* comm_ = nullptr;
  std::future<void> result_;
};

class Communicator {
 public:
  virtual ~Communicator();

  // `name` identifies the group in logs and the flight recorder ("dp",
  // "tp", "world", ...); `recorder` may be shared by all groups of a rank.
  Communicator(std::string name, int rank, int size, std::shared_ptr<FlightRecorder> recorder);

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  CommStats stats() const;
  // Every later call is shown on `board` (nullptr: none), under this
  // group's own slot of its group table; the board must outlive the
  // communicator's calls.
  void set_progress_board(health::BoardPublisher* board);
  // Every later call first passes `faults` (nullptr: none), which may hold
  // it forever ([faults] hang_rank): the call then never begins, as when a
  // rank never reaches a collective its peers wait in.
  void set_fault_injector(const health::FaultInjector* faults) { faults_ = faults; }
  void reset_stats();
  // Every later collective starts only after the work queued on `compute`
  // before it was issued (nullptr: none), so a buffer a kernel just wrote
  // can be handed over at once. The stream must outlive the calls.
  void set_compute_stream(Stream* compute) { compute_ = compute; }

  // data[count] = sum over the group, in place. Payload: count elements.
  void all_reduce(Buffer data, size_t count);
  // in[size * count] (block r for rank r); out[count] = the sum over the
  // group of every rank's block `rank()`. Payload: size * count elements.
  void reduce_scatter(ConstBuffer in, Buffer out, size_t count);
  // in[count] from every rank; out[size * count], block r from rank r.
  // Payload: count elements.
  void all_gather(ConstBuffer in, Buffer out, size_t count);
  // data[count] from `root` to every rank. Payload: count elements.
  void broadcast(Buffer data, size_t count, int root);
  // Point to point; the peer must post the matching call (a receive, in
  // an exchange or alone).
  void send(ConstBuffer data, size_t count, int peer);
  void recv(Buffer data, size_t count, int peer);
  // Sends and receives with any peers, posted together and done together:
  // one call on the board and in the recorder. A pipeline stage sends an
  // activation on while it receives a gradient back; as separate blocking
  // calls issued in the same order on both sides, the two would wait for
  // each other. Between two ranks, transfers pair up in the order each
  // issues them (exchanges, sends and receives alike), so two ranks must
  // issue theirs in matching orders; a transfer and its partner have the
  // same count. Payload: the elements sent.
  struct Send {
    ConstBuffer data;
    size_t count;
    int peer;
  };
  struct Recv {
    Buffer data;
    size_t count;
    int peer;
  };
  void exchange(std::vector<Send> sends, std::vector<Recv> recvs);
  [[nodiscard]] CommWork start_exchange(std::vector<Send> sends, std::vector<Recv> recvs);
  // in: the blocks for ranks 0..size-1 back to back, send_counts[r]
  // elements for rank r; out: the blocks from ranks 0..size-1 back to back,
  // recv_counts[r] elements from rank r, which must be what rank r sends
  // this rank (MoE dispatch exchanges the counts first). Every rank takes
  // part, even one that moves nothing. Payload: the sum of send_counts.
  void all_to_all_v(ConstBuffer in, std::vector<size_t> send_counts, Buffer out, std::vector<size_t> recv_counts);
  // all_to_all_v with `count` elements to and from every rank.
  void all_to_all(ConstBuffer in, Buffer out, size_t count);
  void barrier();

  // all_reduce, reduce_scatter and all_gather issued without waiting.
  [[nodiscard]] CommWork start_all_reduce(Buffer data, size_t count);
  [[nodiscard]] CommWork start_reduce_scatter(ConstBuffer in, Buffer out, size_t count);
  [[nodiscard]] CommWork start_all_gather(ConstBuffer in, Buffer out, size_t count);

  // Whether this backend's collectives carry `dtype`.
  virtual bool carries(DType dtype) const = 0;

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
  // The stream the backend's collectives run on, which waits for the
  // compute stream's event before each of them.
  virtual Stream& communication_stream() { return host_stream_; }
  // Backends call it first in their destructors: a collective still in
  // flight then is aborted, and the communication thread stopped, before
  // the backend's state goes away.
  void stop_communication_thread() noexcept;

  // Buffers are of a dtype carries() accepts; in and out share it.
  virtual void do_all_reduce(Buffer data, size_t count) = 0;
  virtual void do_reduce_scatter(ConstBuffer in, Buffer out, size_t count) = 0;
  virtual void do_all_gather(ConstBuffer in, Buffer out, size_t count) = 0;
  virtual void do_broadcast(Buffer data, size_t count, int root) = 0;
  // Posts every transfer, then waits for all of them.
  virtual void do_exchange(const std::vector<Send>& sends, const std::vector<Recv>& recvs) = 0;
  virtual void do_all_to_all(ConstBuffer in, const std::vector<size_t>& send_counts, Buffer out,
                             const std::vector<size_t>& recv_counts) = 0;
  virtual void do_barrier() = 0;

  // For backends: reports a peer failure to the handler, if one is set.
  void notify_peer_failure(const std::string& cause);

 private:
  friend class CommWork;
  // Issues `body` as one instrumented call of `op` moving `bytes`: run on
  // the calling thread when `blocking` and nothing is in flight, else on
  // the communication thread.
  CommWork issue(CollectiveOp op, uint64_t bytes, int peer, bool blocking, std::function<void()> body);
  // Argument errors (kInternal, before a sequence number is taken): a null
  // buffer with elements, a dtype this backend does not carry, or in and
  // out of different dtypes.
  void check_buffer(const char* op, ConstBuffer buffer, size_t count) const;
  void check_buffers(const char* op, ConstBuffer in, ConstBuffer out, size_t in_count, size_t out_count) const;
  CommWork issue_exchange(CollectiveOp op, std::vector<Send> sends, std::vector<Recv> recvs, bool blocking);
  CommWork issue_all_reduce(Buffer data, size_t count, bool blocking);
  CommWork issue_reduce_scatter(ConstBuffer in, Buffer out, size_t count, bool blocking);
  CommWork issue_all_gather(ConstBuffer in, Buffer out, size_t count, bool blocking);
  // Runs a collective that `issue` took sequence number `seq` for.
  void run(CollectiveOp op, uint64_t bytes, int peer, int64_t seq, const std::function<void()>& body);
  // Runs `blocking`, the issuing thread waiting for collectives, and counts
  // its time as the group's exposed wait, on the board too.
  template <class Blocking> void waiting(Blocking&& blocking);
  // Blocks until `result` is ready (exposed wait), then raises its failure.
  void wait_for(std::future<void>& result);

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
  Stream* compute_ = nullptr;
  HostStream host_stream_;
  mutable std::mutex stats_mutex_;
  CommStats stats_;
  // Collectives issued and not finished: a blocking call runs inline only
  // when there are none. The pool is the communication thread.
  std::atomic<int> in_flight_{0};
  std::unique_ptr<boost::asio::thread_pool> thread_;
};

}  // namespace keel::trainer
