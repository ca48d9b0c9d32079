// Elementwise kernels and AdamW. Each is memory-bound, so a grid-stride loop
// with coalesced accesses and just enough blocks to fill the device is all
// the speed there is to get. The math follows cpu_backend.cpp line by line
// (AdamW's is shared with it: adamw_step.h) so the tests can compare the
// two elementwise.
#include "trainer/kernels/cuda/cuda_backend.h"

#include "trainer/kernels/adamw_step.h"
#include "trainer/kernels/cuda/launch.cuh"

namespace keel::trainer::cuda {
namespace {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluCubic = 0.044715f;

// exp of -2u, clamped as the CPU backend clamps it, so the backward's e * s
// stays finite instead of becoming inf * 0.
__device__ inline float gelu_exp(float x) {
  const float u = kGeluScale * (x + kGeluCubic * (x * x * x));
  return expf(fminf(fmaxf(-2.0f * u, -87.0f), 88.0f));
}

// gelu(x) = 0.5 x (1 + tanh u) = x * sigmoid(2u), which avoids the
// cancellation of 1 + tanh u for negative u.
__global__ void gelu_forward_kernel(float* out, const float* inp, size_t n) {
  for (size_t i = first_index(); i < n; i += grid_stride()) {
    const float x = inp[i];
    out[i] = x / (1.0f + gelu_exp(x));
  }
}

__global__ void gelu_backward_kernel(float* dinp, const float* inp, const float* dout, size_t n) {
  for (size_t i = first_index(); i < n; i += grid_stride()) {
    const float x = inp[i];
    const float e = gelu_exp(x);
    const float s = 1.0f / (1.0f + e);
    const float du = kGeluScale * (1.0f + 3.0f * kGeluCubic * (x * x));
    const float grad = s + 2.0f * x * du * (e * s) * s;
    dinp[i] += grad * dout[i];
  }
}

__global__ void accumulate_kernel(float* dst, const float* src, size_t n) {
  for (size_t i = first_index(); i < n; i += grid_stride()) dst[i] += src[i];
}

// Element i of the rows x cols block: row i / cols, column i % cols.
__global__ void accumulate_columns_kernel(float* dst, int dst_ld, const float* src, int src_ld, int cols, size_t n) {
  for (size_t i = first_index(); i < n; i += grid_stride()) {
    const size_t r = i / static_cast<size_t>(cols), c = i % static_cast<size_t>(cols);
    dst[r * dst_ld + c] += src[r * src_ld + c];
  }
}

__global__ void adamw_kernel(float* __restrict__ params, const float* __restrict__ grads, float* __restrict__ m,
                             float* __restrict__ v, AdamwStep step, size_t n) {
  for (size_t i = first_index(); i < n; i += grid_stride()) step.apply(params, grads, m, v, i);
}

}  // namespace

void CudaBackend::gelu_forward(float* out, const float* inp, size_t n) {
  launch("gelu_forward", gelu_forward_kernel, n, stream(), out, inp);
}

void CudaBackend::gelu_backward(float* dinp, const float* inp, const float* dout, size_t n) {
  launch("gelu_backward", gelu_backward_kernel, n, stream(), dinp, inp, dout);
}

void CudaBackend::accumulate(float* dst, const float* src, size_t n) {
  launch("accumulate", accumulate_kernel, n, stream(), dst, src);
}

void CudaBackend::copy_columns(float* dst, int dst_ld, const float* src, int src_ld, int rows, int cols) {
  if (rows == 0 || cols == 0) return;
  check(cudaMemcpy2DAsync(dst, static_cast<size_t>(dst_ld) * sizeof(float), src,
                          static_cast<size_t>(src_ld) * sizeof(float), static_cast<size_t>(cols) * sizeof(float),
                          static_cast<size_t>(rows), cudaMemcpyDeviceToDevice, stream()),
        "cudaMemcpy2DAsync on device");
}

void CudaBackend::accumulate_columns(float* dst, int dst_ld, const float* src, int src_ld, int rows, int cols) {
  launch("accumulate_columns", accumulate_columns_kernel, static_cast<size_t>(rows) * static_cast<size_t>(cols),
         stream(), dst, dst_ld, src, src_ld, cols);
}

void CudaBackend::adamw_update(float* params, const float* grads, float* m, float* v, size_t n, float lr,
                               float beta1, float beta2, float eps, float weight_decay, float grad_scale, int64_t t) {
  launch("adamw_update", adamw_kernel, n, stream(), params, grads, m, v,
         AdamwStep::at(lr, beta1, beta2, eps, weight_decay, grad_scale, t));
}

}  // namespace keel::trainer::cuda
