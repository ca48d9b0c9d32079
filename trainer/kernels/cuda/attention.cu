// Causal self-attention, flash style (backend.h): the probabilities are
// never stored, only each query row's log-sum-exp, and the backward
// recomputes them. One warp per row throughout. In the score passes each
// lane owns one key (or query) of a chunk of 32 and computes its whole
// d-long dot product; in the value passes each lane owns head channels and
// the chunk's probabilities reach it by shuffles.
// * forward, per query row: an online softmax over the chunks (running
//   max, running sum, running output), then lse = max + log(sum);
// * backward, per query row t: D_t = sum_s P_ts dP_ts, then dQ_t;
// * backward, per key row s: dK_s and dV_s over the queries t >= s, with
//   D_t from the first pass.
// Every output row has one writer and every sum runs in order: no atomics.
// CUDA cores only; the tensor-core tiling is [GPU performance]'s.
#include "trainer/kernels/cuda/cuda_backend.h"

#include "trainer/kernels/cuda/launch.cuh"

#include <fmt/format.h>

#include <cmath>
#include <type_traits>

namespace keel::trainer::cuda {
namespace {

// Head dimensions up to this fit the per-lane accumulators: kSlots floats
// a lane, the kernels compiled for 1, 2, 4 and 8 (with_slots picks the
// smallest that holds the head, so GPT-2's 64 runs 2).
constexpr int kMaxHeadDim = 256;
constexpr unsigned kFullWarp = 0xffffffffu;

// Where a row's (b, h, t) lives, and its head's q, k and v.
struct Row {
  size_t b, h, t, bh;
  int d;              // head dimension
  size_t ld;          // floats from one position's qkv to the next's
  const float* head;  // q of position 0; k at +C, v at +2C
  __device__ Row(size_t row, const float* qkv, int T, int C, int NH)
      : b(row / T / NH), h(row / T % NH), t(row % T), bh(row / T), d(C / NH), ld(3 * static_cast<size_t>(C)) {
    head = qkv + b * T * ld + h * d;
  }
};

__device__ inline float dot(const float* x, const float* y, int d) {
  float acc = 0.0f;
  for (int j = 0; j < d; ++j) acc += x[j] * y[j];
  return acc;
}

// acc[i] += weight * row[lane + i * 32] for the lane's channels; `store`
// adds (or writes) them to dst.
template <int kSlots>
__device__ inline void add_scaled(float (&acc)[kSlots], float weight, const float* row, int d) {
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int j = lane() + i * kWarp;
    if (j < d) acc[i] += weight * row[j];
  }
}

template <int kSlots>
__device__ inline void store(float* dst, const float (&acc)[kSlots], float scale, int d, bool accumulate) {
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int j = lane() + i * kWarp;
    if (j < d) dst[j] = (accumulate ? dst[j] : 0.0f) + acc[i] * scale;
  }
}

template <int kSlots>
__global__ void attention_forward_kernel(float* out, float* lse, const float* qkv, int B, int T, int C, int NH,
                                         float scale) {
  const size_t row = global_warp();
  if (row >= static_cast<size_t>(B) * NH * T) return;
  const Row r(row, qkv, T, C, NH);
  const int d = r.d;
  const size_t ld = r.ld;
  const float* q = r.head + r.t * ld;
  const int len = static_cast<int>(r.t) + 1;

  float max = -INFINITY, sum = 0.0f;
  float acc[kSlots] = {};
  for (int base = 0; base < len; base += kWarp) {
    const int s = base + lane();
    const float score = s < len ? dot(q, r.head + s * ld + C, d) * scale : -INFINITY;
    const float new_max = fmaxf(max, warp_max(score));
    const float p = s < len ? expf(score - new_max) : 0.0f;
    const float correction = expf(max - new_max);  // 0 on the first chunk
    sum = sum * correction + warp_sum(p);
#pragma unroll
    for (int i = 0; i < kSlots; ++i) acc[i] *= correction;
    const int count = min(kWarp, len - base);
    for (int k = 0; k < count; ++k) add_scaled(acc, __shfl_sync(kFullWarp, p, k), r.head + (base + k) * ld + 2 * C, d);
    max = new_max;
  }
  store(out + (r.b * T + r.t) * C + r.h * d, acc, 1.0f / sum, d, false);
  if (lane() == 0) lse[r.bh * T + r.t] = max + logf(sum);
}

// P_ts and dP_ts of query t and key s, the same expressions in both passes
// so that they agree to the bit.
struct Probability {
  float p, dp;
};
__device__ inline Probability probability(const float* q, const float* dy, const float* key_row, int C, int d,
                                          float scale, float lse) {
  return {expf(dot(q, key_row + C, d) * scale - lse), dot(dy, key_row + 2 * C, d)};
}

template <int kSlots>
__global__ void attention_backward_query_kernel(float* dqkv, float* row_dots, const float* dout, const float* qkv,
                                                const float* lse, int B, int T, int C, int NH, float scale) {
  const size_t row = global_warp();
  if (row >= static_cast<size_t>(B) * NH * T) return;
  const Row r(row, qkv, T, C, NH);
  const int d = r.d;
  const size_t ld = r.ld;
  const float* q = r.head + r.t * ld;
  const float* dy = dout + (r.b * T + r.t) * C + r.h * d;
  const float shift = lse[r.bh * T + r.t];
  const int len = static_cast<int>(r.t) + 1;

  float pdp = 0.0f;
  for (int s = lane(); s < len; s += kWarp) {
    const Probability pr = probability(q, dy, r.head + s * ld, C, d, scale, shift);
    pdp += pr.p * pr.dp;
  }
  const float row_dot = warp_sum(pdp);
  if (lane() == 0) row_dots[r.bh * T + r.t] = row_dot;

  float acc[kSlots] = {};
  for (int base = 0; base < len; base += kWarp) {
    const int s = base + lane();
    float ds = 0.0f;
    if (s < len) {
      const Probability pr = probability(q, dy, r.head + s * ld, C, d, scale, shift);
      ds = pr.p * (pr.dp - row_dot) * scale;
    }
    const int count = min(kWarp, len - base);
    for (int k = 0; k < count; ++k) add_scaled(acc, __shfl_sync(kFullWarp, ds, k), r.head + (base + k) * ld + C, d);
  }
  store(dqkv + (r.b * T + r.t) * ld + r.h * d, acc, 1.0f, d, true);
}

template <int kSlots>
__global__ void attention_backward_key_kernel(float* dqkv, const float* row_dots, const float* dout, const float* qkv,
                                              const float* lse, int B, int T, int C, int NH, float scale) {
  const size_t row = global_warp();
  if (row >= static_cast<size_t>(B) * NH * T) return;
  const Row r(row, qkv, T, C, NH);
  const int d = r.d;
  const size_t ld = r.ld;
  const size_t s = r.t;
  const float* key_row = r.head + s * ld;
  const float* dy_head = dout + r.b * T * C + r.h * d;

  float acc_k[kSlots] = {}, acc_v[kSlots] = {};
  for (size_t base = s; base < static_cast<size_t>(T); base += kWarp) {
    const size_t t = base + lane();
    float p = 0.0f, ds = 0.0f;
    if (t < static_cast<size_t>(T)) {
      const Probability pr =
          probability(r.head + t * ld, dy_head + t * C, key_row, C, d, scale, lse[r.bh * T + t]);
      p = pr.p;
      ds = pr.p * (pr.dp - row_dots[r.bh * T + t]) * scale;
    }
    const int count = min(kWarp, static_cast<int>(T - base));
    for (int k = 0; k < count; ++k) {
      add_scaled(acc_k, __shfl_sync(kFullWarp, ds, k), r.head + (base + k) * ld, d);
      add_scaled(acc_v, __shfl_sync(kFullWarp, p, k), dy_head + (base + k) * C, d);
    }
  }
  float* dk = dqkv + (r.b * T + s) * ld + C + r.h * d;
  store(dk, acc_k, 1.0f, d, true);
  store(dk + C, acc_v, 1.0f, d, true);
}

// Calls launch(std::integral_constant<int, kSlots>) with the smallest
// kSlots whose 32 * kSlots channels hold a head of d.
template <class Launch>
void with_slots(int d, Launch&& launch) {
  if (d <= kWarp) {
    launch(std::integral_constant<int, 1>{});
  } else if (d <= 2 * kWarp) {
    launch(std::integral_constant<int, 2>{});
  } else if (d <= 4 * kWarp) {
    launch(std::integral_constant<int, 4>{});
  } else {
    launch(std::integral_constant<int, 8>{});
  }
}

float attention_scale(int C, int NH) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(C / NH))); }

void check_head_dim(int C, int NH) {
  if (C / NH > kMaxHeadDim) {
    throw common::Error(common::ErrorCode::kInternal,
                        fmt::format("the CUDA attention takes head dimensions up to {}, not {} (n_embd / n_head)",
                                    kMaxHeadDim, C / NH));
  }
}

}  // namespace

void CudaBackend::attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH) {
  const size_t rows = static_cast<size_t>(B) * NH * T;
  if (rows == 0) return;
  check_head_dim(C, NH);
  with_slots(C / NH, [&](auto slots) {
    attention_forward_kernel<decltype(slots)::value>
        <<<grid_for_warps(rows), kThreads, 0, stream()>>>(out, lse, qkv, B, T, C, NH, attention_scale(C, NH));
  });
  check_launch("attention_forward");
}

void CudaBackend::attention_backward(float* dqkv, const float* dout, const float* qkv, const float* lse, int B, int T,
                                     int C, int NH) {
  const size_t rows = static_cast<size_t>(B) * NH * T;
  if (rows == 0) return;
  check_head_dim(C, NH);
  auto* row_dots = static_cast<float*>(scratch(rows * sizeof(float)));
  const float scale = attention_scale(C, NH);
  with_slots(C / NH, [&](auto slots) {
    constexpr int kSlots = decltype(slots)::value;
    attention_backward_query_kernel<kSlots>
        <<<grid_for_warps(rows), kThreads, 0, stream()>>>(dqkv, row_dots, dout, qkv, lse, B, T, C, NH, scale);
    check_launch("attention_backward (queries)");
    attention_backward_key_kernel<kSlots>
        <<<grid_for_warps(rows), kThreads, 0, stream()>>>(dqkv, row_dots, dout, qkv, lse, B, T, C, NH, scale);
    check_launch("attention_backward (keys)");
  });
}

}  // namespace keel::trainer::cuda
