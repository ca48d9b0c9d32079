#include "trainer/comm/gloo_communicator.h"

#include "common/error.h"
#include "common/log.h"
#include "common/shared_cpus.h"
#include "common/thread_name.h"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <fmt/format.h>

#include <signal.h>

#include <algorithm>
#include <cctype>
#include <mutex>
#include <optional>
#include <string_view>
#include <utility>

namespace keel::trainer {
namespace {

using common::Error;
using common::ErrorCode;

// Slot prefixes for the operations keel builds from Gloo's unbound buffers.
// Gloo's own collectives use 0x01-0x08; these stay clear of them.
constexpr uint8_t kReduceScatterSlotPrefix = 0xf0;
constexpr uint8_t kPointToPointSlotPrefix = 0xf1;
// Never sent on: abort() waits for a message on it that cannot come.
constexpr uint8_t kAbortSlotPrefix = 0xf2;

constexpr const char* kAbortMessage = "communicator aborted";

void ignore_sigpipe_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      struct sigaction ignore {};
      ignore.sa_handler = SIG_IGN;
      sigemptyset(&ignore.sa_mask);
      sigaction(SIGPIPE, &ignore, nullptr);
    }
  });
}

// Gloo's rendezvous Store on top of keel's, under a per-group key prefix.
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(store::Store& store, std::string prefix, std::chrono::milliseconds timeout)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(prefix_ + key, std::string(data.begin(), data.end()));
  }

  // Gloo reads some keys it never waited for (connectFullMesh's "rank_<i>")
  // and relies on get() blocking until they exist, as its own stores do.
  std::vector<char> get(const std::string& key) override {
    store_.wait({prefix_ + key}, timeout_);
    auto value = store_.get(prefix_ + key);
    if (!value) throw Error(ErrorCode::kPeerFailure, "rendezvous key " + prefix_ + key + " disappeared");
    return std::vector<char>(value->begin(), value->end());
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> prefixed;
    prefixed.reserve(keys.size());
    for (const auto& key : keys) prefixed.push_back(prefix_ + key);
    store_.wait(prefixed, timeout);
  }

 private:
  store::Store& store_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

bool contains_ignoring_case(std::string text, std::string_view needle) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return text.find(needle) != std::string::npos;
}

// Gloo reports every transport failure as IoException and tells a timeout
// only by its text: "Timed out waiting <n>ms for recv operation" (unbound
// buffers), "Read timeout" / "Write timeout" (pairs), and "Application
// timeout caused pair closure" (the other pairs of a context where some
// wait timed out). Everything else (connection closed by peer, connection
// reset, broken pipe, socket closed) means the peer or the link is gone.
ErrorCode classify_io_failure(const std::string& what) {
  if (contains_ignoring_case(what, "timed out") || contains_ignoring_case(what, "timeout")) {
    return ErrorCode::kCollectiveHang;
  }
  return ErrorCode::kPeerFailure;
}

void sum_floats(void* out, const void* a, const void* b, size_t n) { gloo::sum<float>(out, a, b, n); }

}  // namespace

GlooCommunicator::GlooCommunicator(store::Store& store, std::string group_name, int rank, int size,
                                   std::chrono::milliseconds timeout, std::shared_ptr<FlightRecorder> recorder,
                                   std::string rank_failed_key, const std::string& bind_address)
    : Communicator(std::move(group_name), rank, size, std::move(recorder)),
      store_(store),
      rank_failed_key_(std::move(rank_failed_key)),
      timeout_(timeout),
      sent_to_(static_cast<size_t>(size), 0),
      received_from_(static_cast<size_t>(size), 0) {
  if (timeout_.count() <= 0) {
    throw Error(ErrorCode::kInternal, fmt::format("group '{}': timeout must be positive", name()));
  }
  ignore_sigpipe_once();
  const auto started = std::chrono::steady_clock::now();
  StoreAdapter adapter(store, "gloo/" + name() + "/", timeout_);
  std::shared_ptr<gloo::transport::Device> device;
  try {
    // The device starts the socket loop thread: on the shared CPUs (common/shared_cpus.h).
    const common::SharedCpuScope shared_cpus;
    device = gloo::transport::tcp::CreateDevice(gloo::transport::tcp::attr(bind_address.c_str()));
  } catch (const std::exception& e) {
    throw Error(ErrorCode::kBadConfig,
                fmt::format("group '{}' rank {}: cannot bind the address '{}' (KEEL_BIND_ADDRESS): {}; give an address "
                            "of this node",
                            name(), rank, bind_address, e.what()));
  }
  try {
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    // Before connecting: the pairs copy the timeout when they are made.
    context->setTimeout(timeout_);
    context->connectFullMesh(adapter, device);
    context_ = std::move(context);
  } catch (const Error& e) {
    throw Error(e.code(), fmt::format("group '{}' rank {} of {}: rendezvous failed: {}", name(), rank, size, e.what()));
  } catch (const std::exception& e) {
    throw Error(ErrorCode::kPeerFailure,
                fmt::format("group '{}' rank {} of {}: connecting the Gloo mesh failed: {}", name(), rank, size,
                            e.what()));
  }
  common::logger("comm")->debug(
      "group '{}' rank {} of {}: Gloo mesh connected in {} ms", name(), rank, size,
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started).count());
  if (size > 1) watcher_ = common::named_thread("keel-peer-watch", [this] { watch_for_peer_failures(); });
}

GlooCommunicator::~GlooCommunicator() {
  stop_communication_thread();
  if (!watcher_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(watch_mutex_);
    stopping_ = true;
  }
  watch_wakeup_.notify_all();
  watcher_.join();
}

std::string GlooCommunicator::failure_key(const std::string& group_name) { return "gloo/" + group_name + "/failure"; }

std::string GlooCommunicator::left_key(const std::string& group_name) { return "gloo/" + group_name + "/left"; }

void GlooCommunicator::record_failure(const Error& error) {
  try {
    store_.compare_set(failure_key(name()), std::nullopt,
                       fmt::format("{}|{}|{}", common::error_code_name(error.code()), rank(), error.what()));
  } catch (const std::exception& e) {
    // The record only speeds up the peers; this rank fails either way.
    common::logger("comm")->warn("group '{}': could not record the failure in the store: {}", name(), e.what());
  }
}

void GlooCommunicator::watch_for_peer_failures() {
  constexpr auto kPollInterval = std::chrono::milliseconds(100);
  const std::string peer_failure = common::error_code_name(ErrorCode::kPeerFailure);
  const std::string me = std::to_string(rank());
  // Once the failure record names another cause (a hang, say), only a
  // departure can still concern this rank.
  bool failure_settled = false;
  std::unique_lock<std::mutex> lock(watch_mutex_);
  while (!watch_wakeup_.wait_for(lock, kPollInterval, [this] { return stopping_; })) {
    std::optional<std::string> failure, left, died;
    try {
      if (!failure_settled) failure = store_.get(failure_key(name()));
      left = store_.get(left_key(name()));
      if (!rank_failed_key_.empty()) died = store_.get(rank_failed_key_);
    } catch (const std::exception&) {
      return;  // the store is gone: the ranks' own timeouts still bound every call
    }
    if (died) {
      const std::string cause = fmt::format("keeld reports that {}", *died);
      notify_peer_failure(cause);
      abort_with(ErrorCode::kPeerFailure, cause);
      return;
    }
    if (left) {
      const auto bar = left->find('|');
      if (bar != std::string::npos && left->substr(0, bar) != me) {
        const std::string cause =
            fmt::format("rank {} of group '{}' left it: {}", left->substr(0, bar), name(), left->substr(bar + 1));
        notify_peer_failure(cause);
        abort_with(ErrorCode::kPeerFailure, cause);
        return;
      }
    }
    if (!failure) continue;
    const auto first = failure->find('|');
    const auto second = failure->find('|', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    const std::string code = failure->substr(0, first);
    const std::string reporter = failure->substr(first + 1, second - first - 1);
    if (code != peer_failure || reporter == me) {
      failure_settled = true;
      continue;
    }
    const std::string cause = fmt::format("rank {} of group '{}' reported a peer failure: {}", reporter, name(),
                                          failure->substr(second + 1));
    notify_peer_failure(cause);
    abort_with(ErrorCode::kPeerFailure, cause);
    return;
  }
}

Error GlooCommunicator::abort_error() {
  std::lock_guard<std::mutex> lock(abort_mutex_);
  return Error(abort_code_, abort_reason_);
}

void GlooCommunicator::abort() { abort_with(ErrorCode::kCollectiveHang, kAbortMessage); }

void GlooCommunicator::leave(const std::string& cause) {
  try {
    store_.compare_set(left_key(name()), std::nullopt, fmt::format("{}|{}", rank(), cause));
  } catch (const std::exception& e) {
    common::logger("comm")->warn("group '{}': could not record this rank's departure in the store: {}", name(),
                                 e.what());
  }
  abort_with(ErrorCode::kPeerFailure, "this rank left the group: " + cause);
}

void GlooCommunicator::abort_with(ErrorCode code, std::string reason) {
  {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    if (aborted_.load()) return;
    abort_code_ = code;
    abort_reason_ = std::move(reason);
    aborted_.store(true);
  }
  common::logger("comm")->warn("group '{}' rank {} of {}: aborting: {}", name(), rank(), size(), abort_error().what());
  if (size() == 1) return;
  // Gloo has no public call that fails the operations pending on a context:
  // Context::closeConnections() closes the sockets but leaves local waiters
  // asleep until their own timeout. What Gloo does when any wait on an
  // unbound buffer times out is exactly an abort, though: it fails every
  // pair of the context with an exception, which wakes every waiter, and
  // closes the pairs, so peers see the connections drop. So abort() makes a
  // wait time out: a receive on a slot no peer ever sends on, with a 1 ms
  // timeout. Safe from any thread: it touches its own buffer only, and the
  // pairs lock themselves.
  int dummy = 0;
  for (int step = 1; step < size(); ++step) {
    auto buffer = context_->createUnboundBuffer(&dummy, sizeof(dummy));
    try {
      buffer->recv((rank() + step) % size(), gloo::Slot::build(kAbortSlotPrefix, 0));
      buffer->waitRecv(std::chrono::milliseconds(1));
    } catch (const std::exception& e) {
      if (contains_ignoring_case(e.what(), "timed out")) return;
      // The pair to this peer had failed already and cannot carry the
      // timeout to the others; try the next one.
    }
  }
}

template <class Body>
void GlooCommunicator::guarded(Body&& body) {
  if (aborted_.load()) throw abort_error();
  try {
    body();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    // An abort wakes the waiters with Gloo's "Application timeout caused
    // pair closure"; the flag, not the text, says it was an abort.
    if (aborted_.load()) throw abort_error();
    ErrorCode code = ErrorCode::kInternal;  // gloo::EnforceNotMet and the rest: a broken invariant
    if (dynamic_cast<const gloo::IoException*>(&e) != nullptr) {
      code = classify_io_failure(e.what());
    } else if (dynamic_cast<const gloo::Exception*>(&e) != nullptr) {
      code = ErrorCode::kPeerFailure;
    }
    Error error(code, fmt::format("gloo: {}", e.what()));
    record_failure(error);
    throw error;
  }
}

void GlooCommunicator::do_all_reduce(Buffer buffer, size_t count) {
  float* data = static_cast<float*>(buffer.data);  // carries() admits float32 only
  const uint32_t tag = next_collective_tag();
  guarded([&] {
    if (count == 0) return;
    // Ring with Gloo's fixed segmentation: the segments and the order in
    // which each is summed depend only on the count and the group size, so
    // results are bit-identical run to run and on every rank.
    gloo::AllreduceOptions opts(context_);
    opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
    opts.setOutput(data, count);
    opts.setReduceFunction(&sum_floats);
    opts.setTag(tag);
    opts.setTimeout(timeout_);
    gloo::allreduce(opts);
  });
}

// Gloo's only reduce-scatter is the legacy ReduceScatterHalvingDoubling. It
// does compute the right blocks (checked for 1-8 ranks and uneven counts),
// but it is unfit here: its sends do not wait for the receiver, so a rank
// that reaches the call late has its Gloo device thread spin on the
// not-yet-registered slot for the whole skew (measured: one full core for
// a 2 s skew, slowing exactly the rank that is already behind); each call
// also takes 4·n·(n−1) slots from an `int` counter that overflows after
// ~2^31 / (4·n·(n−1)) calls, and counts are `int`. So this is a ring
// reduce-scatter on Gloo's unbound buffers, whose sends wait until the
// receiver has posted: n−1 steps; in step s rank r passes its running sum
// of block (r−s−1) mod n to rank r+1 and adds its own part to block
// (r−s−2) mod n from rank r−1; after the last step that block is r. The
// summation order of each block is fixed, so results are deterministic.
void GlooCommunicator::do_reduce_scatter(ConstBuffer in_buffer, Buffer out_buffer, size_t count) {
  const float* in = static_cast<const float*>(in_buffer.data);
  float* out = static_cast<float*>(out_buffer.data);
  const uint32_t tag = next_collective_tag();
  const int n = size();
  const int r = rank();
  guarded([&] {
    if (count == 0) return;
    if (n == 1) {
      std::copy(in, in + count, out);
      return;
    }
    const size_t block_bytes = count * sizeof(float);
    const auto slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag);
    const int right = (r + 1) % n;
    const int left = (r + n - 1) % n;
    // Two running sums: one is being sent while the next is computed.
    std::vector<float> partial(2 * count);
    std::vector<float> incoming(count);
    auto in_buffer = context_->createUnboundBuffer(const_cast<float*>(in), static_cast<size_t>(n) * block_bytes);
    auto partial_buffer = context_->createUnboundBuffer(partial.data(), 2 * block_bytes);
    auto incoming_buffer = context_->createUnboundBuffer(incoming.data(), block_bytes);
    for (int step = 0; step < n - 1; ++step) {
      const int send_block = ((r - step - 1) % n + n) % n;
      const int recv_block = ((r - step - 2) % n + n) % n;
      incoming_buffer->recv(left, slot);
      auto& outgoing = step == 0 ? in_buffer : partial_buffer;
      const size_t offset = step == 0 ? static_cast<size_t>(send_block) * block_bytes
                                      : static_cast<size_t>((step - 1) % 2) * block_bytes;
      outgoing->send(right, slot, offset, block_bytes);
      incoming_buffer->waitRecv(timeout_);
      float* sum = step == n - 2 ? out : partial.data() + static_cast<size_t>(step % 2) * count;
      const float* own = in + static_cast<size_t>(recv_block) * count;
      for (size_t i = 0; i < count; ++i) sum[i] = own[i] + incoming[i];
      outgoing->waitSend(timeout_);
    }
  });
}

void GlooCommunicator::do_all_gather(ConstBuffer in_buffer, Buffer out_buffer, size_t count) {
  const float* in = static_cast<const float*>(in_buffer.data);
  float* out = static_cast<float*>(out_buffer.data);
  const uint32_t tag = next_collective_tag();
  guarded([&] {
    if (count == 0) return;
    gloo::AllgatherOptions opts(context_);
    opts.setInput(const_cast<float*>(in), count);
    opts.setOutput(out, static_cast<size_t>(size()) * count);
    opts.setTag(tag);
    opts.setTimeout(timeout_);
    gloo::allgather(opts);
  });
}

void GlooCommunicator::do_broadcast(Buffer buffer, size_t count, int root) {
  float* data = static_cast<float*>(buffer.data);  // carries() admits float32 only
  const uint32_t tag = next_collective_tag();
  guarded([&] {
    if (count == 0) return;
    gloo::BroadcastOptions opts(context_);
    opts.setOutput(data, count);
    opts.setRoot(root);
    opts.setTag(tag);
    opts.setTimeout(timeout_);
    gloo::broadcast(opts);
  });
}

void GlooCommunicator::do_exchange(const std::vector<Send>& sends, const std::vector<Recv>& recvs) {
  // Each pair of ranks numbers its messages in each direction, so a
  // transfer meets the partner its peer issued in the same place.
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> posted_sends, posted_recvs;
  guarded([&] {
    for (const Send& send : sends) {  // carries() admits float32 only
      auto* data = const_cast<float*>(static_cast<const float*>(send.data.data));
      const auto tag = static_cast<uint32_t>(sent_to_[static_cast<size_t>(send.peer)]++);
      posted_sends.push_back(context_->createUnboundBuffer(data, send.count * sizeof(float)));
      posted_sends.back()->send(send.peer, gloo::Slot::build(kPointToPointSlotPrefix, tag));
    }
    for (const Recv& recv : recvs) {
      const auto tag = static_cast<uint32_t>(received_from_[static_cast<size_t>(recv.peer)]++);
      posted_recvs.push_back(
          context_->createUnboundBuffer(static_cast<float*>(recv.data.data), recv.count * sizeof(float)));
      posted_recvs.back()->recv(recv.peer, gloo::Slot::build(kPointToPointSlotPrefix, tag));
    }
    for (auto& buffer : posted_recvs) buffer->waitRecv(timeout_);
    for (auto& buffer : posted_sends) buffer->waitSend(timeout_);
  });
}

void GlooCommunicator::do_all_to_all(ConstBuffer in_buffer, const std::vector<size_t>& send_counts,
                                     Buffer out_buffer, const std::vector<size_t>& recv_counts) {
  // Gloo exchanges a message with every peer, empty ones too, so a rank
  // that moves nothing still takes part, through a buffer of its own.
  float nothing = 0.0f;
  auto* in = const_cast<float*>(in_buffer.data != nullptr ? static_cast<const float*>(in_buffer.data) : &nothing);
  float* out = out_buffer.data != nullptr ? static_cast<float*>(out_buffer.data) : &nothing;
  const uint32_t tag = next_collective_tag();
  guarded([&] {
    gloo::AlltoallvOptions opts(context_);
    opts.setInput(in, std::vector<int64_t>(send_counts.begin(), send_counts.end()));
    opts.setOutput(out, std::vector<int64_t>(recv_counts.begin(), recv_counts.end()));
    opts.setTag(tag);
    opts.setTimeout(timeout_);
    gloo::alltoallv(opts);
  });
}

void GlooCommunicator::do_barrier() {
  const uint32_t tag = next_collective_tag();
  guarded([&] {
    gloo::BarrierOptions opts(context_);
    opts.setTag(tag);
    opts.setTimeout(timeout_);
    gloo::barrier(opts);
  });
}

}  // namespace keel::trainer
