// Arrays planned together and allocated once (docs/architecture.md
// "Memory"). A component describes its arrays in one function, which the
// arena calls twice: first to add up their sizes, then, after the single
// allocation, to place each at its offset. So a GPU rank makes one
// cudaMalloc for its parameters, gradients, optimizer state and
// activations, before the first step, and none in the step. Each array
// starts on a 256-byte boundary, which coalesced loads and cuBLASLt's
// fastest kernels want.
#pragma once

#include "common/error.h"
#include "trainer/kernels/backend.h"
#include "trainer/kernels/backend_array.h"

#include <cstddef>
#include <cstdint>
#include <memory>

namespace keel::trainer {

// `count` elements of T in an Arena's memory; the arena owns them.
template <class T> class ArenaArray {
 public:
  ArenaArray() = default;
  ArenaArray(Backend* backend, T* data, size_t count) : backend_(backend), data_(data), count_(count) {}
  T* data() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }
  void zero() const {
    if (count_ > 0) backend_->zero(data_, bytes());
  }

 private:
  Backend* backend_ = nullptr;
  T* data_ = nullptr;
  size_t count_ = 0;
};

// `count` elements of a type chosen when the arena is laid out: an
// activation that only GEMMs read is kept in their input type
// (Backend::gemm_inputs(), docs/architecture.md "Dtypes").
class ArenaBuffer {
 public:
  ArenaBuffer() = default;
  ArenaBuffer(ArenaArray<std::byte> bytes, DType dtype) : bytes_(bytes), dtype_(dtype) {}
  Buffer buffer() const { return Buffer(bytes_.data(), dtype_); }
  size_t size() const { return bytes_.size() / dtype_bytes(dtype_); }

 private:
  ArenaArray<std::byte> bytes_;
  DType dtype_ = DType::kF32;
};

class Arena {
 public:
  static constexpr size_t kAlign = 256;

  // describe(arena) takes every array with take(); it runs twice and must
  // take the same arrays in the same order both times. The arrays it takes
  // in the first run have no memory yet.
  template <class Describe> Arena(Backend& backend, Describe&& describe) : backend_(backend) {
    describe(*this);
    // A backend promises 64-byte alignment only: room to align the base.
    memory_ = BackendArray<std::byte>(backend, used_ + kAlign);
    const auto address = reinterpret_cast<uintptr_t>(memory_.data());
    base_ = memory_.data() + ((kAlign - address % kAlign) % kAlign);
    planned_ = used_;
    used_ = 0;
    describe(*this);
    if (used_ != planned_) {
      throw common::Error(common::ErrorCode::kInternal, "an arena's arrays changed between planning and placing");
    }
  }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // The bytes the constructor would allocate for `describe`, found by its
  // planning run alone: nothing is allocated (keel-trainer --plan). The
  // arrays it takes have no memory and must not be used.
  template <class Describe> static size_t plan(Backend& backend, Describe&& describe) {
    Arena arena(backend);
    describe(arena);
    return arena.used_;
  }

  template <class T> ArenaArray<T> take(size_t count) {
    if (count == 0) return ArenaArray<T>(&backend_, nullptr, 0);
    const size_t offset = used_;
    used_ += (count * sizeof(T) + kAlign - 1) / kAlign * kAlign;
    if (base_ != nullptr && used_ > planned_) {
      throw common::Error(common::ErrorCode::kInternal, "an arena's arrays outgrew its plan");
    }
    T* data = base_ != nullptr ? reinterpret_cast<T*>(base_ + offset) : nullptr;
    return ArenaArray<T>(&backend_, data, count);
  }
  ArenaBuffer take_buffer(DType dtype, size_t count) {
    return ArenaBuffer(take<std::byte>(count * dtype_bytes(dtype)), dtype);
  }
  // The single allocation's size.
  size_t bytes() const { return planned_; }

 private:
  explicit Arena(Backend& backend) : backend_(backend) {}

  Backend& backend_;
  BackendArray<std::byte> memory_;
  std::byte* base_ = nullptr;  // memory_ rounded up to kAlign; null while planning
  size_t used_ = 0;
  size_t planned_ = 0;
};

// One Arena for every array of `parts`, each a component with a
// lay_out(Arena&) that takes its arrays: how components used on their own
// (tests, benchmarks) get what TrainLoop gives them in its single plan.
template <class... Parts> std::unique_ptr<Arena> lay_out(Backend& backend, Parts&... parts) {
  return std::make_unique<Arena>(backend, [&](Arena& arena) { (parts.lay_out(arena), ...); });
}

}  // namespace keel::trainer
