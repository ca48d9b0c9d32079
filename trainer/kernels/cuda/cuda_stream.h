// The CUDA side of stream.h: a cudaStream_t, and cudaEvent_t events.
// CUDA failures throw keel::common::Error with ErrorCode::kInternal.
#pragma once

#include "trainer/kernels/stream.h"

#include <cuda_runtime_api.h>

#include <memory>

namespace keel::trainer::cuda {

class CudaStream final : public Stream {
 public:
  // A new stream on the current device. Non-blocking: the legacy default
  // stream neither waits for it nor makes it wait, so a collective stuck on
  // one stream never stalls a plain cudaMemcpy elsewhere in the process.
  static std::unique_ptr<CudaStream> create();
  // Wraps `stream`, which the caller keeps and destroys.
  explicit CudaStream(cudaStream_t stream) : stream_(stream) {}
  ~CudaStream() override;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  cudaStream_t get() const { return stream_; }
  std::shared_ptr<StreamEvent> record() override;
  // `event` must come from a CudaStream.
  void wait(StreamEvent& event) override;
  void synchronize() override;

 private:
  CudaStream(cudaStream_t stream, bool owned) : stream_(stream), owned_(owned) {}
  cudaStream_t stream_;
  bool owned_ = false;
};

}  // namespace keel::trainer::cuda
