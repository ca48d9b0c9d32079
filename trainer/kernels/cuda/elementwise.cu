// Elementwise kernels and AdamW. Each is memory-bound, so a grid-stride loop
// with coalesced accesses and just enough blocks to fill the device is all
// the speed there is to get. The math follows cpu_backend.cpp line by line
// (AdamW's is shared with it: adamw_step.h) so the tests can compare the
// two elementwise.
#include "trainer/kernels/cuda/cuda_kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "common/error.h"
#include "trainer/kernels/adamw_step.h"

namespace keel::trainer::cuda {
namespace {

constexpr int kThreads = 256;
// Resident blocks per SM that fill it at kThreads (2048 threads on Hopper).
constexpr int kBlocksPerSm = 8;

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluCubic = 0.044715f;

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw common::Error(common::ErrorCode::kInternal, std::string(what) + ": " + cudaGetErrorString(err));
  }
}

unsigned grid_for(size_t n) {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  const size_t needed = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::min<size_t>(needed, static_cast<size_t>(sms) * kBlocksPerSm));
}

// Launches kernel(args..., n) over n elements and turns a launch failure
// into an Error. A kernel that faults while running surfaces at the next
// synchronising call, as with any CUDA work.
template <typename... KernelArgs, typename... Args>
void launch(const char* name, void (*kernel)(KernelArgs...), size_t n, cudaStream_t stream, Args... args) {
  if (n == 0) return;  // a zero-block grid is a launch error
  kernel<<<grid_for(n), kThreads, 0, stream>>>(args..., n);
  check(cudaGetLastError(), name);
}

__device__ inline size_t first_index() { return blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; }
__device__ inline size_t grid_stride() { return static_cast<size_t>(gridDim.x) * blockDim.x; }

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

__global__ void adamw_kernel(float* __restrict__ params, const float* __restrict__ grads, float* __restrict__ m,
                             float* __restrict__ v, AdamwStep step, size_t n) {
  for (size_t i = first_index(); i < n; i += grid_stride()) step.apply(params, grads, m, v, i);
}

}  // namespace

bool device_available(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it so later calls do not report it again
    if (why != nullptr) *why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
    return false;
  }
  if (count == 0) {
    if (why != nullptr) *why = "no CUDA device";
    return false;
  }
  return true;
}

void gelu_forward(float* out, const float* inp, size_t n, cudaStream_t stream) {
  launch("gelu_forward", gelu_forward_kernel, n, stream, out, inp);
}

void gelu_backward(float* dinp, const float* inp, const float* dout, size_t n, cudaStream_t stream) {
  launch("gelu_backward", gelu_backward_kernel, n, stream, dinp, inp, dout);
}

void accumulate(float* dst, const float* src, size_t n, cudaStream_t stream) {
  launch("accumulate", accumulate_kernel, n, stream, dst, src);
}

void adamw_update(float* params, const float* grads, float* m, float* v, size_t n, float lr, float beta1,
                  float beta2, float eps, float weight_decay, float grad_scale, int64_t t, cudaStream_t stream) {
  launch("adamw_update", adamw_kernel, n, stream, params, grads, m, v,
         AdamwStep::at(lr, beta1, beta2, eps, weight_decay, grad_scale, t));
}

}  // namespace keel::trainer::cuda
