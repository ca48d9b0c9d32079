// NcclCommunicator: the GPU communicator (docs/architecture.md "Parallel layout and communication"), NCCL from the CUDA
// toolkit (2.28). Buffers are float32 or bfloat16 device pointers on `device`,
// with one exception: all_reduce also takes host memory, the few floats a
// step agrees on over the whole world (votes, norms, SDC flags), and stages
// it through device memory of its own; NCCL itself only ever sees device
// memory.
//
// One rank per GPU: NCCL refuses two ranks of a group on one device
// ("Duplicate GPU detected", an invalid-usage error: kInternal), so a
// single-GPU machine runs NCCL at world size 1 only.
//
// Rendezvous: rank 0 makes the ncclUniqueId and sets it in the Store under
// "nccl/<group_name>/id" (its raw bytes); the other ranks wait for it. As
// with GlooCommunicator, a name must be unique among the live groups of a
// Store, and a name reused for a new generation needs a fresh Store or a
// generation in the name, or the new ranks would read the old id.
//
// A collective is done (its blocking call returns, its CommWork's wait()
// returns) once it has completed on the device, so the outputs can be read
// from any stream or the host. It runs on the communicator's own stream
// (stream()), ordered after the work queued on the compute stream
// (set_compute_stream) before it was issued, on the legacy default stream
// (cudaMemcpy, launches without a stream) and on stream(); inputs written on
// any other stream must be complete before the call.
//
// Every call is bounded by `timeout`. The communicator is non-blocking
// (ncclConfig_t::blocking = 0), so no NCCL call waits on the peers: a call
// enqueues its work and then polls ncclCommGetAsyncError and the stream
// until the work is done, NCCL reports an error, or the timeout passes.
// (NCCL 2.28 starts a thread per non-blocking call to launch it: a fixed
// cost per call, not measured here yet.)
// * timeout: the communicator is aborted (ncclCommAbort, which also tells
//   the kernels still spinning on the device to quit): kCollectiveHang;
// * ncclRemoteError (a peer exited or the network failed) or
//   ncclSystemError (a socket or system call failed): kPeerFailure;
// * any other NCCL error, and CUDA errors: kInternal.
// Messages carry ncclGetErrorString and NCCL's last warning. After any
// failure the communicator has been aborted and every later call raises the
// same code at once: the rank exits and keeld restarts the generation.
//
// abort() may be called from any thread while one other thread makes the
// calls. It returns once ncclCommAbort has stopped the device work; the
// pending call and every later one then raise kCollectiveHang
// ("communicator aborted") at their next poll.
//
// send() may not complete until the peer's recv() runs (NCCL's point to
// point is "blocking for the GPU"), so two ranks that both send to each
// other first may deadlock until the timeout; order pipeline traffic so
// that one side receives first.
#pragma once

#include "common/error.h"
#include "store/store.h"
#include "trainer/comm/communicator.h"
#include "trainer/kernels/cuda/cuda_stream.h"

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

// NCCL's opaque communicator (ncclComm_t is `ncclComm*`); nccl.h stays out
// of this header so its includers need only the CUDA runtime's headers.
struct ncclComm;

namespace keel::trainer {

// The version of the NCCL library loaded at run time, "2.28.9".
std::string nccl_version_string();

class NcclCommunicator final : public Communicator {
 public:
  // Blocks until all `size` ranks have joined. Waiting for rank 0's id and
  // NCCL's own initialisation are each bounded by `timeout`; a rank that
  // does not arrive makes it raise kPeerFailure.
  NcclCommunicator(store::Store& store, std::string group_name, int rank, int size, int device,
                   std::chrono::milliseconds timeout, std::shared_ptr<FlightRecorder> recorder);
  // Finalises and destroys the NCCL communicator (or aborts it when it does
  // not quiesce within the timeout); never throws.
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  void abort() override;
  bool carries(DType dtype) const override { return dtype == DType::kF32 || dtype == DType::kBF16; }

  // The stream every call runs on; work queued on it before a call runs
  // before the call's collective.
  cudaStream_t stream() const { return stream_->get(); }

 protected:
  Stream& communication_stream() override { return *stream_; }
  void do_all_reduce(Buffer data, size_t count) override;
  void do_reduce_scatter(ConstBuffer in, Buffer out, size_t count) override;
  void do_all_gather(ConstBuffer in, Buffer out, size_t count) override;
  void do_broadcast(Buffer data, size_t count, int root) override;
  void do_exchange(const std::vector<Send>& sends, const std::vector<Recv>& recvs) override;
  void do_all_to_all(ConstBuffer in, const std::vector<size_t>& send_counts, Buffer out,
                     const std::vector<size_t>& recv_counts) override;
  void do_barrier() override;

 private:
  // Why the communicator cannot be used any more: what every later call raises.
  struct Failure {
    common::ErrorCode code;
    std::string message;
  };

  // Runs one operation: `enqueue(comm, stream)` queues the NCCL call(s) on
  // the stream, then the call waits for them as the header comment says.
  // A count of zero only checks that the communicator is usable.
  template <class Enqueue> void run(size_t count, Enqueue&& enqueue);
  void wait_until_done(std::chrono::steady_clock::time_point deadline);

  // The *_locked methods expect mutex_ held.
  void throw_if_unusable_locked() const;
  // Aborts the communicator, remembers why and throws.
  [[noreturn]] void fail_locked(common::ErrorCode code, const std::string& message);
  void abort_locked();
  // Finalise, wait for NCCL to quiesce, destroy; abort instead when that
  // fails or outlives the timeout.
  void destroy_locked() noexcept;
  void release() noexcept;

  std::chrono::milliseconds timeout_;
  int device_;
  std::unique_ptr<cuda::CudaStream> stream_;
  // Recorded on the legacy default stream at each call; stream_ waits on it.
  cudaEvent_t inputs_ready_ = nullptr;
  // What barrier() all-reduces.
  float* barrier_value_ = nullptr;
  // Where a host buffer's all_reduce runs (grown on demand; the comm
  // thread is its only user).
  void* host_staging_ = nullptr;
  size_t host_staging_bytes_ = 0;

  // NCCL's calls on one communicator are not thread-safe, and abort() frees
  // the communicator another thread may be polling, so every use of comm_
  // holds this; none blocks on the network while holding it.
  std::mutex mutex_;
  ncclComm* comm_ = nullptr;
  std::optional<Failure> failure_;
};

}  // namespace keel::trainer
