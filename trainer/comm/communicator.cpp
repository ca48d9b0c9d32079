#include "trainer/comm/communicator.h"

#include "common/error.h"

#include <fmt/format.h>

#include <chrono>
#include <utility>

namespace keel::trainer {
namespace {

using common::Error;
using common::ErrorCode;

constexpr uint64_t kFloatBytes = sizeof(float);

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

template <class Body>
void Communicator::instrumented(CollectiveOp op, uint64_t bytes, int peer, Body&& body) {
  if (faults_ != nullptr) faults_->before_collective(name_);
  const int64_t seq = next_seq_++;
  const auto index = static_cast<size_t>(op);
  stats_.calls[index] += 1;
  stats_.bytes[index] += bytes;
  const uint64_t id = recorder_->begin(name_, seq, collective_op_name(op), bytes, peer);
  if (board_ != nullptr) board_->begin_collective(board_group_, seq, collective_op_name(op), bytes);
  auto failed = [&](const std::string& message) {
    recorder_->end(id, FlightState::kFailed, message);
    if (board_ != nullptr) board_->end_collective(board_group_, seq, false);
  };
  const auto start = std::chrono::steady_clock::now();
  try {
    body();
  } catch (const Error& e) {
    // Backends raise bare transport errors; the group, op and sequence
    // number are what keeld and a reader of the log need to match this
    // failure with the other ranks' records.
    auto message = fmt::format("group '{}' {} seq {} (rank {} of {}): {}", name_, collective_op_name(op), seq, rank_,
                               size_, e.what());
    failed(message);
    throw Error(e.code(), message);
  } catch (const std::exception& e) {
    failed(e.what());
    throw;
  } catch (...) {
    failed("unknown exception");
    throw;
  }
  stats_.wait_ns +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  recorder_->end(id, FlightState::kDone);
  if (board_ != nullptr) board_->end_collective(board_group_, seq, true);
}

namespace {

// Argument errors are bugs in the caller: they are raised before the call
// takes a sequence number, so they never reach the wire or the recorder.
void check_buffer(const std::string& group, const char* op, const void* data, size_t count) {
  if (data == nullptr && count > 0) {
    throw Error(ErrorCode::kInternal, fmt::format("group '{}' {}: null buffer for {} elements", group, op, count));
  }
}

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

void Communicator::all_reduce(float* data, size_t count) {
  check_buffer(name_, "all_reduce", data, count);
  instrumented(CollectiveOp::kAllReduce, count * kFloatBytes, -1, [&] { do_all_reduce(data, count); });
}

void Communicator::reduce_scatter(const float* in, float* out, size_t count) {
  check_buffer(name_, "reduce_scatter", in, count);
  check_buffer(name_, "reduce_scatter", out, count);
  instrumented(CollectiveOp::kReduceScatter, static_cast<uint64_t>(size_) * count * kFloatBytes, -1,
               [&] { do_reduce_scatter(in, out, count); });
}

void Communicator::all_gather(const float* in, float* out, size_t count) {
  check_buffer(name_, "all_gather", in, count);
  check_buffer(name_, "all_gather", out, count);
  instrumented(CollectiveOp::kAllGather, count * kFloatBytes, -1, [&] { do_all_gather(in, out, count); });
}

void Communicator::broadcast(float* data, size_t count, int root) {
  check_buffer(name_, "broadcast", data, count);
  check_rank(name_, "broadcast", "root", root, size_);
  instrumented(CollectiveOp::kBroadcast, count * kFloatBytes, root, [&] { do_broadcast(data, count, root); });
}

void Communicator::send(const float* data, size_t count, int peer) {
  check_buffer(name_, "send", data, count);
  check_peer(name_, "send", peer, rank_, size_);
  instrumented(CollectiveOp::kSend, count * kFloatBytes, peer, [&] { do_send(data, count, peer); });
}

void Communicator::recv(float* data, size_t count, int peer) {
  check_buffer(name_, "recv", data, count);
  check_peer(name_, "recv", peer, rank_, size_);
  instrumented(CollectiveOp::kRecv, count * kFloatBytes, peer, [&] { do_recv(data, count, peer); });
}

void Communicator::all_to_all(const float* in, float* out, size_t count) {
  check_buffer(name_, "all_to_all", in, count);
  check_buffer(name_, "all_to_all", out, count);
  instrumented(CollectiveOp::kAllToAll, static_cast<uint64_t>(size_) * count * kFloatBytes, -1,
               [&] { do_all_to_all(in, out, count); });
}

void Communicator::barrier() {
  instrumented(CollectiveOp::kBarrier, 0, -1, [&] { do_barrier(); });
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
