#include "trainer/comm/communicator.h"

#include "common/error.h"
#include "common/shared_cpus.h"

#include <fmt/format.h>

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>

#include <chrono>
#include <numeric>
#include <utility>

namespace keel::trainer {
namespace {

using common::Error;
using common::ErrorCode;

}  // namespace

const char* collective_op_name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllReduce: return "all_reduce";
    case CollectiveOp::kReduceScatter: return "reduce_scatter";
    case CollectiveOp::kAllGather: return "all_gather";
    case CollectiveOp::kBroadcast: return "broadcast";
    case CollectiveOp::kSend: return "send";
    case CollectiveOp::kRecv: return "recv";
    case CollectiveOp::kAllToAll: return "all_to_all";
    case CollectiveOp::kBarrier: return "barrier";
    case CollectiveOp::kExchange: return "exchange";
  }
  return "unknown";
}

Communicator::Communicator(std::string name, int rank, int size, std::shared_ptr<FlightRecorder> recorder)
    : name_(std::move(name)), rank_(rank), size_(size), recorder_(std::move(recorder)) {
  if (size_ < 1 || rank_ < 0 || rank_ >= size_) {
    throw Error(ErrorCode::kInternal,
                fmt::format("group '{}': rank {} outside a group of size {}", name_, rank_, size_));
  }
  // A communicator built without a shared recorder still records its own
  // calls, so every call takes the same path.
  if (!recorder_) recorder_ = std::make_shared<FlightRecorder>();
}

void Communicator::set_progress_board(health::BoardPublisher* board) {
  board_ = board;
  if (board_ != nullptr) board_group_ = board_->add_group(name_, rank_, size_);
}

// The backend's destructor has stopped the thread already (its state, which
// a collective in flight uses, is gone by now); this only joins an idle one.
Communicator::~Communicator() {
  if (thread_) thread_->join();
}

void Communicator::stop_communication_thread() noexcept {
  if (!thread_) return;
  // A collective left in flight (the rank is failing for another reason)
  // would keep the thread in the backend until its timeout.
  if (in_flight_.load() > 0) abort();
  thread_->stop();
  thread_->join();
  thread_.reset();
}

CommStats Communicator::stats() const {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  return stats_;
}

void Communicator::reset_stats() {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  stats_ = CommStats{};
}

template <class Blocking>
void Communicator::waiting(Blocking&& blocking) {
  const auto mark = board_ != nullptr ? board_->begin_wait() : health::BoardPublisher::WaitMark{};
  const auto start = std::chrono::steady_clock::now();
  auto count = [&] {
    if (board_ != nullptr) board_->end_wait(mark);
    std::lock_guard<std::mutex> lock(stats_mutex_);
    stats_.wait_ns +=
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  };
  try {
    blocking();
  } catch (...) {
    count();
    throw;
  }
  count();
}

CommWork Communicator::issue(CollectiveOp op, uint64_t bytes, int peer, bool blocking, std::function<void()> body) {
  // On the issuing thread, which owns the injector's state: a held rank
  // never issues the call.
  if (faults_ != nullptr) faults_->before_collective(name_);
  const int64_t seq = next_seq_++;
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    stats_.calls[static_cast<size_t>(op)] += 1;
    stats_.bytes[static_cast<size_t>(op)] += bytes;
  }
  std::shared_ptr<StreamEvent> inputs_ready = compute_ != nullptr ? compute_->record() : nullptr;
  auto task = [this, op, bytes, peer, seq, inputs_ready, body = std::move(body)] {
    if (inputs_ready) communication_stream().wait(*inputs_ready);
    run(op, bytes, peer, seq, body);
  };
  if (blocking && in_flight_.load() == 0) {
    waiting(task);
    return {};
  }
  if (!thread_) {
    const common::SharedCpuScope shared_cpus;  // the thread runs there (common/shared_cpus.h)
    thread_ = std::make_unique<boost::asio::thread_pool>(1);
  }
  auto done = std::make_shared<std::promise<void>>();
  CommWork work(this, done->get_future());
  in_flight_.fetch_add(1);
  // Out of flight before the waiter wakes, so that a caller done with the
  // group never finds its last collective still counted.
  boost::asio::post(*thread_, [this, done, task = std::move(task)] {
    try {
      task();
      in_flight_.fetch_sub(1);
      done->set_value();
    } catch (...) {
      in_flight_.fetch_sub(1);
      done->set_exception(std::current_exception());
    }
  });
  if (blocking) work.wait();
  return work;
}

void Communicator::run(CollectiveOp op, uint64_t bytes, int peer, int64_t seq, const std::function<void()>& body) {
  const uint64_t id = recorder_->begin(name_, seq, collective_op_name(op), bytes, peer);
  if (board_ != nullptr) board_->begin_collective(board_group_, seq, collective_op_name(op), bytes);
  const auto start = std::chrono::steady_clock::now();
  auto finished = [&](FlightState state, const std::string& message) {
    recorder_->end(id, state, message);
    if (board_ != nullptr) board_->end_collective(board_group_, seq, state == FlightState::kDone);
    std::lock_guard<std::mutex> lock(stats_mutex_);
    stats_.busy_ns +=
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  };
  try {
    body();
  } catch (const Error& e) {
    // Backends raise bare transport errors; the group, op and sequence
    // number are what keeld and a reader of the log need to match this
    // failure with the other ranks' records.
    auto message = fmt::format("group '{}' {} seq {} (rank {} of {}): {}", name_, collective_op_name(op), seq, rank_,
                               size_, e.what());
    finished(FlightState::kFailed, message);
    throw Error(e.code(), message);
  } catch (const std::exception& e) {
    finished(FlightState::kFailed, e.what());
    throw;
  } catch (...) {
    finished(FlightState::kFailed, "unknown exception");
    throw;
  }
  finished(FlightState::kDone, "");
}

void Communicator::wait_for(std::future<void>& result) {
  waiting([&] { result.wait(); });
  result.get();
}

void CommWork::wait() {
  if (!result_.valid()) return;
  comm_->wait_for(result_);
}

namespace {

// Argument errors are bugs in the caller: they are raised before the call
// takes a sequence number, so they never reach the wire or the recorder.
void check_rank(const std::string& group, const char* op, const char* what, int value, int size) {
  if (value < 0 || value >= size) {
    throw Error(ErrorCode::kInternal,
                fmt::format("group '{}' {}: {} {} outside a group of size {}", group, op, what, value, size));
  }
}

void check_peer(const std::string& group, const char* op, int peer, int rank, int size) {
  check_rank(group, op, "peer", peer, size);
  if (peer == rank) {
    throw Error(ErrorCode::kInternal, fmt::format("group '{}' {}: rank {} cannot be its own peer", group, op, rank));
  }
}

}  // namespace

void Communicator::check_buffer(const char* op, ConstBuffer buffer, size_t count) const {
  if (buffer.data == nullptr && count > 0) {
    throw Error(ErrorCode::kInternal, fmt::format("group '{}' {}: null buffer for {} elements", name_, op, count));
  }
  if (!carries(buffer.dtype)) {
    throw Error(ErrorCode::kInternal,
                fmt::format("group '{}' {}: this communicator does not carry {}", name_, op, dtype_name(buffer.dtype)));
  }
}

void Communicator::check_buffers(const char* op, ConstBuffer in, ConstBuffer out, size_t in_count,
                                 size_t out_count) const {
  check_buffer(op, in, in_count);
  check_buffer(op, out, out_count);
  if (in.dtype != out.dtype) {
    throw Error(ErrorCode::kInternal, fmt::format("group '{}' {}: input {} but output {}", name_, op,
                                                  dtype_name(in.dtype), dtype_name(out.dtype)));
  }
}

void Communicator::all_reduce(Buffer data, size_t count) { issue_all_reduce(data, count, true); }

void Communicator::reduce_scatter(ConstBuffer in, Buffer out, size_t count) {
  issue_reduce_scatter(in, out, count, true);
}

void Communicator::all_gather(ConstBuffer in, Buffer out, size_t count) { issue_all_gather(in, out, count, true); }

void Communicator::broadcast(Buffer data, size_t count, int root) {
  check_buffer("broadcast", data, count);
  check_rank(name_, "broadcast", "root", root, size_);
  issue(CollectiveOp::kBroadcast, count * dtype_bytes(data.dtype), root, true,
        [=, this] { do_broadcast(data, count, root); });
}

void Communicator::send(ConstBuffer data, size_t count, int peer) {
  issue_exchange(CollectiveOp::kSend, {{data, count, peer}}, {}, true);
}

void Communicator::recv(Buffer data, size_t count, int peer) {
  issue_exchange(CollectiveOp::kRecv, {}, {{data, count, peer}}, true);
}

void Communicator::exchange(std::vector<Send> sends, std::vector<Recv> recvs) {
  issue_exchange(CollectiveOp::kExchange, std::move(sends), std::move(recvs), true);
}

CommWork Communicator::start_exchange(std::vector<Send> sends, std::vector<Recv> recvs) {
  return issue_exchange(CollectiveOp::kExchange, std::move(sends), std::move(recvs), false);
}

CommWork Communicator::issue_exchange(CollectiveOp op, std::vector<Send> sends, std::vector<Recv> recvs,
                                      bool blocking) {
  const char* name = collective_op_name(op);
  uint64_t bytes = 0;
  for (const Send& s : sends) {
    check_buffer(name, s.data, s.count);
    check_peer(name_, name, s.peer, rank_, size_);
    bytes += s.count * dtype_bytes(s.data.dtype);
  }
  for (const Recv& r : recvs) {
    check_buffer(name, r.data, r.count);
    check_peer(name_, name, r.peer, rank_, size_);
    if (op == CollectiveOp::kRecv) bytes += r.count * dtype_bytes(r.data.dtype);
  }
  // The recorder and the board name the peer of a lone send or receive.
  const int peer = sends.size() + recvs.size() == 1 ? (sends.empty() ? recvs[0].peer : sends[0].peer) : -1;
  return issue(op, bytes, peer, blocking, [this, sends = std::move(sends), recvs = std::move(recvs)] {
    do_exchange(sends, recvs);
  });
}

void Communicator::all_to_all_v(ConstBuffer in, std::vector<size_t> send_counts, Buffer out,
                                std::vector<size_t> recv_counts) {
  const auto ranks = static_cast<size_t>(size_);
  if (send_counts.size() != ranks || recv_counts.size() != ranks) {
    throw Error(ErrorCode::kInternal,
                fmt::format("group '{}' all_to_all: {} send and {} receive counts for {} ranks", name_,
                            send_counts.size(), recv_counts.size(), size_));
  }
  const auto self = static_cast<size_t>(rank_);
  if (send_counts[self] != recv_counts[self]) {
    throw Error(ErrorCode::kInternal,
                fmt::format("group '{}' all_to_all: rank {} sends itself {} elements but expects {}", name_, rank_,
                            send_counts[self], recv_counts[self]));
  }
  const size_t sent = std::accumulate(send_counts.begin(), send_counts.end(), size_t{0});
  const size_t received = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
  check_buffers("all_to_all", in, out, sent, received);
  issue(CollectiveOp::kAllToAll, sent * dtype_bytes(in.dtype), -1, true,
        [=, this, send_counts = std::move(send_counts), recv_counts = std::move(recv_counts)] {
          do_all_to_all(in, send_counts, out, recv_counts);
        });
}

void Communicator::all_to_all(ConstBuffer in, Buffer out, size_t count) {
  const std::vector<size_t> counts(static_cast<size_t>(size_), count);
  all_to_all_v(in, counts, out, counts);
}

void Communicator::barrier() {
  issue(CollectiveOp::kBarrier, 0, -1, true, [this] { do_barrier(); });
}

CommWork Communicator::start_all_reduce(Buffer data, size_t count) { return issue_all_reduce(data, count, false); }

CommWork Communicator::start_reduce_scatter(ConstBuffer in, Buffer out, size_t count) {
  return issue_reduce_scatter(in, out, count, false);
}

CommWork Communicator::start_all_gather(ConstBuffer in, Buffer out, size_t count) {
  return issue_all_gather(in, out, count, false);
}

CommWork Communicator::issue_all_reduce(Buffer data, size_t count, bool blocking) {
  check_buffer("all_reduce", data, count);
  return issue(CollectiveOp::kAllReduce, count * dtype_bytes(data.dtype), -1, blocking,
               [=, this] { do_all_reduce(data, count); });
}

CommWork Communicator::issue_reduce_scatter(ConstBuffer in, Buffer out, size_t count, bool blocking) {
  check_buffers("reduce_scatter", in, out, static_cast<size_t>(size_) * count, count);
  return issue(CollectiveOp::kReduceScatter, static_cast<uint64_t>(size_) * count * dtype_bytes(in.dtype), -1, blocking,
               [=, this] { do_reduce_scatter(in, out, count); });
}

CommWork Communicator::issue_all_gather(ConstBuffer in, Buffer out, size_t count, bool blocking) {
  check_buffers("all_gather", in, out, count, static_cast<size_t>(size_) * count);
  return issue(CollectiveOp::kAllGather, count * dtype_bytes(in.dtype), -1, blocking,
               [=, this] { do_all_gather(in, out, count); });
}

void Communicator::set_peer_failure_handler(std::function<void(const std::string& cause)> handler) {
  std::lock_guard<std::mutex> lock(handler_mutex_);
  peer_failure_handler_ = std::move(handler);
}

void Communicator::notify_peer_failure(const std::string& cause) {
  // Held while the handler runs, so that clearing the handler waits for a
  // call in progress: the owner may then destroy what the handler touches.
  std::lock_guard<std::mutex> lock(handler_mutex_);
  if (peer_failure_handler_) peer_failure_handler_(cause);
}

}  // namespace keel::trainer
