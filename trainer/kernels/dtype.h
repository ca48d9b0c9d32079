// Element types, and typed views of buffers where data crosses a seam
// (docs/architecture.md "Dtypes"). The CPU path is float32 throughout; the
// GPU path computes in bfloat16 and keeps master weights, gradient sums and
// Adam moments in float32, so a buffer handed to a communicator says which.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace keel::trainer {

enum class DType : uint8_t { kF32, kBF16 };

constexpr size_t dtype_bytes(DType dtype) { return dtype == DType::kBF16 ? 2 : 4; }
constexpr const char* dtype_name(DType dtype) { return dtype == DType::kBF16 ? "bf16" : "f32"; }

// bfloat16 as stored: the upper half of a float32's bits.
struct bf16 {
  uint16_t bits = 0;
};

// Rounds to the nearest bfloat16, ties to even; a NaN stays a (quiet) NaN.
// (memcpy, not std::bit_cast: the CUDA sources, which include this header,
// are C++17.)
inline bf16 to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return bf16{static_cast<uint16_t>((bits >> 16) | 0x0040u)};
  }
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return bf16{static_cast<uint16_t>((bits + rounding) >> 16)};
}

inline float to_float(bf16 value) {
  const uint32_t bits = static_cast<uint32_t>(value.bits) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// The float32 that holds value rounded to bfloat16: what a bf16 GEMM
// multiplies, kept in float32 storage.
inline float bf16_rounded(float value) { return to_float(to_bf16(value)); }

// A buffer of `dtype` elements. The constructors are implicit on purpose: a
// float* is a float32 buffer and a bf16* a bfloat16 one, so callers pass
// their typed pointers and the type travels with them.
struct Buffer {
  Buffer(std::nullptr_t) {}
  Buffer(float* p) : data(p) {}
  Buffer(bf16* p) : data(p), dtype(DType::kBF16) {}
  Buffer(void* p, DType type) : data(p), dtype(type) {}
  void* data = nullptr;
  DType dtype = DType::kF32;
};

struct ConstBuffer {
  ConstBuffer(std::nullptr_t) {}
  ConstBuffer(const float* p) : data(p) {}
  ConstBuffer(const bf16* p) : data(p), dtype(DType::kBF16) {}
  ConstBuffer(Buffer b) : data(b.data), dtype(b.dtype) {}
  ConstBuffer(const void* p, DType type) : data(p), dtype(type) {}
  // The float32 data, or null when the buffer holds bf16.
  const float* f32() const { return dtype == DType::kF32 ? static_cast<const float*>(data) : nullptr; }
  const void* data = nullptr;
  DType dtype = DType::kF32;
};

// f(typed pointer) for a buffer's dtype. Bf16 is the element type that
// stands for bfloat16 where the code runs: `bf16` above on the host,
// `__nv_bfloat16` in CUDA kernels.
template <class Bf16, class F> void with_type(Buffer buffer, F&& f) {
  if (buffer.dtype == DType::kBF16) {
    f(static_cast<Bf16*>(buffer.data));
  } else {
    f(static_cast<float*>(buffer.data));
  }
}
template <class Bf16, class F> void with_type(ConstBuffer buffer, F&& f) {
  if (buffer.dtype == DType::kBF16) {
    f(static_cast<const Bf16*>(buffer.data));
  } else {
    f(static_cast<const float*>(buffer.data));
  }
}

}  // namespace keel::trainer
