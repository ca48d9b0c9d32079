// LayerNorm, one warp per row: a row of C floats is read once per pass from
// L1, and warp shuffles reduce it in a fixed tree. The weight and bias
// gradients sum over rows in the CPU backend's two levels: each chunk of
// kRowChunk rows into a float partial, then the partials in chunk order in
// double (launch.cuh's column_sum_accumulate), so both backends round alike.
#include "trainer/kernels/cuda/cuda_backend.h"

#include "trainer/kernels/cuda/launch.cuh"

namespace keel::trainer::cuda {
namespace {

constexpr float kEps = 1e-5f;
constexpr int kRowChunk = 32;

// With kAdd, inp is `sum`: each lane first adds the addend into the
// elements it later reads, so the row needs no synchronisation.
template <bool kAdd, typename Out>
__global__ void layernorm_forward_kernel(Out* out, float* mean, float* rstd, const float* inp, const float* addend,
                                         const float* weight, const float* bias, int N, int C) {
  const size_t n = global_warp();
  if (n >= static_cast<size_t>(N)) return;
  const float* x = inp + n * C;
  Out* o = out + n * C;
  if constexpr (kAdd) {
    float* sum = const_cast<float*>(x);
    for (int c = lane(); c < C; c += kWarp) sum[c] += addend[n * C + c];
  }
  float s = 0.0f;
  for (int c = lane(); c < C; c += kWarp) s += x[c];
  const float mu = warp_sum(s) / static_cast<float>(C);
  // Two passes: the variance from centred values does not cancel.
  float ss = 0.0f;
  for (int c = lane(); c < C; c += kWarp) {
    const float d = x[c] - mu;
    ss += d * d;
  }
  const float rs = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(C) + kEps);
  for (int c = lane(); c < C; c += kWarp) store(o + c, (x[c] - mu) * rs * weight[c] + bias[c]);
  if (lane() == 0) {
    mean[n] = mu;
    rstd[n] = rs;
  }
}

__global__ void layernorm_dinp_kernel(float* dinp, const float* dout, const float* inp, const float* weight,
                                      const float* mean, const float* rstd, int N, int C) {
  const size_t n = global_warp();
  if (n >= static_cast<size_t>(N)) return;
  const float* x = inp + n * C;
  const float* dy = dout + n * C;
  const float mu = mean[n];
  const float rs = rstd[n];
  float a = 0.0f, b = 0.0f;
  for (int c = lane(); c < C; c += kWarp) {
    const float g = dy[c] * weight[c];
    a += g;
    b += g * ((x[c] - mu) * rs);
  }
  const float dnorm_mean = warp_sum(a) / static_cast<float>(C);
  const float dnorm_norm_mean = warp_sum(b) / static_cast<float>(C);
  float* dx = dinp + n * C;
  for (int c = lane(); c < C; c += kWarp) {
    const float norm = (x[c] - mu) * rs;
    dx[c] += rs * (dy[c] * weight[c] - dnorm_mean - norm * dnorm_norm_mean);
  }
}

// partial_w[chunk, c] and partial_b[chunk, c] over the chunk's rows in order.
// Blocks run chunk after chunk along x (y would cap N at 65535 chunks).
__global__ void layernorm_param_partials_kernel(float* partial_w, float* partial_b, const float* dout,
                                                const float* inp, const float* mean, const float* rstd, int N, int C,
                                                int column_blocks) {
  const int chunk = blockIdx.x / column_blocks;
  const int c = blockIdx.x % column_blocks * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float pw = 0.0f, pb = 0.0f;
  const int end = min(N, (chunk + 1) * kRowChunk);
  for (int n = chunk * kRowChunk; n < end; ++n) {
    const size_t i = static_cast<size_t>(n) * C + c;
    pw += dout[i] * ((inp[i] - mean[n]) * rstd[n]);
    pb += dout[i];
  }
  partial_w[static_cast<size_t>(chunk) * C + c] = pw;
  partial_b[static_cast<size_t>(chunk) * C + c] = pb;
}

// layernorm_forward_kernel for the dtype of `out`.
template <bool kAdd>
void launch_layernorm_forward(cudaStream_t stream, Buffer out, float* mean, float* rstd, const float* inp,
                              const float* addend, const float* weight, const float* bias, int N, int C) {
  if (N <= 0) return;
  with_type<__nv_bfloat16>(out, [&](auto* to) {
    layernorm_forward_kernel<kAdd>
        <<<grid_for_warps(N), kThreads, 0, stream>>>(to, mean, rstd, inp, addend, weight, bias, N, C);
  });
}

}  // namespace

void CudaBackend::layernorm_forward(Buffer out, float* mean, float* rstd, const float* inp, const float* weight,
                                    const float* bias, int N, int C) {
  launch_layernorm_forward<false>(stream(), out, mean, rstd, inp, nullptr, weight, bias, N, C);
  check_launch("layernorm_forward");
}

void CudaBackend::add_layernorm_forward(float* sum, const float* addend, Buffer out, float* mean, float* rstd,
                                        const float* weight, const float* bias, int N, int C) {
  launch_layernorm_forward<true>(stream(), out, mean, rstd, sum, addend, weight, bias, N, C);
  check_launch("add_layernorm_forward");
}

void CudaBackend::layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                                     const float* weight, const float* mean, const float* rstd, int N, int C) {
  if (N <= 0 || C <= 0) return;
  if (dweight != nullptr || dbias != nullptr) {
    const int chunks = (N + kRowChunk - 1) / kRowChunk;
    const size_t partial = static_cast<size_t>(chunks) * C;
    auto* partial_w = static_cast<float*>(scratch(2 * partial * sizeof(float)));
    float* partial_b = partial_w + partial;
    const int column_blocks = (C + kThreads - 1) / kThreads;
    layernorm_param_partials_kernel<<<chunks * column_blocks, kThreads, 0, stream()>>>(
        partial_w, partial_b, dout, inp, mean, rstd, N, C, column_blocks);
    check_launch("layernorm_backward (parameters)");
    if (dweight != nullptr) column_sum_accumulate(dweight, partial_w, chunks, C, stream());
    if (dbias != nullptr) column_sum_accumulate(dbias, partial_b, chunks, C, stream());
  }
  if (dinp != nullptr) {
    layernorm_dinp_kernel<<<grid_for_warps(N), kThreads, 0, stream()>>>(dinp, dout, inp, weight, mean, rstd, N, C);
    check_launch("layernorm_backward (input)");
  }
}

}  // namespace keel::trainer::cuda
