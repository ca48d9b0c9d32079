// Rotary positions (backend_kernels.def): a thread per channel pair of a
// head of a row, turned in place by rotary.h's formula, the one the CPU
// backend runs. Memory-bound and small beside the GEMMs around it.
#include "trainer/kernels/cuda/cuda_backend.h"

#include "trainer/kernels/cuda/launch.cuh"
#include "trainer/kernels/rotary.h"

#include <cuda_bf16.h>

#include <type_traits>

namespace keel::trainer::cuda {
namespace {

// Pair i: row i / (heads * d/2), head i / (d/2) of it, channel i % (d/2).
template <bool kBackward, typename X>
__global__ void rotary_kernel(X* x, int ld, const float* cos, const float* sin, int T, int position, int heads, int d,
                              size_t n) {
  const int half = d / 2;
  const size_t per_row = static_cast<size_t>(heads) * half;
  for (size_t i = first_index(); i < n; i += grid_stride()) {
    const size_t row = i / per_row, h = i % per_row / half, j = i % half;
    const size_t angle = static_cast<size_t>(position + static_cast<int>(row % T)) * half + j;
    X* head = x + row * ld + h * d;
    float x1 = load(head + j), x2 = load(head + j + half);
    rotate_pair<kBackward>(x1, x2, cos[angle], sin[angle]);
    store(head + j, x1);
    store(head + j + half, x2);
  }
}

template <bool kBackward>
void launch_rotary(const char* name, cudaStream_t stream, Buffer x, int ld, const float* cos, const float* sin, int B,
                   int T, int position, int heads, int d) {
  const size_t n = static_cast<size_t>(B) * T * heads * (d / 2);
  with_type<__nv_bfloat16>(x, [&](auto* rows) {
    using X = std::remove_pointer_t<decltype(rows)>;
    launch(name, rotary_kernel<kBackward, X>, n, stream, rows, ld, cos, sin, T, position, heads, d);
  });
}

}  // namespace

void CudaBackend::rotary_forward(Buffer x, int ld, const float* cos, const float* sin, int B, int T, int position,
                                 int heads, int d) {
  launch_rotary<false>("rotary_forward", stream(), x, ld, cos, sin, B, T, position, heads, d);
}

void CudaBackend::rotary_backward(Buffer x, int ld, const float* cos, const float* sin, int B, int T, int position,
                                  int heads, int d) {
  launch_rotary<true>("rotary_backward", stream(), x, ld, cos, sin, B, T, position, heads, d);
}

}  // namespace keel::trainer::cuda
