// GlooCommunicator: the CPU communicator (docs/architecture.md "Parallel layout and communication"), Debian's Gloo
// (2022-05 snapshot) over its TCP transport on the loopback interface.
//
// Construction connects a full mesh of TCP pairs through the Store. Gloo's
// rendezvous keys are prefixed with "gloo/<group_name>/", so many groups can
// share one Store; a name must therefore be unique among the live groups of
// a Store (two DP groups are "dp.0" and "dp.1", not both "dp"), and a name
// reused for a new generation needs a fresh Store or a generation in the
// name, or it would meet the old generation's addresses.
//
// Algorithms: Gloo's ring all_reduce (fixed segmentation, so results are
// bit-identical run to run and on every rank), ring all_gather, binomial-tree
// broadcast, pairwise all_to_all and dissemination barrier; reduce_scatter is
// a ring on Gloo's unbound buffers (gloo_communicator.cpp says why not Gloo's
// legacy ReduceScatterHalvingDoubling); send/recv are unbound-buffer
// messages tagged by their order between the two ranks.
//
// Every wait inside an operation is bounded by `timeout`. Failures, as
// measured on this Gloo (tests/trainer/gloo_communicator_test.cpp):
// * a peer that never joins: the ranks waiting on it directly raise
//   kCollectiveHang after `timeout` ("Timed out waiting ... for recv|send operation");
//   Gloo then closes every pair of the timed-out rank, so ranks further
//   away in the algorithm may see kPeerFailure first;
// * a peer that dies or destroys its communicator: kPeerFailure within
//   milliseconds ("Connection closed by peer");
// * abort(): every pending and later call of this communicator raises
//   kCollectiveHang at once (the watchdog aborts a call that outlived its
//   deadline); its peers see the connections close: kPeerFailure.
// After any failure the communicator is unusable (Gloo has closed its pairs):
// the rank exits and keeld restarts the generation.
//
// Semantics beyond communicator.h: send() returns once the peer has posted
// the matching recv() and the data has been handed to the socket, so two
// ranks that both send to each other first deadlock (until the timeout);
// order pipeline traffic so that one side receives first.
//
// The constructor ignores SIGPIPE for the process (when it still has the
// default action): a write to a peer that just died must become
// kPeerFailure, not kill the rank.
#pragma once

#include "common/error.h"
#include "store/store.h"
#include "trainer/comm/communicator.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace gloo {
class Context;
}

namespace keel::trainer {

class GlooCommunicator final : public Communicator {
 public:
  // Blocks until all `size` ranks of the group have connected; a rank that
  // does not arrive within `timeout` makes it raise kPeerFailure. `store`
  // must outlive the communicator: failures are reported through it.
  // `rank_failed_key` (empty: none) is the key keeld sets when a rank of
  // the job dies (store::rank_failed_key): the watcher aborts on it too,
  // since a rank killed outright records nothing itself. The transport
  // binds `bind_address` (the node's address, KEEL_BIND_ADDRESS) and
  // advertises it to the peers: Error(kBadConfig) when it cannot be bound.
  GlooCommunicator(store::Store& store, std::string group_name, int rank, int size,
                   std::chrono::milliseconds timeout, std::shared_ptr<FlightRecorder> recorder,
                   std::string rank_failed_key = "", const std::string& bind_address = "127.0.0.1");
  ~GlooCommunicator() override;
  GlooCommunicator(const GlooCommunicator&) = delete;
  GlooCommunicator& operator=(const GlooCommunicator&) = delete;

  void abort() override;
  // Gloo carries float32 only: the CPU path has no other dtype.
  bool carries(DType dtype) const override { return dtype == DType::kF32; }

  void leave(const std::string& cause) override;

  // Failure propagation. This Gloo does not wake a pending send when the
  // pair under it breaks, so a rank blocked in a send to a peer that has
  // exited would wait out its whole timeout and report a hang although a
  // peer died. Each rank therefore records the first failure of the group
  // in the Store under failure_key(group) ("<code name>|<rank>|<message>",
  // the first writer wins), and a watcher thread (groups of two or more)
  // aborts this communicator with kPeerFailure as soon as another rank has
  // recorded a peer failure. A rank whose own wait times out does not
  // consult the record, so a genuine hang is still reported as one. keeld
  // can read the key to learn the first cause. leave() writes its own key,
  // left_key(group) ("<rank>|<cause>"), which the watcher also polls, so a
  // departure is seen even when the failure record holds another cause.
  // And keeld's rank_failed key, for a peer that died without a word.
  static std::string failure_key(const std::string& group_name);
  static std::string left_key(const std::string& group_name);

 protected:
  void do_all_reduce(Buffer data, size_t count) override;
  void do_reduce_scatter(ConstBuffer in, Buffer out, size_t count) override;
  void do_all_gather(ConstBuffer in, Buffer out, size_t count) override;
  void do_broadcast(Buffer data, size_t count, int root) override;
  void do_exchange(const std::vector<Send>& sends, const std::vector<Recv>& recvs) override;
  void do_all_to_all(ConstBuffer in, const std::vector<size_t>& send_counts, Buffer out,
                     const std::vector<size_t>& recv_counts) override;
  void do_barrier() override;

 private:
  // Runs `body` (Gloo calls) and turns whatever Gloo throws into Error,
  // recording the group's first failure in the Store.
  template <class Body> void guarded(Body&& body);
  // Makes pending and later calls fail with `code` and `reason`.
  void abort_with(common::ErrorCode code, std::string reason);
  // The error a call raises once the communicator is aborted.
  common::Error abort_error();
  void record_failure(const common::Error& error);
  // Watcher thread: polls the failure record until stopped.
  void watch_for_peer_failures();
  // The tag of the next collective: every rank of the group makes the same
  // collective calls in the same order, so the counts agree across ranks
  // even when point-to-point calls (which only some ranks make) interleave.
  uint32_t next_collective_tag() { return static_cast<uint32_t>(collectives_++); }

  store::Store& store_;
  std::string rank_failed_key_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<gloo::Context> context_;
  std::atomic<bool> aborted_{false};
  std::mutex abort_mutex_;  // guards the two below, set before aborted_
  common::ErrorCode abort_code_ = common::ErrorCode::kCollectiveHang;
  std::string abort_reason_;
  std::mutex watch_mutex_;
  std::condition_variable watch_wakeup_;
  bool stopping_ = false;
  std::thread watcher_;
  uint64_t collectives_ = 0;
  // Messages sent to / received from each peer so far: the tag of a
  // point-to-point message, matched by order on the two sides of a pair.
  std::vector<uint64_t> sent_to_;
  std::vector<uint64_t> received_from_;
};

}  // namespace keel::trainer
