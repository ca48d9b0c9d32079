// Shared by the GPU tests: skipping without a device, and device buffers.
#pragma once

#include "trainer/kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace keel::test {

// True when a CUDA device is usable; otherwise marks the test skipped with
// the reason (ctest reports "MESSAGE: skipped: ..." as a skip).
inline bool device_or_skip() {
  std::string why;
  if (trainer::cuda::device_available(&why)) return true;
  MESSAGE("skipped: " << why);
  return false;
}

// Device memory holding a copy of a host vector.
template <class T = float> class DeviceVec {
 public:
  explicit DeviceVec(const std::vector<T>& host) : size_(host.size()) {
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&ptr_), bytes()) == cudaSuccess);
    REQUIRE(cudaMemcpy(ptr_, host.data(), bytes(), cudaMemcpyHostToDevice) == cudaSuccess);
  }
  ~DeviceVec() { cudaFree(ptr_); }
  DeviceVec(const DeviceVec&) = delete;
  DeviceVec& operator=(const DeviceVec&) = delete;

  T* get() { return ptr_; }
  std::vector<T> to_host() const {
    std::vector<T> host(size_);
    REQUIRE(cudaMemcpy(host.data(), ptr_, bytes(), cudaMemcpyDeviceToHost) == cudaSuccess);
    return host;
  }

 private:
  size_t bytes() const { return size_ * sizeof(T); }
  size_t size_;
  T* ptr_ = nullptr;
};

}  // namespace keel::test
