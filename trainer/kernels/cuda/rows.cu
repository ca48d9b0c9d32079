// Row gathers and scatters: the embedding lookup and the MoE dispatch and
// combine. Gathers run one thread per element. Scatters may hit the same
// destination row many times, and determinism forbids atomics: the
// positions are sorted by destination row (CUB's radix sort, which is
// stable, so a row's positions stay in order), then a warp per row adds
// its terms in position order, as the CPU backend does.
#include "trainer/kernels/cuda/cuda_backend.h"

#include "trainer/kernels/cuda/launch.cuh"

#include <cub/device/device_radix_sort.cuh>

#include <cstdint>

namespace keel::trainer::cuda {
namespace {

__global__ void embedding_forward_kernel(float* out, const int32_t* tokens, const float* wte, int v_begin, int Vl,
                                         const float* wpe, int T, int C, size_t n) {
  for (size_t i = first_index(); i < n; i += grid_stride()) {
    const size_t bt = i / C;
    const int c = static_cast<int>(i % C);
    const int row = tokens[bt] - v_begin;
    float x = row >= 0 && row < Vl ? wte[static_cast<size_t>(row) * C + c] : 0.0f;
    if (wpe != nullptr) x += wpe[(bt % T) * C + c];
    out[i] = x;
  }
}

// One thread per (t, c); the batch is summed in order into the existing value.
__global__ void embedding_position_backward_kernel(float* dwpe, const float* dout, int B, int T, int C) {
  for (size_t i = first_index(); i < static_cast<size_t>(T) * C; i += grid_stride()) {
    const size_t t = i / C;
    const size_t c = i % C;
    float acc = dwpe[i];
    for (int b = 0; b < B; ++b) acc += dout[(b * static_cast<size_t>(T) + t) * C + c];
    dwpe[i] = acc;
  }
}

// The sort's input: each position's destination row, or `limit` (after
// every real row) for one outside [0, limit), and the position itself.
__global__ void scatter_keys_kernel(uint32_t* keys, int32_t* positions, const int32_t* rows, int row_offset, int limit,
                                    size_t n) {
  for (size_t i = first_index(); i < n; i += grid_stride()) {
    const int row = rows[i] - row_offset;
    keys[i] = static_cast<uint32_t>(row >= 0 && row < limit ? row : limit);
    positions[i] = static_cast<int32_t>(i);
  }
}

// A warp per run of equal destination rows, taken by the warp of its first
// element: out[row, c] += weights[m] * inp[m, c] over the run's positions
// m, in increasing order (weights nullable: 1).
__global__ void scatter_runs_kernel(float* out, const float* inp, const uint32_t* keys, const int32_t* positions,
                                    const float* weights, uint32_t limit, int M, int C) {
  const size_t i = global_warp();
  if (i >= static_cast<size_t>(M)) return;
  const uint32_t row = keys[i];
  if (row >= limit || (i > 0 && keys[i - 1] == row)) return;
  float* dst = out + static_cast<size_t>(row) * C;
  for (int c = lane(); c < C; c += kWarp) {
    float acc = dst[c];
    for (size_t j = i; j < static_cast<size_t>(M) && keys[j] == row; ++j) {
      const int32_t m = positions[j];
      const float x = inp[static_cast<size_t>(m) * C + c];
      acc += weights != nullptr ? weights[m] * x : x;
    }
    dst[c] = acc;
  }
}

__global__ void gather_rows_kernel(float* out, const float* inp, const int32_t* rows, const float* weights, int C,
                                   size_t n) {
  for (size_t i = first_index(); i < n; i += grid_stride()) {
    const size_t m = i / C;
    const float x = inp[static_cast<size_t>(rows[m]) * C + i % C];
    out[i] = weights != nullptr ? weights[m] * x : x;
  }
}

// One warp per m.
__global__ void gathered_row_dot_kernel(float* out, const float* a, const int32_t* rows, const float* b, int M,
                                        int C) {
  const size_t m = global_warp();
  if (m >= static_cast<size_t>(M)) return;
  const float* x = a + static_cast<size_t>(rows[m]) * C;
  const float* y = b + m * C;
  float acc = 0.0f;
  for (int c = lane(); c < C; c += kWarp) acc += x[c] * y[c];
  acc = warp_sum(acc);
  if (lane() == 0) out[m] = acc;
}

}  // namespace

void CudaBackend::scatter_columns(float* out, const float* inp, const int32_t* rows, int row_offset, int limit,
                                  const float* weights, int M, int C) {
  if (M <= 0 || C <= 0 || limit <= 0) return;
  const size_t n = static_cast<size_t>(M);
  // Keys and positions in and out, then the sort's own working memory,
  // all in scratch: a count of 32-bit words, CUB's rounded up to them.
  int end_bit = 0;  // the sort reads the bits that hold `limit`, the largest key
  while (end_bit < 32 && (uint64_t{1} << end_bit) <= static_cast<uint64_t>(limit)) ++end_bit;
  size_t sort_bytes = 0;
  check(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const uint32_t*>(nullptr),
                                        static_cast<uint32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                        static_cast<int32_t*>(nullptr), M, 0, end_bit, stream()),
        "cub::DeviceRadixSort::SortPairs (size)");
  const size_t words = 4 * n + (sort_bytes + sizeof(uint32_t) - 1) / sizeof(uint32_t);
  auto* keys_in = static_cast<uint32_t*>(scratch(words * sizeof(uint32_t)));
  uint32_t* keys = keys_in + n;
  auto* positions_in = reinterpret_cast<int32_t*>(keys + n);
  int32_t* positions = positions_in + n;
  void* sort_memory = positions + n;
  launch("scatter (keys)", scatter_keys_kernel, n, stream(), keys_in, positions_in, rows, row_offset, limit);
  check(cub::DeviceRadixSort::SortPairs(sort_memory, sort_bytes, keys_in, keys, positions_in, positions, M, 0, end_bit,
                                        stream()),
        "cub::DeviceRadixSort::SortPairs");
  scatter_runs_kernel<<<grid_for_warps(n), kThreads, 0, stream()>>>(out, inp, keys, positions, weights,
                                                                    static_cast<uint32_t>(limit), M, C);
  check_launch("scatter (rows)");
}

void CudaBackend::embedding_forward(float* out, const int32_t* tokens, const float* wte, int v_begin, int Vl,
                                    const float* wpe, int B, int T, int C) {
  launch("embedding_forward", embedding_forward_kernel, static_cast<size_t>(B) * T * C, stream(), out, tokens, wte,
         v_begin, Vl, wpe, T, C);
}

void CudaBackend::embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int v_begin,
                                     int Vl, int B, int T, int C) {
  if (dwpe != nullptr && T > 0 && C > 0) {
    embedding_position_backward_kernel<<<grid_for(static_cast<size_t>(T) * C), kThreads, 0, stream()>>>(dwpe, dout,
                                                                                                        B, T, C);
    check_launch("embedding_backward (positions)");
  }
  if (dwte != nullptr) scatter_columns(dwte, dout, tokens, v_begin, Vl, nullptr, B * T, C);
}

void CudaBackend::gather_rows(float* out, const float* inp, const int32_t* rows, const float* weights, int M, int C) {
  launch("gather_rows", gather_rows_kernel, static_cast<size_t>(M) * C, stream(), out, inp, rows, weights, C);
}

void CudaBackend::scatter_add_rows(float* out, const float* inp, const int32_t* rows, const float* weights, int M,
                                   int C) {
  scatter_columns(out, inp, rows, 0, INT32_MAX, weights, M, C);
}

void CudaBackend::gathered_row_dot(float* out, const float* a, const int32_t* rows, const float* b, int M, int C) {
  if (M <= 0) return;
  gathered_row_dot_kernel<<<grid_for_warps(M), kThreads, 0, stream()>>>(out, a, rows, b, M, C);
  check_launch("gathered_row_dot");
}

}  // namespace keel::trainer::cuda
