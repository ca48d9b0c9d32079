// Causal attention, flash style (backend.h): the probabilities are never
// stored, only each query row's log-sum-exp, and the backward recomputes
// them. One warp per row throughout. In the score passes each lane owns one
// key (or query) of a chunk of 32 and computes its whole d-long dot
// product; in the value passes each lane owns head channels and the chunk's
// probabilities reach it by shuffles.
// * forward, per query row: an online softmax over the chunks of the keys
//   it sees (running max, running sum, running output), then
//   lse = max + log(sum);
// * backward, per query row t: D_t = dO_t . O_t, then dQ_t;
// * backward, per key row s of a key/value head: dK_s and dV_s over the
//   queries that see it, those of each query head of its group in head
//   order, with D_t from the first pass;
// * merge: a thread per channel of a query row, then one per row.
// Every output row has one writer and every sum runs in order: no atomics.
// These are the float32 kernels (CUDA cores); with bf16 GEMM inputs and a
// head of 64 or 128 the tensor-core kernels of attention_tc.cu run instead.
#include "trainer/kernels/cuda/cuda_backend.h"

#include "trainer/kernels/cuda/attention_tc.h"
#include "trainer/kernels/cuda/launch.cuh"

#include <fmt/format.h>

#include <cmath>
#include <type_traits>

namespace keel::trainer::cuda {
namespace {

using Inputs = Backend::AttentionInputs;

// Head dimensions up to this fit the per-lane accumulators: kSlots floats
// a lane, the kernels compiled for 1, 2, 4 and 8 (with_slots picks the
// smallest that holds the head, so GPT-2's 64 runs 2).
constexpr int kMaxHeadDim = 256;
constexpr unsigned kFullWarp = 0xffffffffu;

// A row (b, h, t) of `rows` per (batch, query head), and where its head
// starts in the query view and its key/value head (grouped-query
// attention: h / (NH / KVH)) in the key and value views, whose elements are T.
template <typename T>
struct Row {
  size_t b, h, t, bh, kvh;
  int d;  // head dimension
  __device__ Row(size_t row, int rows, const Inputs& in)
      : b(row / rows / in.NH),
        h(row / rows % in.NH),
        t(row % rows),
        bh(row / rows),
        kvh(h / (in.NH / in.kv_heads())),
        d(in.C / in.NH) {}
  __device__ const T* q(const Inputs& in, size_t t_q) const {
    return static_cast<const T*>(in.q) + (b * in.Tq + t_q) * in.ld_q + h * d;
  }
  __device__ const T* k(const Inputs& in, size_t s) const {
    return static_cast<const T*>(in.k) + (b * in.Tk + s) * in.ld_kv + kvh * d;
  }
  __device__ const T* v(const Inputs& in, size_t s) const {
    return static_cast<const T*>(in.v) + (b * in.Tk + s) * in.ld_kv + kvh * d;
  }
  // Where query row t_q starts in a dense [B, Tq, C] tensor (out, dout).
  __device__ size_t dense(const Inputs& in, size_t t_q) const { return (b * in.Tq + t_q) * in.C + h * d; }
};

// The keys query row t sees: rows [0, visible_keys(in, t)).
__device__ inline int visible_keys(const Inputs& in, int t) {
  return max(0, min(in.q_offset + t - in.k_offset + 1, in.Tk));
}

template <typename X, typename Y> __device__ inline float dot(const X* x, const Y* y, int d) {
  float acc = 0.0f;
  for (int j = 0; j < d; ++j) acc += load(x + j) * load(y + j);
  return acc;
}

// acc[i] += weight * row[lane + i * 32] for the lane's channels; `write_lanes`
// adds (or writes) them to dst.
template <int kSlots, typename R>
__device__ inline void add_scaled(float (&acc)[kSlots], float weight, const R* row, int d) {
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int j = lane() + i * kWarp;
    if (j < d) acc[i] += weight * load(row + j);
  }
}

template <int kSlots, typename O>
__device__ inline void write_lanes(O* dst, const float (&acc)[kSlots], float scale, int d, bool accumulate) {
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int j = lane() + i * kWarp;
    if (j < d) store(dst + j, (accumulate ? load(dst + j) : 0.0f) + acc[i] * scale);
  }
}

template <int kSlots, typename T, typename O>
__global__ void attention_forward_kernel(O* out, float* lse, Inputs in, float scale) {
  const size_t row = global_warp();
  if (row >= static_cast<size_t>(in.B) * in.NH * in.Tq) return;
  const Row<T> r(row, in.Tq, in);
  const int d = r.d;
  const T* q = r.q(in, r.t);
  const int len = visible_keys(in, static_cast<int>(r.t));

  float max = -INFINITY, sum = 0.0f;
  float acc[kSlots] = {};
  for (int base = 0; base < len; base += kWarp) {
    const int s = base + lane();
    const float score = s < len ? dot(q, r.k(in, s), d) * scale : -INFINITY;
    const float new_max = fmaxf(max, warp_max(score));
    const float p = s < len ? expf(score - new_max) : 0.0f;
    const float correction = expf(max - new_max);  // 0 on the first chunk
    sum = sum * correction + warp_sum(p);
#pragma unroll
    for (int i = 0; i < kSlots; ++i) acc[i] *= correction;
    const int count = min(kWarp, len - base);
    for (int k = 0; k < count; ++k) add_scaled(acc, __shfl_sync(kFullWarp, p, k), r.v(in, base + k), d);
    max = new_max;
  }
  // A query before every key of the chunk sees nothing: out 0, lse -inf.
  write_lanes(out + r.dense(in, r.t), acc, len > 0 ? 1.0f / sum : 0.0f, d, false);
  if (lane() == 0) lse[r.bh * in.Tq + r.t] = len > 0 ? max + logf(sum) : -INFINITY;
}

// P_ts and dP_ts of query t and key s, the same expressions in both passes
// so that they agree to the bit.
struct Probability {
  float p, dp;
};
template <typename T>
__device__ inline Probability probability(const T* q, const float* dy, const T* k, const T* v, int d, float scale,
                                          float lse) {
  return {expf(dot(q, k, d) * scale - lse), dot(dy, v, d)};
}

// Gradients G: float32 ones are added to, bf16 ones overwritten (AttentionGrads).
template <typename G>
constexpr bool kAddsInto = std::is_same_v<G, float>;

template <int kSlots, typename T, typename O, typename G>
__global__ void attention_backward_query_kernel(G* dq, float* row_dots, const float* dout, const O* out,
                                                const float* lse, Inputs in, float scale) {
  const size_t row = global_warp();
  if (row >= static_cast<size_t>(in.B) * in.NH * in.Tq) return;
  const Row<T> r(row, in.Tq, in);
  const int d = r.d;
  const T* q = r.q(in, r.t);
  const float* dy = dout + r.dense(in, r.t);
  const O* o = out + r.dense(in, r.t);
  const float shift = lse[r.bh * in.Tq + r.t];
  const int len = visible_keys(in, static_cast<int>(r.t));

  float partial = 0.0f;
  for (int j = lane(); j < d; j += kWarp) partial += dy[j] * load(o + j);
  const float row_d = warp_sum(partial);
  if (lane() == 0) row_dots[r.bh * in.Tq + r.t] = row_d;

  float acc[kSlots] = {};
  for (int base = 0; base < len; base += kWarp) {
    const int s = base + lane();
    float ds = 0.0f;
    if (s < len) {
      const Probability pr = probability(q, dy, r.k(in, s), r.v(in, s), d, scale, shift);
      ds = pr.p * (pr.dp - row_d) * scale;
    }
    const int count = min(kWarp, len - base);
    for (int k = 0; k < count; ++k) add_scaled(acc, __shfl_sync(kFullWarp, ds, k), r.k(in, base + k), d);
  }
  write_lanes(dq + (r.b * in.Tq + r.t) * in.ld_q + r.h * d, acc, 1.0f, d, kAddsInto<G>);
}

template <int kSlots, typename T, typename G>
__global__ void attention_backward_key_kernel(G* dk, G* dv, const float* row_dots, const float* dout, const float* lse,
                                              Inputs in, float scale) {
  const size_t row = global_warp();
  const int KVH = in.kv_heads(), group = in.NH / KVH;
  if (row >= static_cast<size_t>(in.B) * KVH * in.Tk) return;
  const size_t b = row / in.Tk / KVH, kvh = row / in.Tk % KVH, s = row % in.Tk;
  const size_t Tq = static_cast<size_t>(in.Tq);
  const int d = in.C / in.NH;
  const size_t at = (b * in.Tk + s) * in.ld_kv + kvh * d;
  const T* k = static_cast<const T*>(in.k) + at;
  const T* v = static_cast<const T*>(in.v) + at;
  // The first query that sees key s.
  const size_t first = static_cast<size_t>(max(0, in.k_offset + static_cast<int>(s) - in.q_offset));

  float acc_k[kSlots] = {}, acc_v[kSlots] = {};
  for (size_t h = kvh * group; h < (kvh + 1) * group; ++h) {
    const Row<T> r((b * in.NH + h) * Tq, in.Tq, in);
    for (size_t base = first; base < Tq; base += kWarp) {
      const size_t t = base + lane();
      float p = 0.0f, ds = 0.0f;
      if (t < Tq) {
        const Probability pr = probability(r.q(in, t), dout + r.dense(in, t), k, v, d, scale, lse[r.bh * Tq + t]);
        p = pr.p;
        ds = pr.p * (pr.dp - row_dots[r.bh * Tq + t]) * scale;
      }
      const int count = min(kWarp, static_cast<int>(Tq - base));
      for (int j = 0; j < count; ++j) {
        add_scaled(acc_k, __shfl_sync(kFullWarp, ds, j), r.q(in, base + j), d);
        add_scaled(acc_v, __shfl_sync(kFullWarp, p, j), dout + r.dense(in, base + j), d);
      }
    }
  }
  write_lanes(dk + at, acc_k, 1.0f, d, kAddsInto<G>);
  write_lanes(dv + at, acc_v, 1.0f, d, kAddsInto<G>);
}

// The weights of (out, lse) and of (part_out, part_lse) in their merge, and
// the merged log-sum-exp.
struct MergeWeights {
  float mine, part, lse;
};
__device__ inline MergeWeights merge_weights(float lse, float part_lse) {
  const float m = fmaxf(lse, part_lse);
  const float mine = lse == -INFINITY ? 0.0f : expf(lse - m), part = expf(part_lse - m);
  return {mine / (mine + part), part / (mine + part), m + logf(mine + part)};
}

// A thread per element of out; the log-sum-exps change after, in their own kernel.
__global__ void attention_merge_kernel(float* out, const float* lse, const float* part_out, const float* part_lse,
                                       int T, int C, int NH, size_t n) {
  const int d = C / NH;
  for (size_t i = first_index(); i < n; i += grid_stride()) {
    const size_t bt = i / C, h = i % C / d;
    const size_t row = (bt / T * NH + h) * T + bt % T;
    if (part_lse[row] == -INFINITY) continue;  // the second set of keys adds nothing
    const MergeWeights w = merge_weights(lse[row], part_lse[row]);
    out[i] = w.mine * out[i] + w.part * part_out[i];
  }
}

__global__ void attention_merge_lse_kernel(float* lse, const float* part_lse, size_t rows) {
  for (size_t row = first_index(); row < rows; row += grid_stride()) {
    if (part_lse[row] != -INFINITY) lse[row] = merge_weights(lse[row], part_lse[row]).lse;
  }
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

// Calls run(T{}) for the element type T of the views' q, k and v.
template <class Run>
void with_element(const Inputs& in, Run&& run) {
  if (in.dtype == DType::kBF16) {
    run(__nv_bfloat16{});
  } else {
    run(float{});
  }
}

float attention_scale(int C, int NH) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(C / NH))); }

// bf16 views only where the GEMMs take bf16 (backend.h's contract).
void check_views(const Inputs& in, DType gemm_inputs) {
  if (in.dtype == DType::kBF16 && gemm_inputs != DType::kBF16) {
    throw common::Error(common::ErrorCode::kInternal, "bf16 attention inputs on a backend with float32 GEMM inputs");
  }
}

void check_head_dim(int C, int NH) {
  if (C / NH > kMaxHeadDim) {
    throw common::Error(common::ErrorCode::kInternal,
                        fmt::format("the CUDA attention takes head dimensions up to {}, not {} (n_embd / n_head)",
                                    kMaxHeadDim, C / NH));
  }
}

}  // namespace

void CudaBackend::attention_forward(Buffer out, float* lse, const AttentionInputs& in) {
  const size_t rows = static_cast<size_t>(in.B) * in.NH * in.Tq;
  check_views(in, gemm_inputs_);
  if (rows == 0) return;
  if (gemm_inputs_ == DType::kBF16 && tensor_core_attention_fits(in)) {
    tensor_core_attention_forward(stream(), out, lse, in);
    return;
  }
  check_head_dim(in.C, in.NH);
  with_slots(in.C / in.NH, [&](auto slots) {
    with_element(in, [&](auto element) {
      with_type<__nv_bfloat16>(out, [&](auto* to) {
        using O = std::remove_pointer_t<decltype(to)>;
        attention_forward_kernel<decltype(slots)::value, decltype(element), O>
            <<<grid_for_warps(rows), kThreads, 0, stream()>>>(to, lse, in, attention_scale(in.C, in.NH));
      });
    });
  });
  check_launch("attention_forward");
}

void CudaBackend::attention_backward(const AttentionGrads& grads, const float* dout, ConstBuffer out,
                                     const float* lse, const AttentionInputs& in) {
  const size_t query_rows = static_cast<size_t>(in.B) * in.NH * in.Tq;
  const size_t key_rows = static_cast<size_t>(in.B) * in.kv_heads() * in.Tk;
  check_views(in, gemm_inputs_);
  if (grads.dtype == DType::kBF16 && gemm_inputs_ != DType::kBF16) {
    throw common::Error(common::ErrorCode::kInternal, "bf16 attention gradients on a backend with float32 GEMM inputs");
  }
  if (query_rows == 0 || key_rows == 0) {
    // bf16 gradients are written over: with nothing on one side, the other
    // side's are zero, as the CPU leaves them.
    if (grads.dtype == DType::kBF16) {
      auto zero_rows = [&](void* grad, int ld, int width, size_t rows) {
        const size_t element = dtype_bytes(DType::kBF16);
        check(cudaMemset2DAsync(grad, static_cast<size_t>(ld) * element, 0, static_cast<size_t>(width) * element,
                                rows, stream()),
              "cudaMemset2DAsync (attention gradients)");
      };
      if (key_rows == 0 && query_rows > 0) zero_rows(grads.dq, in.ld_q, in.C, static_cast<size_t>(in.B) * in.Tq);
      if (query_rows == 0 && key_rows > 0) {
        zero_rows(grads.dk, in.ld_kv, in.kv_width(), static_cast<size_t>(in.B) * in.Tk);
        zero_rows(grads.dv, in.ld_kv, in.kv_width(), static_cast<size_t>(in.B) * in.Tk);
      }
    }
    return;
  }
  if (gemm_inputs_ == DType::kBF16 && tensor_core_attention_fits(in)) {
    tensor_core_attention_backward(stream(), grads, dout, out, lse, in,
                                   scratch(tensor_core_attention_scratch_bytes(in)));
    return;
  }
  auto* row_dots = static_cast<float*>(scratch(query_rows * sizeof(float)));
  check_head_dim(in.C, in.NH);
  const float scale = attention_scale(in.C, in.NH);
  with_slots(in.C / in.NH, [&](auto slots) {
    with_element(in, [&](auto element) {
      with_type<__nv_bfloat16>(Buffer(grads.dq, grads.dtype), [&](auto* dq) {
        constexpr int kSlots = decltype(slots)::value;
        using T = decltype(element);
        using G = std::remove_pointer_t<decltype(dq)>;
        with_type<__nv_bfloat16>(out, [&](const auto* o) {
          using O = std::remove_const_t<std::remove_pointer_t<decltype(o)>>;
          attention_backward_query_kernel<kSlots, T, O, G>
              <<<grid_for_warps(query_rows), kThreads, 0, stream()>>>(dq, row_dots, dout, o, lse, in, scale);
        });
        check_launch("attention_backward (queries)");
        attention_backward_key_kernel<kSlots, T, G><<<grid_for_warps(key_rows), kThreads, 0, stream()>>>(
            static_cast<G*>(grads.dk), static_cast<G*>(grads.dv), row_dots, dout, lse, in, scale);
        check_launch("attention_backward (keys)");
      });
    });
  });
}

void CudaBackend::attention_merge(float* out, float* lse, const float* part_out, const float* part_lse, int B, int T,
                                  int C, int NH) {
  launch("attention_merge", attention_merge_kernel, static_cast<size_t>(B) * T * C, stream(), out, lse, part_out,
         part_lse, T, C, NH);
  launch("attention_merge (lse)", attention_merge_lse_kernel, static_cast<size_t>(B) * NH * T, stream(), lse,
         part_lse);
}

}  // namespace keel::trainer::cuda
