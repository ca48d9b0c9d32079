// An owning array in a backend's memory: the model's parameters,
// activations and optimizer state all live in these.
#pragma once

#include "trainer/kernels/backend.h"

#include <cstddef>
#include <utility>

namespace keel::trainer {

template <class T> class BackendArray {
 public:
  BackendArray() = default;
  BackendArray(Backend& backend, size_t count)
      : backend_(&backend), data_(static_cast<T*>(backend.alloc(count * sizeof(T)))), count_(count) {}
  BackendArray(BackendArray&& other) noexcept { *this = std::move(other); }
  BackendArray& operator=(BackendArray&& other) noexcept {
    std::swap(backend_, other.backend_);
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
    return *this;
  }
  BackendArray(const BackendArray&) = delete;
  BackendArray& operator=(const BackendArray&) = delete;
  ~BackendArray() {
    if (data_ != nullptr) backend_->free(data_);
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }
  void zero() { backend_->zero(data_, bytes()); }

 private:
  Backend* backend_ = nullptr;
  T* data_ = nullptr;
  size_t count_ = 0;
};

}  // namespace keel::trainer
