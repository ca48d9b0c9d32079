// Softmaxes: the vocabulary cross-entropy (a block per row: rows are
// 50k classes wide) and the MoE router's (a warp per row: E is small). The
// cross-entropy never makes a second copy of the logits: the statistics
// pass reads them, the backward overwrites them in place with dlogits.
#include "trainer/kernels/cuda/cuda_backend.h"

#include "trainer/kernels/cuda/launch.cuh"

namespace keel::trainer::cuda {
namespace {

// The shard's real classes are its first `real` columns.
__host__ __device__ inline int real_classes(int V, int v_begin, int Vl) {
  const int real = V - v_begin;
  return real < 0 ? 0 : (real > Vl ? Vl : real);
}

// A row's max over its first `real` logits and the sum of exp(x - max),
// one pass: each thread keeps a running max and the sum rescaled as the
// max grows, and the block combines them (every thread gets both). Two
// passes (max, then sum) read the 200 KB rows twice from memory: the H200
// profile of c6a9a61 had the statistics at 1.3 ms a step at 124M. A thread
// reads kVector logits at once where `vectorised` (rows of whole 16-byte
// vectors), rescaling once per vector: one at a time, it took 0.71 ms a
// step at 084b7bf, 824 MB read.
template <typename T>
__device__ float2 row_statistics(const T* x, int real, bool vectorised) {
  float max = -INFINITY, sum = 0.0f;
  const int vectors = vectorised ? real / kVector : 0;
  for (int v = threadIdx.x; v < vectors; v += blockDim.x) {
    float xs[kVector];
    load_vector(x + static_cast<size_t>(v) * kVector, xs);
    float m = xs[0];
#pragma unroll
    for (int k = 1; k < kVector; ++k) m = fmaxf(m, xs[k]);
    if (m > max) {
      sum *= expf(max - m);
      max = m;
    }
#pragma unroll
    for (int k = 0; k < kVector; ++k) sum += expf(xs[k] - max);
  }
  for (int c = vectors * kVector + threadIdx.x; c < real; c += blockDim.x) {
    const float xc = load(x + c);
    if (xc > max) {
      sum = sum * expf(max - xc) + 1.0f;
      max = xc;
    } else {
      sum += expf(xc - max);
    }
  }
  const float row_max = block_max(max);
  return make_float2(row_max, block_sum(sum > 0.0f ? sum * expf(max - row_max) : 0.0f));
}

// dx = dloss * (softmax - onehot) over a row of Vl logits, zero past the
// `real` ones, kVector logits a thread at once where `vectorised` (1.15
// ms a step one at a time at 084b7bf: 824 MB read, as much written); the
// same value per logit either way. dx may alias x: each element is read,
// then written, by one thread.
template <typename D, typename T>
__device__ void row_gradient(D* dx, const T* x, float row_lse, int target, float dloss, int Vl, int real,
                             bool vectorised) {
  const auto grad = [&](float xc, int c) {
    return c < real ? dloss * (expf(xc - row_lse) - (c == target ? 1.0f : 0.0f)) : 0.0f;
  };
  const int vectors = vectorised ? Vl / kVector : 0;
  for (int v = threadIdx.x; v < vectors; v += blockDim.x) {
    const int c0 = v * kVector;
    float xs[kVector], gs[kVector];
    load_vector(x + c0, xs);
#pragma unroll
    for (int k = 0; k < kVector; ++k) gs[k] = grad(xs[k], c0 + k);
    store_vector(dx + c0, gs);
  }
  for (int c = vectors * kVector + threadIdx.x; c < Vl; c += blockDim.x) store(dx + c, grad(load(x + c), c));
}

// The target's logit when it lies in the shard's real classes, else 0.
template <typename T>
__device__ float target_logit(const T* x, int target, int real) {
  return target >= 0 && target < real ? load(x + target) : 0.0f;
}

// One block per row.
template <typename T>
__global__ void crossentropy_stats_kernel(float* stats, const T* logits, const int32_t* targets, int v_begin, int Vl,
                                          int real, bool vectorised) {
  const size_t n = blockIdx.x;
  const T* x = logits + n * Vl;
  const float2 row = row_statistics(x, real, vectorised);
  if (threadIdx.x == 0) {
    float* s = stats + n * 3;
    s[0] = real > 0 ? row.x : -INFINITY;
    s[1] = real > 0 ? row.y : 0.0f;
    s[2] = target_logit(x, targets[n] - v_begin, real);
  }
}

// One thread per row, the shards in index order (the CPU backend's code).
__global__ void crossentropy_combine_kernel(float* losses, float* lse, const float* stats, int S, int N) {
  const size_t shard = static_cast<size_t>(N) * 3;
  for (size_t n = first_index(); n < static_cast<size_t>(N); n += grid_stride()) {
    float max = -INFINITY;
    for (int s = 0; s < S; ++s) max = fmaxf(max, stats[s * shard + n * 3]);
    float sum = 0.0f, target = 0.0f;
    for (int s = 0; s < S; ++s) {
      const float* st = stats + s * shard + n * 3;
      if (st[1] > 0.0f) sum += st[1] * expf(st[0] - max);
      target += st[2];
    }
    lse[n] = max + logf(sum);
    losses[n] = lse[n] - target;
  }
}

// One block per row (no division per logit to find its row).
template <typename D, typename T>
__global__ void crossentropy_backward_kernel(D* dlogits, const T* logits, const float* lse, const int32_t* targets,
                                             float dloss, int v_begin, int Vl, int real, bool vectorised) {
  const size_t n = blockIdx.x;
  row_gradient(dlogits + n * Vl, logits + n * Vl, lse[n], targets[n] - v_begin, dloss, Vl, real, vectorised);
}

// The three above for one shard holding every class, a block per row: its
// row is read for the statistics and again, by the same block right after,
// for the gradient, so the second read mostly finds it in L2. The combine
// of one shard is max + logf(sum * expf(0)): the same bits as here.
template <typename D, typename T>
__global__ void crossentropy_and_gradient_kernel(D* dlogits, float* losses, float* lse, const T* logits,
                                                 const int32_t* targets, float dloss, int Vp, int real, bool vectorised,
                                                 bool dlogits_vectorised) {
  const size_t n = blockIdx.x;
  const T* x = logits + n * Vp;
  const int target = targets[n];
  // Read before the statistics' barriers: the gradient may overwrite it.
  const float target_x = threadIdx.x == 0 ? target_logit(x, target, real) : 0.0f;
  const float2 row = row_statistics(x, real, vectorised);
  const float row_lse = row.x + logf(row.y);
  if (threadIdx.x == 0) {
    lse[n] = row_lse;
    losses[n] = row_lse - target_x;
  }
  row_gradient(dlogits + n * Vp, x, row_lse, target, dloss, Vp, real, vectorised && dlogits_vectorised);
}

// One warp per row.
__global__ void softmax_forward_kernel(float* probs, const float* logits, int N, int E) {
  const size_t n = global_warp();
  if (n >= static_cast<size_t>(N)) return;
  const float* x = logits + n * E;
  float* p = probs + n * E;
  float max = -INFINITY;
  for (int e = lane(); e < E; e += kWarp) max = fmaxf(max, x[e]);
  max = warp_max(max);
  float sum = 0.0f;
  for (int e = lane(); e < E; e += kWarp) {
    p[e] = expf(x[e] - max);
    sum += p[e];
  }
  const float inv = 1.0f / warp_sum(sum);
  for (int e = lane(); e < E; e += kWarp) p[e] *= inv;
}

__global__ void softmax_backward_kernel(float* dlogits, const float* dprobs, const float* probs, int N, int E) {
  const size_t n = global_warp();
  if (n >= static_cast<size_t>(N)) return;
  const float* p = probs + n * E;
  const float* dp = dprobs + n * E;
  float dot = 0.0f;
  for (int e = lane(); e < E; e += kWarp) dot += p[e] * dp[e];
  dot = warp_sum(dot);
  float* dx = dlogits + n * E;
  for (int e = lane(); e < E; e += kWarp) dx[e] += p[e] * (dp[e] - dot);
}

// Whether rows of `cols` elements from `rows` are read as whole kVector
// vectors: 16-byte aligned, and so every row after it.
template <typename T> bool rows_of_vectors(const T* rows, int cols) {
  return aligned_16(rows) && cols % kVector == 0;
}

}  // namespace

void CudaBackend::crossentropy_stats(float* stats, ConstBuffer logits, const int32_t* targets, int N, int v_begin,
                                     int Vl, int V) {
  if (N <= 0) return;
  with_type<__nv_bfloat16>(logits, [&](const auto* x) {
    crossentropy_stats_kernel<<<N, kThreads, 0, stream()>>>(stats, x, targets, v_begin, Vl,
                                                            real_classes(V, v_begin, Vl), rows_of_vectors(x, Vl));
  });
  check_launch("crossentropy_stats");
}

void CudaBackend::crossentropy_combine(float* losses, float* lse, const float* stats, int S, int N) {
  if (N <= 0) return;
  crossentropy_combine_kernel<<<grid_for(N), kThreads, 0, stream()>>>(losses, lse, stats, S, N);
  check_launch("crossentropy_combine");
}

void CudaBackend::crossentropy_backward(Buffer dlogits, ConstBuffer logits, const float* lse,
                                        const int32_t* targets, float dloss, int N, int v_begin, int Vl, int V) {
  if (N <= 0) return;
  with_type<__nv_bfloat16>(dlogits, [&](auto* dx) {
    with_type<__nv_bfloat16>(logits, [&](const auto* x) {
      crossentropy_backward_kernel<<<N, kThreads, 0, stream()>>>(
          dx, x, lse, targets, dloss, v_begin, Vl, real_classes(V, v_begin, Vl),
          rows_of_vectors(x, Vl) && rows_of_vectors(dx, Vl));
    });
  });
  check_launch("crossentropy_backward");
}

void CudaBackend::crossentropy_and_gradient(Buffer dlogits, float* losses, float* lse, ConstBuffer logits,
                                            const int32_t* targets, float dloss, int N, int Vp, int V) {
  if (N <= 0) return;
  with_type<__nv_bfloat16>(dlogits, [&](auto* dx) {
    with_type<__nv_bfloat16>(logits, [&](const auto* x) {
      // The statistics read x as crossentropy_stats does, whatever dx is.
      crossentropy_and_gradient_kernel<<<N, kThreads, 0, stream()>>>(dx, losses, lse, x, targets, dloss, Vp,
                                                                     real_classes(V, 0, Vp), rows_of_vectors(x, Vp),
                                                                     rows_of_vectors(dx, Vp));
    });
  });
  check_launch("crossentropy_and_gradient");
}

void CudaBackend::softmax_forward(float* probs, const float* logits, int N, int E) {
  if (N <= 0) return;
  softmax_forward_kernel<<<grid_for_warps(N), kThreads, 0, stream()>>>(probs, logits, N, E);
  check_launch("softmax_forward");
}

void CudaBackend::softmax_backward(float* dlogits, const float* dprobs, const float* probs, int N, int E) {
  if (N <= 0) return;
  softmax_backward_kernel<<<grid_for_warps(N), kThreads, 0, stream()>>>(dlogits, dprobs, probs, N, E);
  check_launch("softmax_backward");
}

}  // namespace keel::trainer::cuda
