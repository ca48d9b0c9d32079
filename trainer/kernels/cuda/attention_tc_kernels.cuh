// The tensor-core attention kernels (attention_tc.cu says what they do and
// why), written against warp_mma.cuh's primitives and launch.cuh's lane(),
// warp_sum() and global_warp(), which the includer provides: attention_tc.cu
// for the GPU, tests/trainer/warp_emulator.h for the host emulation that
// CI runs them in.
#pragma once

#include "trainer/kernels/backend.h"
#include "trainer/kernels/host_device.h"

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace keel::trainer::cuda::tc_attention {
// Internal to each includer: the GPU build and a host test may both link
// their own compilation of these kernels.
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

// What a block keeps in shared memory of a tile of keys (K and V) and of
// a tile of queries in the backward (Q, dO and the rows' statistics).
// Each kernel keeps its own tile once and two of the tiles it walks, the
// next one arriving while it works on the current one (double_buffered).
template <int D>
struct KeyTiles {
  static constexpr size_t kBytes = 2 * kTileBytes<D>;
  __nv_bfloat16 *k, *v;
  __device__ explicit KeyTiles(unsigned char* at)
      : k(reinterpret_cast<__nv_bfloat16*>(at)), v(k + kTile * kRowStride<D>) {}
};
template <int D>
struct QueryTiles {
  static constexpr size_t kBytes = 2 * kTileBytes<D> + 2 * kTile * sizeof(float);
  __nv_bfloat16 *q, *dout;
  float *lse2, *dots;  // the log-sum-exp in base-2 units and D_t
  __device__ explicit QueryTiles(unsigned char* at)
      : q(reinterpret_cast<__nv_bfloat16*>(at)),
        dout(q + kTile * kRowStride<D>),
        lse2(reinterpret_cast<float*>(dout + kTile * kRowStride<D>)),
        dots(lse2 + kTile) {}
};

// Launch geometry: a block of kTileThreads per tile of 64 rows (grid x)
// and (batch, head) pair (grid y), with this much dynamic shared memory;
// the row statistics a warp per query row in blocks of kThreads.
KEEL_HOST_DEVICE inline int tiles_of(int rows) { return (rows + kTile - 1) / kTile; }
template <int D>
constexpr size_t kForwardSharedBytes = kTileBytes<D> + 2 * KeyTiles<D>::kBytes;
// At head 128 the backward kernels ask for 103 KB: sm_80 and sm_90 have
// it, sm_86 and sm_89 (99 KB a block) do not.
template <int D>
constexpr size_t kBackwardKeysSharedBytes = KeyTiles<D>::kBytes + 2 * QueryTiles<D>::kBytes;
template <int D>
constexpr size_t kBackwardQueriesSharedBytes = QueryTiles<D>::kBytes + 2 * KeyTiles<D>::kBytes;

// What attention_row_stats_kernel leaves the backward kernels per query
// row: lse2 and dots [B, NH, Tq], and dO rounded to bf16 [B, Tq, C].
struct RowStats {
  float *lse2, *dots;
  __nv_bfloat16* dout;
};

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
KEEL_UNROLL
  for (int kk = 0; kk < D / 16; ++kk) {
KEEL_UNROLL
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
KEEL_UNROLL
  for (int kk = 0; kk < kTile / 16; ++kk) {
    uint32_t frag[4];
    accumulators_as_a(frag, a[2 * kk], a[2 * kk + 1]);
KEEL_UNROLL
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
KEEL_UNROLL
  for (int kk = 0; kk < D / 16; ++kk) load_a<D>(a[kk], tile, warp, kk);
}

// Rows [0, 64) of a view (row r at src + r * ld) into `tile` as bf16: a
// float32 view rounded as it is read, a bf16 one copied 16 bytes at a time
// by cp.async (in flight until the caller waits for its group); rows at or
// past `valid` are zeros.
template <int D>
__device__ inline void load_tile(__nv_bfloat16* tile, const float* src, int ld, int valid) {
  constexpr int kVectors = D / 4;
  for (int i = static_cast<int>(threadIdx.x); i < kTile * kVectors; i += kTileThreads) {
    const int r = i / kVectors, c = i % kVectors * 4;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (r < valid) v = load_float4(src + static_cast<size_t>(r) * ld + c);
    auto* dst = reinterpret_cast<__nv_bfloat162*>(tile + r * kRowStride<D> + c);
    dst[0] = __floats2bfloat162_rn(v.x, v.y);
    dst[1] = __floats2bfloat162_rn(v.z, v.w);
  }
}
template <int D>
__device__ inline void load_tile(__nv_bfloat16* tile, const __nv_bfloat16* src, int ld, int valid) {
  constexpr int kVectors = D / 8;
  for (int i = static_cast<int>(threadIdx.x); i < kTile * kVectors; i += kTileThreads) {
    const int r = i / kVectors, c = i % kVectors * 8;
    __nv_bfloat16* dst = tile + r * kRowStride<D> + c;
    if (r < valid) {
      copy_16_bytes_async(dst, src + static_cast<size_t>(r) * ld + c);
    } else {
      *reinterpret_cast<uint4*>(dst) = uint4{0u, 0u, 0u, 0u};
    }
  }
}

// Runs work(i, stage) for tiles i in [0, count), tile i in buffer
// stage = i % 2, while tile i + 1's copies (issued by load(i + 1, stage ^ 1))
// are on their way. Copies the caller issued before the call arrive with
// tile 0's; all of this thread's have arrived when it returns (with no
// barrier after: a caller that reads shared memory then must add one).
template <class Load, class Work>
__device__ inline void double_buffered(int count, Load&& load, Work&& work) {
  if (count > 0) load(0, 0);
  commit_async_copies();
  for (int i = 0; i < count; ++i) {
    if (i + 1 < count) load(i + 1, (i + 1) % 2);
    commit_async_copies();
    wait_async_copies<1>();  // every group but the newest: tile i's
    __syncthreads();         // tile i, as every thread copied or stored it, is in place
    work(i, i % 2);
    __syncthreads();  // every warp is done with buffer i % 2 before tile i + 2 is copied into it
  }
  wait_async_copies<0>();
}

// Where head h of batch b starts in a view: in q, k and v (of element
// type T, the views' dtype) and in the dense and statistics arrays.
struct Head {
  int b, h;
  template <typename T> __device__ const T* q(const Inputs& in, int t) const {
    return static_cast<const T*>(in.q) + (static_cast<size_t>(b) * in.Tq + t) * in.ld_q + h * (in.C / in.NH);
  }
  template <typename T> __device__ const T* k(const Inputs& in, int s) const {
    return static_cast<const T*>(in.k) + (static_cast<size_t>(b) * in.Tk + s) * in.ld_kv + h * (in.C / in.NH);
  }
  template <typename T> __device__ const T* v(const Inputs& in, int s) const {
    return static_cast<const T*>(in.v) + (static_cast<size_t>(b) * in.Tk + s) * in.ld_kv + h * (in.C / in.NH);
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

// The (batch, head) pair of this block (grid y).
__device__ inline Head block_head(const Inputs& in) {
  return {static_cast<int>(blockIdx.y) / in.NH, static_cast<int>(blockIdx.y) % in.NH};
}

// This thread in a block of kTileWarps warps: its warp (16 rows of the
// tile each) and its place in the mma fragments, row g (and g + 8) and
// column pair `quad`.
struct TileLane {
  int warp, g, quad;
  __device__ TileLane() : warp(static_cast<int>(threadIdx.x) / kWarp), g(lane() / 4), quad(lane() % 4) {}
};

// Whether query t sees key s: the causal mask at the views' offsets.
__device__ inline bool sees(const Inputs& in, int t, int s) {
  return t < in.Tq && s < in.Tk && in.k_offset + s <= in.q_offset + t;
}

// Whether every query of the tile at t0 sees every key of the tile at s0:
// then the forward skips the mask (most pairs lie below the diagonal). The
// backward kernels mask every pair: skipping it there cost the key kernel
// 244 registers against 170 in ptxas (sm_90, head 64), a block less per SM.
__device__ inline bool all_seen(const Inputs& in, int t0, int s0) {
  return t0 + kTile <= in.Tq && s0 + kTile <= in.Tk && in.k_offset + s0 + kTile - 1 <= in.q_offset + t0;
}

// Keys [0, result) hold every key some query of [t0, t0 + 64) sees.
__device__ inline int keys_seen_by_tile(const Inputs& in, int t0) {
  const int last = min(t0 + kTile, in.Tq) - 1;
  return max(0, min(in.q_offset + last - in.k_offset + 1, in.Tk));
}

// The copies of a key tile, and of a query tile of the backward (its
// statistics 4 bytes at a time, 0 past the last query).
template <int D, typename T>
__device__ inline void load_keys(const KeyTiles<D>& to, const Inputs& in, const Head& head, int s0) {
  load_tile<D>(to.k, head.k<T>(in, s0), in.ld_kv, in.Tk - s0);
  load_tile<D>(to.v, head.v<T>(in, s0), in.ld_kv, in.Tk - s0);
}
template <int D, typename T>
__device__ inline void load_queries(const QueryTiles<D>& to, const RowStats& stats, const Inputs& in, const Head& head,
                                    int t0) {
  load_tile<D>(to.q, head.q<T>(in, t0), in.ld_q, in.Tq - t0);
  load_tile<D>(to.dout, stats.dout + head.dense(in, t0), in.C, in.Tq - t0);
  for (int i = static_cast<int>(threadIdx.x); i < 2 * kTile; i += kTileThreads) {
    const int r = i % kTile;
    float* dst = (i < kTile ? to.lse2 : to.dots) + r;
    if (t0 + r < in.Tq) {
      copy_4_bytes_async(dst, (i < kTile ? stats.lse2 : stats.dots) + head.stat(in, t0 + r));
    } else {
      *dst = 0.0f;
    }
  }
}

template <int D, typename T, typename O>
__global__ void __launch_bounds__(kTileThreads)
    attention_forward_tc_kernel(O* out, float* lse, Inputs in, float scale_log2) {
  KEEL_DYNAMIC_SHARED_MEMORY(shared);
  auto* q_tile = reinterpret_cast<__nv_bfloat16*>(shared);
  auto keys_in = [&](int stage) { return KeyTiles<D>(shared + kTileBytes<D> + stage * KeyTiles<D>::kBytes); };
  // Tiles of later queries see more keys: they start first.
  const int t0 = (gridDim.x - 1 - blockIdx.x) * kTile;
  const Head head = block_head(in);
  const TileLane at;
  const int warp = at.warp, quad = at.quad;
  const int row[2] = {t0 + warp * 16 + at.g, t0 + warp * 16 + at.g + 8};

  load_tile<D>(q_tile, head.q<T>(in, t0), in.ld_q, in.Tq - t0);
  uint32_t q_frag[D / 16][4];
  float o[D / 8][4] = {};
  // Per row: the running maximum of the scores (base-2 units) and this
  // lane's part of the running sum of exp2(score - maximum).
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  double_buffered(
      tiles_of(keys_seen_by_tile(in, t0)),
      [&](int j, int stage) { load_keys<D, T>(keys_in(stage), in, head, j * kTile); },
      [&](int j, int stage) {
        if (j == 0) load_rows_as_a<D>(q_frag, q_tile, warp);
        const KeyTiles<D> kv = keys_in(stage);
        const int s0 = j * kTile;
        const bool masked = !all_seen(in, t0, s0);
        float s[kTile / 8][4] = {};
        multiply_by_rows<D>(s, q_frag, kv.k);
        float tile_max[2] = {row_max[0], row_max[1]};
KEEL_UNROLL
        for (int n = 0; n < kTile / 8; ++n) {
KEEL_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int key = s0 + n * 8 + quad * 2 + e % 2;
            s[n][e] = !masked || sees(in, row[e / 2], key) ? s[n][e] * scale_log2 : -INFINITY;
            tile_max[e / 2] = fmaxf(tile_max[e / 2], s[n][e]);
          }
        }
        float base[2];
KEEL_UNROLL
        for (int r = 0; r < 2; ++r) {
          tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(kAllLanes, tile_max[r], 1));
          tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(kAllLanes, tile_max[r], 2));
          // A row that has seen no key yet keeps maximum -inf and sum 0.
          base[r] = tile_max[r] == -INFINITY ? 0.0f : tile_max[r];
          const float correction = exp2f(row_max[r] - base[r]);
          row_sum[r] *= correction;
KEEL_UNROLL
          for (int n = 0; n < D / 8; ++n) {
            o[n][2 * r] *= correction;
            o[n][2 * r + 1] *= correction;
          }
          row_max[r] = tile_max[r];
        }
KEEL_UNROLL
        for (int n = 0; n < kTile / 8; ++n) {
KEEL_UNROLL
          for (int e = 0; e < 4; ++e) {
            s[n][e] = exp2f(s[n][e] - base[e / 2]);
            row_sum[e / 2] += s[n][e];
          }
        }
        add_product<D>(o, s, kv.v);
      });

KEEL_UNROLL
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(kAllLanes, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(kAllLanes, row_sum[r], 2);
    if (row[r] >= in.Tq) continue;
    // A query that sees no key: out 0, lse -inf (the interface's rule).
    const float inverse = row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f;
    O* dst = out + head.dense(in, row[r]);
KEEL_UNROLL
    for (int n = 0; n < D / 8; ++n) {
      store(dst + n * 8 + quad * 2, o[n][2 * r] * inverse);
      store(dst + n * 8 + quad * 2 + 1, o[n][2 * r + 1] * inverse);
    }
    if (quad == 0) {
      lse[head.stat(in, row[r])] = row_sum[r] > 0.0f ? (row_max[r] + log2f(row_sum[r])) * kLn2 : -INFINITY;
    }
  }
}

// What the backward kernels read of each query row, a warp a row: D_t =
// dO_t . O_t (the row sums of P dP), the log-sum-exp in base-2 units, and
// dO_t rounded to bf16 once, so that the tiles copy it as they copy q, k
// and v instead of rounding it at every tile pair.
template <typename O>
__global__ void attention_row_stats_kernel(RowStats stats, const float* dout, const O* out, const float* lse,
                                           Inputs in) {
  const size_t row = global_warp();
  if (row >= static_cast<size_t>(in.B) * in.NH * in.Tq) return;
  const int t = static_cast<int>(row % in.Tq);
  const Head head{static_cast<int>(row / in.Tq / in.NH), static_cast<int>(row / in.Tq % in.NH)};
  const size_t at = head.dense(in, t);
  float partial = 0.0f;
  for (int j = lane(); j < in.C / in.NH; j += kWarp) {
    const float dy = dout[at + j];
    partial += dy * load(out + at + j);
    store(stats.dout + at + j, dy);
  }
  const float total = warp_sum(partial);
  if (lane() == 0) {
    stats.dots[row] = total;
    stats.lse2[row] = lse[row] * kLog2e;
  }
}

// A gradient element: a float32 one is added to, a bf16 one overwritten
// with the value rounded (Backend::AttentionGrads).
__device__ inline void put_gradient(float* to, float value) { *to += value; }
__device__ inline void put_gradient(__nv_bfloat16* to, float value) { store(to, value); }

// dK and dV of one key tile over every query tile that sees it.
template <int D, typename T, typename G>
__global__ void __launch_bounds__(kTileThreads)
    attention_backward_keys_tc_kernel(G* dk_out, G* dv_out, RowStats stats, Inputs in, float scale) {
  KEEL_DYNAMIC_SHARED_MEMORY(shared);
  const KeyTiles<D> kv(shared);
  auto queries_in = [&](int stage) {
    return QueryTiles<D>(shared + KeyTiles<D>::kBytes + stage * QueryTiles<D>::kBytes);
  };
  // Earlier keys are seen by more queries: they start first.
  const int s0 = static_cast<int>(blockIdx.x) * kTile;
  const Head head = block_head(in);
  const TileLane at;
  const int warp = at.warp, quad = at.quad;
  const int key[2] = {s0 + warp * 16 + at.g, s0 + warp * 16 + at.g + 8};
  const float scale_log2 = scale * kLog2e;

  load_keys<D, T>(kv, in, head, s0);
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  // The first query that sees the tile's first key.
  const int first = max(0, in.k_offset + s0 - in.q_offset);
  double_buffered(
      first < in.Tq ? tiles_of(in.Tq - first) : 0,
      [&](int j, int stage) { load_queries<D, T>(queries_in(stage), stats, in, head, first + j * kTile); },
      [&](int j, int stage) {
        const QueryTiles<D> qd = queries_in(stage);
        const int t0 = first + j * kTile;
        // S^T = K Q^T and dP^T = V dO^T: 16 keys x 64 queries a warp.
        float st[kTile / 8][4] = {}, dpt[kTile / 8][4] = {};
        {
          uint32_t a[D / 16][4];
          load_rows_as_a<D>(a, kv.k, warp);
          multiply_by_rows<D>(st, a, qd.q);
          load_rows_as_a<D>(a, kv.v, warp);
          multiply_by_rows<D>(dpt, a, qd.dout);
        }
        // P^T from the saved log-sum-exp, and dS^T = P^T (dP^T - D) scale.
KEEL_UNROLL
        for (int n = 0; n < kTile / 8; ++n) {
KEEL_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int i = n * 8 + quad * 2 + e % 2;  // the query's row in the tile
            const float p = sees(in, t0 + i, key[e / 2]) ? exp2f(st[n][e] * scale_log2 - qd.lse2[i]) : 0.0f;
            st[n][e] = p;
            dpt[n][e] = p * (dpt[n][e] - qd.dots[i]) * scale;
          }
        }
        // dV += P^T dO and dK += dS^T Q.
        add_product<D>(dv, st, qd.dout);
        add_product<D>(dk, dpt, qd.q);
      });
KEEL_UNROLL
  for (int r = 0; r < 2; ++r) {
    if (key[r] >= in.Tk) continue;
    const size_t at = (static_cast<size_t>(head.b) * in.Tk + key[r]) * in.ld_kv + head.h * D;
KEEL_UNROLL
    for (int n = 0; n < D / 8; ++n) {
      const int c = n * 8 + quad * 2;
      put_gradient(dk_out + at + c, dk[n][2 * r]);
      put_gradient(dk_out + at + c + 1, dk[n][2 * r + 1]);
      put_gradient(dv_out + at + c, dv[n][2 * r]);
      put_gradient(dv_out + at + c + 1, dv[n][2 * r + 1]);
    }
  }
}

// dQ of one query tile over every key tile it sees.
template <int D, typename T, typename G>
__global__ void __launch_bounds__(kTileThreads)
    attention_backward_queries_tc_kernel(G* dq_out, RowStats stats, Inputs in, float scale) {
  KEEL_DYNAMIC_SHARED_MEMORY(shared);
  const QueryTiles<D> qd(shared);
  auto keys_in = [&](int stage) { return KeyTiles<D>(shared + QueryTiles<D>::kBytes + stage * KeyTiles<D>::kBytes); };
  const int t0 = (gridDim.x - 1 - blockIdx.x) * kTile;
  const Head head = block_head(in);
  const TileLane at;
  const int warp = at.warp, quad = at.quad;
  const int row[2] = {t0 + warp * 16 + at.g, t0 + warp * 16 + at.g + 8};
  const int local[2] = {warp * 16 + at.g, warp * 16 + at.g + 8};
  const float scale_log2 = scale * kLog2e;

  load_queries<D, T>(qd, stats, in, head, t0);
  uint32_t q_frag[D / 16][4], do_frag[D / 16][4];
  float dq[D / 8][4] = {};
  double_buffered(
      tiles_of(keys_seen_by_tile(in, t0)),
      [&](int j, int stage) { load_keys<D, T>(keys_in(stage), in, head, j * kTile); },
      [&](int j, int stage) {
        if (j == 0) {
          load_rows_as_a<D>(q_frag, qd.q, warp);
          load_rows_as_a<D>(do_frag, qd.dout, warp);
        }
        const KeyTiles<D> kv = keys_in(stage);
        const int s0 = j * kTile;
        // S = Q K^T and dP = dO V^T: 16 queries x 64 keys a warp.
        float s[kTile / 8][4] = {}, dp[kTile / 8][4] = {};
        multiply_by_rows<D>(s, q_frag, kv.k);
        multiply_by_rows<D>(dp, do_frag, kv.v);
KEEL_UNROLL
        for (int n = 0; n < kTile / 8; ++n) {
KEEL_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int r = e / 2, k = s0 + n * 8 + quad * 2 + e % 2;
            const float p = sees(in, row[r], k) ? exp2f(s[n][e] * scale_log2 - qd.lse2[local[r]]) : 0.0f;
            dp[n][e] = p * (dp[n][e] - qd.dots[local[r]]) * scale;
          }
        }
        // dQ += dS K.
        add_product<D>(dq, dp, kv.k);
      });
KEEL_UNROLL
  for (int r = 0; r < 2; ++r) {
    if (row[r] >= in.Tq) continue;
    G* dst = dq_out + (static_cast<size_t>(head.b) * in.Tq + row[r]) * in.ld_q + head.h * D;
KEEL_UNROLL
    for (int n = 0; n < D / 8; ++n) {
      put_gradient(dst + n * 8 + quad * 2, dq[n][2 * r]);
      put_gradient(dst + n * 8 + quad * 2 + 1, dq[n][2 * r + 1]);
    }
  }
}

}  // namespace
}  // namespace keel::trainer::cuda::tc_attention
