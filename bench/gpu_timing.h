// What the GPU benchmarks share: CUDA error checks and event timing on a
// stream.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <stdexcept>
#include <string>

namespace keel::bench {

inline void check(cudaError_t err, const char *what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// Mean milliseconds of `pass` over `iterations`, after `warmup` passes,
// timed by events recorded on `stream` (where `pass` queues its work).
inline double time_ms(cudaStream_t stream, const std::function<void()> &pass, int warmup, int iterations) {
  cudaEvent_t start, done;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&done), "cudaEventCreate");
  for (int i = 0; i < warmup; ++i) pass();
  check(cudaEventRecord(start, stream), "cudaEventRecord");
  for (int i = 0; i < iterations; ++i) pass();
  check(cudaEventRecord(done, stream), "cudaEventRecord");
  check(cudaEventSynchronize(done), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, start, done), "cudaEventElapsedTime");
  cudaEventDestroy(start);
  cudaEventDestroy(done);
  return ms / iterations;
}

}  // namespace keel::bench
