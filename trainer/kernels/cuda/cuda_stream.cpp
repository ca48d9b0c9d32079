#include "trainer/kernels/cuda/cuda_stream.h"

#include "common/error.h"

#include <cuda_runtime.h>

#include <fmt/format.h>

namespace keel::trainer::cuda {
namespace {

void check(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    throw common::Error(common::ErrorCode::kInternal, fmt::format("{}: {}", what, cudaGetErrorString(error)));
  }
}

class CudaEvent final : public StreamEvent {
 public:
  CudaEvent() { check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags"); }
  ~CudaEvent() override { cudaEventDestroy(event_); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  cudaEvent_t get() const { return event_; }
  void synchronize() override { check(cudaEventSynchronize(event_), "cudaEventSynchronize"); }

 private:
  cudaEvent_t event_ = nullptr;
};

}  // namespace

std::unique_ptr<CudaStream> CudaStream::create() {
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return std::unique_ptr<CudaStream>(new CudaStream(stream, true));
}

CudaStream::~CudaStream() {
  if (owned_) cudaStreamDestroy(stream_);
}

std::shared_ptr<StreamEvent> CudaStream::record() {
  auto event = std::make_shared<CudaEvent>();
  check(cudaEventRecord(event->get(), stream_), "cudaEventRecord");
  return event;
}

void CudaStream::wait(StreamEvent& event) {
  auto* cuda_event = dynamic_cast<CudaEvent*>(&event);
  if (cuda_event == nullptr) {
    throw common::Error(common::ErrorCode::kInternal, "a CUDA stream can only wait for a CUDA stream's event");
  }
  check(cudaStreamWaitEvent(stream_, cuda_event->get(), 0), "cudaStreamWaitEvent");
}

void CudaStream::synchronize() { check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

}  // namespace keel::trainer::cuda
