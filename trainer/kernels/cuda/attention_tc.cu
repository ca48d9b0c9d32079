// Causal attention on tensor cores (docs/architecture.md "GPU step"): the
// bf16 path of attention_forward and attention_backward, taken when the
// GEMMs multiply bf16 and the head dimension is 64 or 128. Flash attention
// in the FlashAttention-2 arrangement, on mma.sync m16n8k16 (bf16 inputs,
// float32 accumulators, which Hopper runs at full tensor-core rate):
// * a block of 4 warps takes a tile of 64 rows, each warp 16 of them, and
//   walks the other side's tiles of 64; tiles are read from the float32
//   views, rounded to bf16 into shared memory (rows 16 bytes longer than
//   the head, so ldmatrix's eight rows fall on different banks);
// * forward, per query tile: S = Q K^T, an online softmax in base 2 kept
//   per row (the 4 lanes of a quad hold a row's columns), P rounded to
//   bf16 straight from S's accumulators into the A operand of O += P V;
//   the log-sum-exp is written in natural log, as the interface says;
// * backward: D_t = dO_t . O_t per row first; then per key tile dK and dV
//   over the query tiles that see it (S^T = K Q^T, dP^T = V dO^T, P^T and
//   dS^T, then dV += P^T dO and dK += dS^T Q), and per query tile dQ over
//   its key tiles (dQ += dS K). Every output row has one writer and every
//   sum runs in a fixed order: no atomics, the same bits run after run,
//   which the SDC rerun and bit-identical resume need.
// The CPU reference rounds the same operands (cpu_backend.cpp, attention
// with bf16 GEMM inputs); the two differ by summation order and by where
// P is rounded (before normalisation here, after on the CPU).
#include "trainer/kernels/cuda/attention_tc.h"

#include "trainer/kernels/cuda/launch.cuh"

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

namespace keel::trainer::cuda {
namespace {

using Inputs = Backend::AttentionInputs;

constexpr int kTile = 64;  // rows of a tile, query or key
constexpr int kTileWarps = 4;
constexpr int kTileThreads = kTileWarps * kWarp;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kAllLanes = 0xffffffffu;

// bf16 elements per shared-memory row of a tile of head dimension D, and
// a tile's bytes.
template <int D>
constexpr int kRowStride = D + 8;
template <int D>
constexpr size_t kTileBytes = static_cast<size_t>(kTile) * kRowStride<D> * sizeof(__nv_bfloat16);

__device__ inline uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 bf16 matrices from shared memory; lane l gives the address of
// row l % 8 of matrix l / 8, and receives row l / 4, columns 2(l % 4) and
// 2(l % 4) + 1 of each (transposed: column l / 4, rows 2(l % 4) and +1).
__device__ inline void load_matrices(uint32_t (&r)[4], const __nv_bfloat16* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}
__device__ inline void load_matrices_transposed(uint32_t (&r)[4], const __nv_bfloat16* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}

// c += a b for a 16x16 A (row major) and a 16x8 B (column major). Lane
// l = 4g + q holds c[0], c[1] at row g, columns 2q and 2q + 1, and c[2],
// c[3] at row g + 8.
__device__ inline void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as the bf16 pair of a fragment register (the first in the low half).
__device__ inline uint32_t bf16_pair(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The A operand of a 16x16 product from the accumulators of two 16x8
// tiles side by side (columns 16j .. 16j + 15 of a 16-row result): the
// accumulator layout of m16n8 is the A layout of m16n8k16, half by half.
__device__ inline void accumulators_as_a(uint32_t (&a)[4], const float (&left)[4], const float (&right)[4]) {
  a[0] = bf16_pair(left[0], left[1]);
  a[1] = bf16_pair(left[2], left[3]);
  a[2] = bf16_pair(right[0], right[1]);
  a[3] = bf16_pair(right[2], right[3]);
}

// The A operand of rows 16w .. 16w + 15, columns 16kk .. of a tile.
template <int D>
__device__ inline void load_a(uint32_t (&a)[4], const __nv_bfloat16* tile, int warp, int kk) {
  const int l = lane();
  load_matrices(a, tile + (warp * 16 + l % 16) * kRowStride<D> + kk * 16 + l / 16 * 8);
}

// B operands of two 8-column tiles n, n + 1 (columns 8n .. 8n + 15 of the
// product) over k = 16kk .., from a tile whose rows are the product's
// columns (B = tile^T: K for Q K^T): b[0], b[1] for n, b[2], b[3] for n + 1.
template <int D>
__device__ inline void load_b_rows(uint32_t (&b)[4], const __nv_bfloat16* tile, int n, int kk) {
  const int l = lane();
  load_matrices(b, tile + (n * 8 + l % 8 + l / 16 * 8) * kRowStride<D> + kk * 16 + (l / 8) % 2 * 8);
}

// The same from a tile whose rows are k (B = tile: V for P V).
template <int D>
__device__ inline void load_b_columns(uint32_t (&b)[4], const __nv_bfloat16* tile, int n, int kk) {
  const int l = lane();
  load_matrices_transposed(b, tile + (kk * 16 + l % 8 + (l / 8) % 2 * 8) * kRowStride<D> + n * 8 + l / 16 * 8);
}

// acc = A tile^T for a 16 x D A held as fragments (a[kk]: columns
// 16kk ..) and a tile whose 64 rows are the product's columns: S = Q K^T.
template <int D>
__device__ inline void multiply_by_rows(float (&acc)[kTile / 8][4], const uint32_t (&a)[D / 16][4],
                                        const __nv_bfloat16* tile) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int n = 0; n < kTile / 8; n += 2) {
      uint32_t b[4];
      load_b_rows<D>(b, tile, n, kk);
      mma(acc[n], a[kk], b[0], b[1]);
      mma(acc[n + 1], a[kk], b[2], b[3]);
    }
  }
}

// acc += A tile for a 16 x 64 A held in accumulators (rounded to bf16 here)
// and a tile whose 64 rows are k: O += P V.
template <int D>
__device__ inline void add_product(float (&acc)[D / 8][4], const float (&a)[kTile / 8][4], const __nv_bfloat16* tile) {
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk) {
    uint32_t frag[4];
    accumulators_as_a(frag, a[2 * kk], a[2 * kk + 1]);
#pragma unroll
    for (int n = 0; n < D / 8; n += 2) {
      uint32_t b[4];
      load_b_columns<D>(b, tile, n, kk);
      mma(acc[n], frag, b[0], b[1]);
      mma(acc[n + 1], frag, b[2], b[3]);
    }
  }
}

// A fragments of the warp's 16 rows of a tile, all D columns.
template <int D>
__device__ inline void load_rows_as_a(uint32_t (&a)[D / 16][4], const __nv_bfloat16* tile, int warp) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) load_a<D>(a[kk], tile, warp, kk);
}

// Rows [0, 64) of a float32 view (row r at src + r * ld), rounded to bf16
// into `tile`; rows at or past `valid` are zeros.
template <int D>
__device__ inline void load_tile(__nv_bfloat16* tile, const float* src, int ld, int valid) {
  constexpr int kVectors = D / 4;
  for (int i = static_cast<int>(threadIdx.x); i < kTile * kVectors; i += kTileThreads) {
    const int r = i / kVectors, c = i % kVectors * 4;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (r < valid) v = *reinterpret_cast<const float4*>(src + static_cast<size_t>(r) * ld + c);
    auto* dst = reinterpret_cast<__nv_bfloat162*>(tile + r * kRowStride<D> + c);
    dst[0] = __floats2bfloat162_rn(v.x, v.y);
    dst[1] = __floats2bfloat162_rn(v.z, v.w);
  }
}

// Where head h of batch b starts in a view.
struct Head {
  int b, h;
  __device__ const float* q(const Inputs& in, int t) const {
    return in.q + (static_cast<size_t>(b) * in.Tq + t) * in.ld_q + h * (in.C / in.NH);
  }
  __device__ const float* k(const Inputs& in, int s) const {
    return in.k + (static_cast<size_t>(b) * in.Tk + s) * in.ld_kv + h * (in.C / in.NH);
  }
  __device__ const float* v(const Inputs& in, int s) const {
    return in.v + (static_cast<size_t>(b) * in.Tk + s) * in.ld_kv + h * (in.C / in.NH);
  }
  // Query row t of a dense [B, Tq, C] tensor (out, dout).
  __device__ size_t dense(const Inputs& in, int t) const {
    return (static_cast<size_t>(b) * in.Tq + t) * in.C + h * (in.C / in.NH);
  }
  // Row t of the [B, NH, Tq] statistics (lse, row dots).
  __device__ size_t stat(const Inputs& in, int t) const {
    return (static_cast<size_t>(b) * in.NH + h) * in.Tq + t;
  }
};

// Whether query t sees key s: the causal mask at the views' offsets.
__device__ inline bool sees(const Inputs& in, int t, int s) {
  return t < in.Tq && s < in.Tk && in.k_offset + s <= in.q_offset + t;
}

// Keys [0, result) hold every key some query of [t0, t0 + 64) sees.
__device__ inline int keys_seen_by_tile(const Inputs& in, int t0) {
  const int last = min(t0 + kTile, in.Tq) - 1;
  return max(0, min(in.q_offset + last - in.k_offset + 1, in.Tk));
}

template <int D>
__global__ void __launch_bounds__(kTileThreads)
    attention_forward_tc_kernel(float* out, float* lse, Inputs in, float scale_log2) {
  extern __shared__ __align__(16) unsigned char shared[];
  auto* q_tile = reinterpret_cast<__nv_bfloat16*>(shared);
  auto* k_tile = q_tile + kTile * kRowStride<D>;
  auto* v_tile = k_tile + kTile * kRowStride<D>;
  // Tiles of later queries see more keys: they start first.
  const int t0 = (gridDim.x - 1 - blockIdx.x) * kTile;
  const Head head{static_cast<int>(blockIdx.y) / in.NH, static_cast<int>(blockIdx.y) % in.NH};
  const int warp = static_cast<int>(threadIdx.x) / kWarp, g = lane() / 4, quad = lane() % 4;
  const int row[2] = {t0 + warp * 16 + g, t0 + warp * 16 + g + 8};

  load_tile<D>(q_tile, head.q(in, t0), in.ld_q, in.Tq - t0);
  __syncthreads();
  uint32_t q_frag[D / 16][4];
  load_rows_as_a<D>(q_frag, q_tile, warp);

  float o[D / 8][4] = {};
  // Per row: the running maximum of the scores (base-2 units) and this
  // lane's part of the running sum of exp2(score - maximum).
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  const int keys = keys_seen_by_tile(in, t0);
  for (int s0 = 0; s0 < keys; s0 += kTile) {
    __syncthreads();  // every warp is done with the previous K and V
    load_tile<D>(k_tile, head.k(in, s0), in.ld_kv, in.Tk - s0);
    load_tile<D>(v_tile, head.v(in, s0), in.ld_kv, in.Tk - s0);
    __syncthreads();

    float s[kTile / 8][4] = {};
    multiply_by_rows<D>(s, q_frag, k_tile);
    float tile_max[2] = {row_max[0], row_max[1]};
#pragma unroll
    for (int n = 0; n < kTile / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = s0 + n * 8 + quad * 2 + e % 2;
        s[n][e] = sees(in, row[e / 2], key) ? s[n][e] * scale_log2 : -INFINITY;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], s[n][e]);
      }
    }
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(kAllLanes, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(kAllLanes, tile_max[r], 2));
      // A row that has seen no key yet keeps maximum -inf and sum 0.
      base[r] = tile_max[r] == -INFINITY ? 0.0f : tile_max[r];
      const float correction = exp2f(row_max[r] - base[r]);
      row_sum[r] *= correction;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[n][2 * r] *= correction;
        o[n][2 * r + 1] *= correction;
      }
      row_max[r] = tile_max[r];
    }
#pragma unroll
    for (int n = 0; n < kTile / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = exp2f(s[n][e] - base[e / 2]);
        row_sum[e / 2] += s[n][e];
      }
    }
    add_product<D>(o, s, v_tile);
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(kAllLanes, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(kAllLanes, row_sum[r], 2);
    if (row[r] >= in.Tq) continue;
    // A query that sees no key: out 0, lse -inf (the interface's rule).
    const float inverse = row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f;
    float* dst = out + head.dense(in, row[r]);
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      dst[n * 8 + quad * 2] = o[n][2 * r] * inverse;
      dst[n * 8 + quad * 2 + 1] = o[n][2 * r + 1] * inverse;
    }
    if (quad == 0) {
      lse[head.stat(in, row[r])] = row_sum[r] > 0.0f ? (row_max[r] + log2f(row_sum[r])) * kLn2 : -INFINITY;
    }
  }
}

// D_t = dO_t . O_t, a warp per query row (the backward's row sums of P dP).
__global__ void attention_row_dots_kernel(float* row_dots, const float* dout, const float* out, Inputs in) {
  const size_t row = global_warp();
  if (row >= static_cast<size_t>(in.B) * in.NH * in.Tq) return;
  const int t = static_cast<int>(row % in.Tq);
  const Head head{static_cast<int>(row / in.Tq / in.NH), static_cast<int>(row / in.Tq % in.NH)};
  const size_t at = head.dense(in, t);
  float partial = 0.0f;
  for (int j = lane(); j < in.C / in.NH; j += kWarp) partial += dout[at + j] * out[at + j];
  const float total = warp_sum(partial);
  if (lane() == 0) row_dots[row] = total;
}

// The statistics of query rows [t0, t0 + 64) in shared memory: the
// log-sum-exp in base-2 units and D_t; 0 past the last query.
__device__ inline void load_row_stats(float* lse2, float* dots, const float* lse, const float* row_dots,
                                      const Inputs& in, const Head& head, int t0) {
  for (int i = static_cast<int>(threadIdx.x); i < kTile; i += kTileThreads) {
    const bool valid = t0 + i < in.Tq;
    lse2[i] = valid ? lse[head.stat(in, t0 + i)] * kLog2e : 0.0f;
    dots[i] = valid ? row_dots[head.stat(in, t0 + i)] : 0.0f;
  }
}

// dK and dV of one key tile over every query tile that sees it.
template <int D>
__global__ void __launch_bounds__(kTileThreads)
    attention_backward_keys_tc_kernel(Backend::AttentionGrads grads, const float* dout, const float* lse,
                                      const float* row_dots, Inputs in, float scale) {
  extern __shared__ __align__(16) unsigned char shared[];
  auto* k_tile = reinterpret_cast<__nv_bfloat16*>(shared);
  auto* v_tile = k_tile + kTile * kRowStride<D>;
  auto* q_tile = v_tile + kTile * kRowStride<D>;
  auto* do_tile = q_tile + kTile * kRowStride<D>;
  auto* lse2 = reinterpret_cast<float*>(do_tile + kTile * kRowStride<D>);
  float* dots = lse2 + kTile;
  // Earlier keys are seen by more queries: they start first.
  const int s0 = static_cast<int>(blockIdx.x) * kTile;
  const Head head{static_cast<int>(blockIdx.y) / in.NH, static_cast<int>(blockIdx.y) % in.NH};
  const int warp = static_cast<int>(threadIdx.x) / kWarp, g = lane() / 4, quad = lane() % 4;
  const int key[2] = {s0 + warp * 16 + g, s0 + warp * 16 + g + 8};
  const float scale_log2 = scale * kLog2e;

  load_tile<D>(k_tile, head.k(in, s0), in.ld_kv, in.Tk - s0);
  load_tile<D>(v_tile, head.v(in, s0), in.ld_kv, in.Tk - s0);
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  // The first query that sees the tile's first key.
  const int first = max(0, in.k_offset + s0 - in.q_offset);
  for (int t0 = first; t0 < in.Tq; t0 += kTile) {
    __syncthreads();  // K and V are in place; every warp is done with the last Q and dO
    load_tile<D>(q_tile, head.q(in, t0), in.ld_q, in.Tq - t0);
    load_tile<D>(do_tile, dout + head.dense(in, t0), in.C, in.Tq - t0);
    load_row_stats(lse2, dots, lse, row_dots, in, head, t0);
    __syncthreads();

    // S^T = K Q^T and dP^T = V dO^T: 16 keys x 64 queries a warp.
    float st[kTile / 8][4] = {}, dpt[kTile / 8][4] = {};
    {
      uint32_t a[D / 16][4];
      load_rows_as_a<D>(a, k_tile, warp);
      multiply_by_rows<D>(st, a, q_tile);
      load_rows_as_a<D>(a, v_tile, warp);
      multiply_by_rows<D>(dpt, a, do_tile);
    }
    // P^T from the saved log-sum-exp, and dS^T = P^T (dP^T - D) scale.
#pragma unroll
    for (int n = 0; n < kTile / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = n * 8 + quad * 2 + e % 2;  // the query's row in the tile
        const float p = sees(in, t0 + i, key[e / 2]) ? exp2f(st[n][e] * scale_log2 - lse2[i]) : 0.0f;
        st[n][e] = p;
        dpt[n][e] = p * (dpt[n][e] - dots[i]) * scale;
      }
    }
    // dV += P^T dO and dK += dS^T Q.
    add_product<D>(dv, st, do_tile);
    add_product<D>(dk, dpt, q_tile);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (key[r] >= in.Tk) continue;
    const size_t at = (static_cast<size_t>(head.b) * in.Tk + key[r]) * in.ld_kv + head.h * D;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int c = n * 8 + quad * 2;
      grads.dk[at + c] += dk[n][2 * r];
      grads.dk[at + c + 1] += dk[n][2 * r + 1];
      grads.dv[at + c] += dv[n][2 * r];
      grads.dv[at + c + 1] += dv[n][2 * r + 1];
    }
  }
}

// dQ of one query tile over every key tile it sees.
template <int D>
__global__ void __launch_bounds__(kTileThreads)
    attention_backward_queries_tc_kernel(Backend::AttentionGrads grads, const float* dout, const float* lse,
                                         const float* row_dots, Inputs in, float scale) {
  extern __shared__ __align__(16) unsigned char shared[];
  auto* q_tile = reinterpret_cast<__nv_bfloat16*>(shared);
  auto* do_tile = q_tile + kTile * kRowStride<D>;
  auto* k_tile = do_tile + kTile * kRowStride<D>;
  auto* v_tile = k_tile + kTile * kRowStride<D>;
  auto* lse2 = reinterpret_cast<float*>(v_tile + kTile * kRowStride<D>);
  float* dots = lse2 + kTile;
  const int t0 = (gridDim.x - 1 - blockIdx.x) * kTile;
  const Head head{static_cast<int>(blockIdx.y) / in.NH, static_cast<int>(blockIdx.y) % in.NH};
  const int warp = static_cast<int>(threadIdx.x) / kWarp, g = lane() / 4, quad = lane() % 4;
  const int row[2] = {t0 + warp * 16 + g, t0 + warp * 16 + g + 8};
  const float scale_log2 = scale * kLog2e;

  load_tile<D>(q_tile, head.q(in, t0), in.ld_q, in.Tq - t0);
  load_tile<D>(do_tile, dout + head.dense(in, t0), in.C, in.Tq - t0);
  load_row_stats(lse2, dots, lse, row_dots, in, head, t0);
  __syncthreads();
  uint32_t q_frag[D / 16][4], do_frag[D / 16][4];
  load_rows_as_a<D>(q_frag, q_tile, warp);
  load_rows_as_a<D>(do_frag, do_tile, warp);
  const int local[2] = {warp * 16 + g, warp * 16 + g + 8};

  float dq[D / 8][4] = {};
  const int keys = keys_seen_by_tile(in, t0);
  for (int s0 = 0; s0 < keys; s0 += kTile) {
    __syncthreads();
    load_tile<D>(k_tile, head.k(in, s0), in.ld_kv, in.Tk - s0);
    load_tile<D>(v_tile, head.v(in, s0), in.ld_kv, in.Tk - s0);
    __syncthreads();
    // S = Q K^T and dP = dO V^T: 16 queries x 64 keys a warp.
    float s[kTile / 8][4] = {}, dp[kTile / 8][4] = {};
    multiply_by_rows<D>(s, q_frag, k_tile);
    multiply_by_rows<D>(dp, do_frag, v_tile);
#pragma unroll
    for (int n = 0; n < kTile / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2, k = s0 + n * 8 + quad * 2 + e % 2;
        const float p = sees(in, row[r], k) ? exp2f(s[n][e] * scale_log2 - lse2[local[r]]) : 0.0f;
        dp[n][e] = p * (dp[n][e] - dots[local[r]]) * scale;
      }
    }
    // dQ += dS K.
    add_product<D>(dq, dp, k_tile);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row[r] >= in.Tq) continue;
    float* dst = grads.dq + (static_cast<size_t>(head.b) * in.Tq + row[r]) * in.ld_q + head.h * D;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      dst[n * 8 + quad * 2] += dq[n][2 * r];
      dst[n * 8 + quad * 2 + 1] += dq[n][2 * r + 1];
    }
  }
}

template <class Kernel, class... Args>
void launch_tiles(const char* name, Kernel kernel, int tiles, const Inputs& in, size_t shared_bytes,
                  cudaStream_t stream, Args... args) {
  // Above 48 KiB a kernel must ask for its dynamic shared memory.
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes)),
        name);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(in.B * in.NH));
  kernel<<<grid, kTileThreads, shared_bytes, stream>>>(args...);
  check_launch(name);
}

int tiles_of(int rows) { return (rows + kTile - 1) / kTile; }

float attention_scale(int d) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))); }

// Calls run(std::integral_constant<int, D>) for the view's head dimension.
template <class Run>
void with_head_dim(const Inputs& in, Run&& run) {
  if (in.C / in.NH == 64) {
    run(std::integral_constant<int, 64>{});
  } else {
    run(std::integral_constant<int, 128>{});
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool tensor_core_attention_fits(const Inputs& in, const float* dout) {
  const int d = in.NH > 0 && in.C % in.NH == 0 ? in.C / in.NH : 0;
  return (d == 64 || d == 128) && in.ld_q % 4 == 0 && in.ld_kv % 4 == 0 && aligned16(in.q) && aligned16(in.k) &&
         aligned16(in.v) && (dout == nullptr || aligned16(dout)) && in.Tq > 0 && in.Tk > 0 &&
         static_cast<long>(in.B) * in.NH <= 65535;
}

void tensor_core_attention_forward(cudaStream_t stream, float* out, float* lse, const Inputs& in) {
  with_head_dim(in, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    launch_tiles("attention_forward (tensor cores)", attention_forward_tc_kernel<D>, tiles_of(in.Tq), in,
                 3 * kTileBytes<D>, stream, out, lse, in, attention_scale(D) * kLog2e);
  });
}

void tensor_core_attention_backward(cudaStream_t stream, const Backend::AttentionGrads& grads, const float* dout,
                                    const float* out, const float* lse, const Inputs& in, float* row_dots) {
  const size_t rows = static_cast<size_t>(in.B) * in.NH * in.Tq;
  attention_row_dots_kernel<<<grid_for_warps(rows), kThreads, 0, stream>>>(row_dots, dout, out, in);
  check_launch("attention_backward (row dots)");
  with_head_dim(in, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    const size_t shared_bytes = 4 * kTileBytes<D> + 2 * kTile * sizeof(float);
    launch_tiles("attention_backward (keys, tensor cores)", attention_backward_keys_tc_kernel<D>, tiles_of(in.Tk),
                 in, shared_bytes, stream, grads, dout, lse, static_cast<const float*>(row_dots), in,
                 attention_scale(D));
    launch_tiles("attention_backward (queries, tensor cores)", attention_backward_queries_tc_kernel<D>,
                 tiles_of(in.Tq), in, shared_bytes, stream, grads, dout, lse, static_cast<const float*>(row_dots), in,
                 attention_scale(D));
  });
}

}  // namespace keel::trainer::cuda
