#include "trainer/comm/nccl_communicator.h"

#include "common/log.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string_view>
#include <thread>
#include <utility>

namespace keel::trainer {
namespace {

using common::Error;
using common::ErrorCode;
using Clock = std::chrono::steady_clock;

constexpr const char* kAbortMessage = "communicator aborted";

// A small collective is done within microseconds, so the first polls only
// yield; after that a poll every 100 µs keeps a long collective from
// burning a core while adding at most that much latency.
constexpr int kSpinPolls = 1000;
constexpr auto kPollInterval = std::chrono::microseconds(100);

void pause(int polls) {
  if (polls < kSpinPolls) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(kPollInterval);
  }
}

// ncclRemoteError is NCCL's "remote process exited or there was a network
// error"; ncclSystemError a failed socket or system call, which is how a
// dead peer shows on the local side. The rest are misuse or NCCL bugs.
ErrorCode nccl_error_code(ncclResult_t result) {
  return result == ncclRemoteError || result == ncclSystemError ? ErrorCode::kPeerFailure : ErrorCode::kInternal;
}

// ncclGetErrorString names only the class of error; the detail is in NCCL's
// last warning, which is one string for the whole process (it may belong
// to another communicator when several fail at once).
std::string nccl_message(ncclResult_t result) {
  auto message = fmt::format("nccl: {}", ncclGetErrorString(result));
  std::string_view last = ncclGetLastError(nullptr);
  while (!last.empty() && (last.back() == '\n' || last.back() == ' ')) last.remove_suffix(1);
  if (!last.empty()) message += fmt::format(" (last NCCL warning: {})", last);
  return message;
}

// carries() admits these two.
ncclDataType_t nccl_type(DType dtype) { return dtype == DType::kBF16 ? ncclBfloat16 : ncclFloat32; }

std::string cuda_message(const char* what, cudaError_t error) {
  return fmt::format("{}: {}", what, cudaGetErrorString(error));
}

void check_cuda(cudaError_t error, const char* what) {
  if (error != cudaSuccess) throw Error(ErrorCode::kInternal, cuda_message(what, error));
}

// Makes `device` current for its scope and then restores the caller's:
// NCCL and the CUDA calls here act on the current device (NCCL's abort and
// destroy even leave theirs current), and the calling thread may be driving
// another device.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    status_ = cudaGetDevice(&previous_);
    if (status_ == cudaSuccess && previous_ != device) {
      status_ = cudaSetDevice(device);
      restore_ = true;
    }
  }
  ~DeviceScope() {
    if (restore_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

  cudaError_t status() const { return status_; }

 private:
  int previous_ = 0;
  bool restore_ = false;
  cudaError_t status_ = cudaSuccess;
};

ncclUniqueId exchange_unique_id(store::Store& store, const std::string& where, const std::string& key, int rank,
                                std::chrono::milliseconds timeout) {
  ncclUniqueId id{};
  try {
    if (rank == 0) {
      const ncclResult_t result = ncclGetUniqueId(&id);
      if (result != ncclSuccess) throw Error(nccl_error_code(result), "ncclGetUniqueId: " + nccl_message(result));
      store.set(key, std::string(id.internal, sizeof(id.internal)));
    } else {
      store.wait({key}, timeout);
      const auto value = store.get(key);
      if (!value) throw Error(ErrorCode::kPeerFailure, fmt::format("key {} disappeared", key));
      if (value->size() != sizeof(id.internal)) {
        throw Error(ErrorCode::kPeerFailure, fmt::format("key {} holds {} bytes, not an ncclUniqueId's {}", key,
                                                         value->size(), sizeof(id.internal)));
      }
      std::memcpy(id.internal, value->data(), sizeof(id.internal));
    }
  } catch (const Error& e) {
    throw Error(e.code(), fmt::format("{}: rendezvous failed: {}", where, e.what()));
  }
  return id;
}

}  // namespace

std::string nccl_version_string() {
  int code = 0;
  if (ncclGetVersion(&code) != ncclSuccess) return "unknown";
  // Since 2.9 NCCL codes its version as major * 10000 + minor * 100 + patch.
  return fmt::format("{}.{}.{}", code / 10000, code / 100 % 100, code % 100);
}

NcclCommunicator::NcclCommunicator(store::Store& store, std::string group_name, int rank, int size, int device,
                                   std::chrono::milliseconds timeout, std::shared_ptr<FlightRecorder> recorder)
    : Communicator(std::move(group_name), rank, size, std::move(recorder)), timeout_(timeout), device_(device) {
  const auto where = fmt::format("group '{}' rank {} of {}", name(), rank, size);
  if (timeout_.count() <= 0) throw Error(ErrorCode::kInternal, where + ": timeout must be positive");
  if (device_ < 0) throw Error(ErrorCode::kInternal, fmt::format("{}: no CUDA device {}", where, device_));
  const auto started = Clock::now();
  const ncclUniqueId id = exchange_unique_id(store, where, "nccl/" + name() + "/id", rank, timeout_);

  // No other thread can see the communicator yet: the *_locked calls below
  // need no lock.
  try {
    DeviceScope scope(device_);
    auto check = [&](cudaError_t error, const char* what) {
      if (error != cudaSuccess) {
        throw Error(ErrorCode::kInternal, fmt::format("{}: {}", where, cuda_message(what, error)));
      }
    };
    check(scope.status(), "cudaSetDevice");
    stream_ = cuda::CudaStream::create();
    check(cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    check(cudaMalloc(reinterpret_cast<void**>(&barrier_value_), sizeof(float)), "cudaMalloc");
    check(cudaMemset(barrier_value_, 0, sizeof(float)), "cudaMemset");

    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    // NCCL keeps the pointer, and the name outlives the NCCL communicator.
    config.commName = name().c_str();
    ncclResult_t state = ncclCommInitRankConfig(&comm_, size, id, rank, &config);
    const auto deadline = Clock::now() + timeout_;
    for (int polls = 0; state == ncclInProgress; ++polls) {
      if (Clock::now() >= deadline) {
        abort_locked();
        throw Error(ErrorCode::kPeerFailure,
                    fmt::format("{}: NCCL initialisation did not complete within {} ms: a rank did not join", where,
                                timeout_.count()));
      }
      pause(polls);
      const ncclResult_t result = ncclCommGetAsyncError(comm_, &state);
      if (result != ncclSuccess) state = result;
    }
    if (state != ncclSuccess) {
      // Read before the abort, which may log warnings of its own.
      const auto message = nccl_message(state);
      abort_locked();
      throw Error(nccl_error_code(state), fmt::format("{}: NCCL initialisation failed: {}", where, message));
    }
  } catch (...) {
    release();
    throw;
  }
  common::logger("comm")->debug(
      "{}: NCCL {} communicator on device {} ready in {} ms", where, nccl_version_string(), device_,
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started).count());
}

NcclCommunicator::~NcclCommunicator() {
  stop_communication_thread();
  release();
}

void NcclCommunicator::abort() {
  DeviceScope scope(device_);
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_) return;
  common::logger("comm")->warn("group '{}' rank {} of {}: aborting", name(), rank(), size());
  abort_locked();
  failure_ = Failure{ErrorCode::kCollectiveHang, kAbortMessage};
}

void NcclCommunicator::throw_if_unusable_locked() const {
  if (failure_) throw Error(failure_->code, failure_->message);
}

void NcclCommunicator::fail_locked(ErrorCode code, const std::string& message) {
  abort_locked();
  failure_ = Failure{code, "communicator unusable after an earlier failure: " + message};
  throw Error(code, message);
}

void NcclCommunicator::abort_locked() {
  if (comm_ == nullptr) return;
  const ncclResult_t result = ncclCommAbort(comm_);
  comm_ = nullptr;
  if (result != ncclSuccess) {
    common::logger("comm")->warn("group '{}' rank {} of {}: ncclCommAbort: {}", name(), rank(), size(),
                                 nccl_message(result));
  }
}

// Finalize first: ncclCommDestroy of a communicator that was not finalized
// waits for its streams inline, without a bound, while ncclCommFinalize
// does that wait in NCCL's background thread and lets this one give up.
void NcclCommunicator::destroy_locked() noexcept {
  if (comm_ == nullptr) return;
  ncclResult_t state = ncclCommFinalize(comm_);
  const auto deadline = Clock::now() + timeout_;
  for (int polls = 0; state == ncclInProgress && Clock::now() < deadline; ++polls) {
    pause(polls);
    const ncclResult_t result = ncclCommGetAsyncError(comm_, &state);
    if (result != ncclSuccess) state = result;
  }
  if (state != ncclSuccess) {
    common::logger("comm")->warn("group '{}' rank {} of {}: NCCL did not finalize ({}); aborting", name(), rank(),
                                 size(), state == ncclInProgress ? "timed out" : nccl_message(state));
    abort_locked();
    return;
  }
  const ncclResult_t result = ncclCommDestroy(comm_);
  comm_ = nullptr;
  if (result != ncclSuccess) {
    common::logger("comm")->warn("group '{}' rank {} of {}: ncclCommDestroy: {}", name(), rank(), size(),
                                 nccl_message(result));
  }
}

void NcclCommunicator::release() noexcept {
  DeviceScope scope(device_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    destroy_locked();
  }
  // Failures are ignored: nothing here can be retried, and this runs in the
  // destructor.
  if (barrier_value_ != nullptr) cudaFree(barrier_value_);
  if (host_staging_ != nullptr) cudaFree(host_staging_);
  if (inputs_ready_ != nullptr) cudaEventDestroy(inputs_ready_);
  stream_.reset();
}

template <class Enqueue>
void NcclCommunicator::run(size_t count, Enqueue&& enqueue) {
  const auto deadline = Clock::now() + timeout_;
  DeviceScope scope(device_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    throw_if_unusable_locked();
    if (count == 0) return;
    if (scope.status() != cudaSuccess) {
      fail_locked(ErrorCode::kInternal, cuda_message("cudaSetDevice", scope.status()));
    }
    // stream_ does not sync with the legacy default stream by itself, and a
    // cudaMemcpy from pageable memory may return before its copy has landed.
    cudaError_t error = cudaEventRecord(inputs_ready_, cudaStreamLegacy);
    if (error == cudaSuccess) error = cudaStreamWaitEvent(stream_->get(), inputs_ready_, 0);
    if (error != cudaSuccess) {
      fail_locked(ErrorCode::kInternal, cuda_message("ordering after the default stream", error));
    }
    const ncclResult_t result = enqueue(comm_, stream_->get());
    if (result != ncclSuccess && result != ncclInProgress) fail_locked(nccl_error_code(result), nccl_message(result));
  }
  wait_until_done(deadline);
}

void NcclCommunicator::wait_until_done(Clock::time_point deadline) {
  for (int polls = 0;; ++polls) {
    {
      // Held for one poll only, so that abort() can get in between.
      std::lock_guard<std::mutex> lock(mutex_);
      throw_if_unusable_locked();
      ncclResult_t state = ncclSuccess;
      const ncclResult_t result = ncclCommGetAsyncError(comm_, &state);
      if (result != ncclSuccess) fail_locked(nccl_error_code(result), nccl_message(result));
      if (state != ncclSuccess && state != ncclInProgress) fail_locked(nccl_error_code(state), nccl_message(state));
      // While NCCL still reports ncclInProgress its background thread may
      // not have queued the kernels yet, so an idle stream proves nothing.
      if (state == ncclSuccess) {
        const cudaError_t query = cudaStreamQuery(stream_->get());
        if (query == cudaSuccess) return;
        if (query != cudaErrorNotReady) fail_locked(ErrorCode::kInternal, cuda_message("cudaStreamQuery", query));
      }
      if (Clock::now() >= deadline) {
        fail_locked(ErrorCode::kCollectiveHang,
                    fmt::format("timed out after {} ms; communicator aborted", timeout_.count()));
      }
    }
    pause(polls);
  }
}

void NcclCommunicator::do_all_reduce(Buffer data, size_t count) {
  cudaPointerAttributes attributes{};
  const bool on_host = count > 0 && cudaPointerGetAttributes(&attributes, data.data) == cudaSuccess &&
                       (attributes.type == cudaMemoryTypeUnregistered || attributes.type == cudaMemoryTypeHost);
  if (!on_host) {
    run(count, [&](ncclComm_t comm, cudaStream_t stream) {
      return ncclAllReduce(data.data, data.data, count, nccl_type(data.dtype), ncclSum, comm, stream);
    });
    return;
  }
  const size_t bytes = count * dtype_bytes(data.dtype);
  {
    DeviceScope scope(device_);
    if (bytes > host_staging_bytes_) {
      cudaFree(host_staging_);
      host_staging_ = nullptr;
      host_staging_bytes_ = 0;
      check_cuda(cudaMalloc(&host_staging_, bytes), "cudaMalloc (host all_reduce staging)");
      host_staging_bytes_ = bytes;
    }
    // run() orders the collective after the legacy default stream, which
    // this copy is on.
    check_cuda(cudaMemcpy(host_staging_, data.data, bytes, cudaMemcpyHostToDevice), "cudaMemcpy (all_reduce in)");
  }
  run(count, [&](ncclComm_t comm, cudaStream_t stream) {
    return ncclAllReduce(host_staging_, host_staging_, count, nccl_type(data.dtype), ncclSum, comm, stream);
  });
  // run() returns once the collective has completed on the device.
  DeviceScope scope(device_);
  check_cuda(cudaMemcpy(data.data, host_staging_, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy (all_reduce out)");
}

void NcclCommunicator::do_reduce_scatter(ConstBuffer in, Buffer out, size_t count) {
  run(count, [&](ncclComm_t comm, cudaStream_t stream) {
    return ncclReduceScatter(in.data, out.data, count, nccl_type(in.dtype), ncclSum, comm, stream);
  });
}

void NcclCommunicator::do_all_gather(ConstBuffer in, Buffer out, size_t count) {
  run(count, [&](ncclComm_t comm, cudaStream_t stream) {
    return ncclAllGather(in.data, out.data, count, nccl_type(in.dtype), comm, stream);
  });
}

void NcclCommunicator::do_broadcast(Buffer data, size_t count, int root) {
  run(count, [&](ncclComm_t comm, cudaStream_t stream) {
    return ncclBroadcast(data.data, data.data, count, nccl_type(data.dtype), root, comm, stream);
  });
}

// One group of every send and receive, which progress together. An empty
// transfer is skipped on both sides, which agree on its size.
void NcclCommunicator::do_exchange(const std::vector<Send>& sends, const std::vector<Recv>& recvs) {
  size_t largest = 0;
  for (const Send& send : sends) largest = std::max(largest, send.count);
  for (const Recv& recv : recvs) largest = std::max(largest, recv.count);
  run(largest, [&](ncclComm_t comm, cudaStream_t stream) {
    ncclResult_t result = ncclGroupStart();
    if (result != ncclSuccess) return result;
    for (const Send& send : sends) {
      if (result == ncclSuccess && send.count > 0) {
        result = ncclSend(send.data.data, send.count, nccl_type(send.data.dtype), send.peer, comm, stream);
      }
    }
    for (const Recv& recv : recvs) {
      if (result == ncclSuccess && recv.count > 0) {
        result = ncclRecv(recv.data.data, recv.count, nccl_type(recv.data.dtype), recv.peer, comm, stream);
      }
    }
    // The group must be closed even after a failed call inside it; NCCL
    // then reports that failure from ncclGroupEnd too.
    const ncclResult_t end = ncclGroupEnd();
    return result != ncclSuccess ? result : end;
  });
}

// One group of a send and a receive per rank (itself included), which all
// progress together: ncclAlltoAll takes equal counts only. An empty block
// is skipped on both sides, which agree on its size.
void NcclCommunicator::do_all_to_all(ConstBuffer in, const std::vector<size_t>& send_counts, Buffer out,
                                     const std::vector<size_t>& recv_counts) {
  const size_t sent = std::accumulate(send_counts.begin(), send_counts.end(), size_t{0});
  const size_t received = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
  run(std::max(sent, received), [&](ncclComm_t comm, cudaStream_t stream) {
    const ncclDataType_t type = nccl_type(in.dtype);
    const size_t element = dtype_bytes(in.dtype);
    ncclResult_t result = ncclGroupStart();
    if (result != ncclSuccess) return result;
    size_t send_offset = 0, recv_offset = 0;
    for (int r = 0; r < size() && result == ncclSuccess; ++r) {
      const size_t send_count = send_counts[static_cast<size_t>(r)], recv_count = recv_counts[static_cast<size_t>(r)];
      if (send_count > 0) {
        result = ncclSend(static_cast<const char*>(in.data) + send_offset * element, send_count, type, r, comm, stream);
      }
      if (result == ncclSuccess && recv_count > 0) {
        result = ncclRecv(static_cast<char*>(out.data) + recv_offset * element, recv_count, type, r, comm, stream);
      }
      send_offset += send_count;
      recv_offset += recv_count;
    }
    // The group must be closed even after a failed call inside it; NCCL
    // then reports that failure from ncclGroupEnd too.
    const ncclResult_t end = ncclGroupEnd();
    return result != ncclSuccess ? result : end;
  });
}

void NcclCommunicator::do_barrier() {
  run(1, [&](ncclComm_t comm, cudaStream_t stream) {
    return ncclAllReduce(barrier_value_, barrier_value_, 1, ncclFloat32, ncclSum, comm, stream);
  });
}

}  // namespace keel::trainer
