// The row norms (LayerNorm, RMSNorm), one warp per row: a row of C floats is read once per pass from
// L1, and warp shuffles reduce it in a fixed tree. The weight and bias
// gradients sum over rows in the CPU backend's two levels: each chunk of
// kRowChunk rows into a float partial, then the partials in chunk order in
// double (launch.cuh's column_sum_accumulate), so both backends round alike.
// The backward is one kernel per chunk of rows: its warps take the rows'
// sums, then its threads walk the chunk's columns once for the input
// gradient and the partials together, so dout and inp come from memory
// once (the second read of a chunk, 196 KB at C = 768, hits L2) instead of
// once per kernel of two.
#include "trainer/kernels/cuda/cuda_backend.h"

#include "trainer/kernels/cuda/launch.cuh"

namespace keel::trainer::cuda {
namespace {

constexpr int kRowChunk = 32;

// With kAdd, inp is `sum`: each lane first adds the addend into the
// elements it later reads, so the row needs no synchronisation.
template <bool kAdd, typename Out>
__global__ void norm_forward_kernel(Out* out, float* mean, float* rstd, const float* inp, const float* addend,
                                    const float* weight, const float* bias, int N, int C, RowNorm norm) {
  const size_t n = global_warp();
  if (n >= static_cast<size_t>(N)) return;
  const float* x = inp + n * C;
  Out* o = out + n * C;
  if constexpr (kAdd) {
    float* sum = const_cast<float*>(x);
    for (int c = lane(); c < C; c += kWarp) sum[c] += addend[n * C + c];
  }
  float s = 0.0f;
  if (norm.centred()) {
    for (int c = lane(); c < C; c += kWarp) s += x[c];
  }
  const float mu = norm.centred() ? warp_sum(s) / static_cast<float>(C) : 0.0f;
  // LayerNorm's two passes: the variance from centred values does not cancel.
  float ss = 0.0f;
  for (int c = lane(); c < C; c += kWarp) {
    const float d = x[c] - mu;
    ss += d * d;
  }
  const float rs = 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(C) + norm.eps);
  for (int c = lane(); c < C; c += kWarp) {
    store(o + c, (x[c] - mu) * rs * weight[c] + (bias != nullptr ? bias[c] : 0.0f));
  }
  if (lane() == 0) {
    mean[n] = mu;
    rstd[n] = rs;
  }
}

// Block `chunk` takes rows [chunk * kRowChunk, + kRowChunk): with dinp, each
// warp first sums its rows' dy.w and dy.w.norm (lane by lane, then the warp's
// tree, as the forward sums); then thread c walks column c down the rows in
// order, adding the row's input gradient into dinp (and putting the sum
// rounded into dinp_bf16, when given) and, with partial_w (and
// partial_b), summing the chunk's partials. Null dinp or partials: that
// half is skipped (a split backward takes them in separate passes).
__global__ void __launch_bounds__(1024)
    norm_backward_kernel(float* dinp, __nv_bfloat16* dinp_bf16, float* partial_w, float* partial_b,
                         const float* dout, const float* inp, const float* weight, const float* mean,
                         const float* rstd, int N, int C, bool centred) {
  __shared__ float dnorm_mean[kRowChunk], dnorm_norm_mean[kRowChunk];
  const int first = static_cast<int>(blockIdx.x) * kRowChunk;
  const int rows = min(kRowChunk, N - first);
  if (dinp != nullptr) {
    const int warps = static_cast<int>(blockDim.x) / kWarp;
    for (int r = static_cast<int>(threadIdx.x) / kWarp; r < rows; r += warps) {
      const size_t n = static_cast<size_t>(first + r);
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
      a = warp_sum(a);
      b = warp_sum(b);
      if (lane() == 0) {
        dnorm_mean[r] = centred ? a / static_cast<float>(C) : 0.0f;  // RMSNorm centres nothing
        dnorm_norm_mean[r] = b / static_cast<float>(C);
      }
    }
    __syncthreads();
  }
  for (int c = static_cast<int>(threadIdx.x); c < C; c += static_cast<int>(blockDim.x)) {
    float pw = 0.0f, pb = 0.0f;
    for (int r = 0; r < rows; ++r) {
      const int n = first + r;
      const size_t i = static_cast<size_t>(n) * C + c;
      const float dy = dout[i];
      const float norm = (inp[i] - mean[n]) * rstd[n];
      pw += dy * norm;
      pb += dy;
      if (dinp != nullptr) {
        const float sum = dinp[i] + rstd[n] * (dy * weight[c] - dnorm_mean[r] - norm * dnorm_norm_mean[r]);
        dinp[i] = sum;
        if (dinp_bf16 != nullptr) store(dinp_bf16 + i, sum);
      }
    }
    if (partial_w != nullptr) {
      partial_w[static_cast<size_t>(blockIdx.x) * C + c] = pw;
      partial_b[static_cast<size_t>(blockIdx.x) * C + c] = pb;
    }
  }
}

// norm_forward_kernel for the dtype of `out`.
template <bool kAdd>
void launch_norm_forward(cudaStream_t stream, Buffer out, float* mean, float* rstd, const float* inp,
                         const float* addend, const float* weight, const float* bias, int N, int C, RowNorm norm) {
  if (N <= 0) return;
  with_type<__nv_bfloat16>(out, [&](auto* to) {
    norm_forward_kernel<kAdd>
        <<<grid_for_warps(N), kThreads, 0, stream>>>(to, mean, rstd, inp, addend, weight, bias, N, C, norm);
  });
}

}  // namespace

void CudaBackend::norm_forward(Buffer out, float* mean, float* rstd, const float* inp, const float* weight,
                               const float* bias, int N, int C, RowNorm norm) {
  launch_norm_forward<false>(stream(), out, mean, rstd, inp, nullptr, weight, bias, N, C, norm);
  check_launch("norm_forward");
}

void CudaBackend::add_norm_forward(float* sum, const float* addend, Buffer out, float* mean, float* rstd,
                                   const float* weight, const float* bias, int N, int C, RowNorm norm) {
  launch_norm_forward<true>(stream(), out, mean, rstd, sum, addend, weight, bias, N, C, norm);
  check_launch("add_norm_forward");
}

void CudaBackend::norm_backward(float* dinp, bf16* dinp_bf16, float* dweight, float* dbias, const float* dout,
                                const float* inp, const float* weight, const float* mean, const float* rstd, int N,
                                int C, RowNorm norm) {
  const bool params = dweight != nullptr || dbias != nullptr;
  if (N <= 0 || C <= 0 || (!params && dinp == nullptr)) return;
  const int chunks = (N + kRowChunk - 1) / kRowChunk;
  const size_t partial = static_cast<size_t>(chunks) * C;
  auto* partial_w = params ? static_cast<float*>(scratch(2 * partial * sizeof(float))) : nullptr;
  float* partial_b = params ? partial_w + partial : nullptr;
  // A thread a column, up to a full block: at GPT-2's C = 768, 24 warps for
  // the chunk's 32 rows, and N / 32 blocks (256 at batch 8) of them.
  const int threads = std::min(1024, (C + kWarp - 1) / kWarp * kWarp);
  norm_backward_kernel<<<chunks, threads, 0, stream()>>>(dinp, reinterpret_cast<__nv_bfloat16*>(dinp_bf16), partial_w,
                                                         partial_b, dout, inp, weight, mean, rstd, N, C,
                                                         norm.centred());
  check_launch("norm_backward");
  if (dweight != nullptr) column_sum_accumulate(dweight, partial_w, chunks, C, stream());
  if (dbias != nullptr) column_sum_accumulate(dbias, partial_b, chunks, C, stream());
}

}  // namespace keel::trainer::cuda
