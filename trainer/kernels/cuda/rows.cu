// Row gathers and scatters: the embedding lookup and the MoE dispatch and
// combine. Gathers run one thread per element. Scatters may hit the same
// destination row many times, and determinism forbids atomics, so each
// thread owns one column and walks the source rows in order, as the CPU
// backend does. That bounds their parallelism by the channel count: enough
// for correctness, a known cost for [GPU performance] to remove (a sort of
// the positions by destination row would lift it).
#include "trainer/kernels/cuda/cuda_backend.h"

#include "trainer/kernels/cuda/launch.cuh"

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

// Destination rows are split over this many blocks (grid y) by row %
// kScatterGroups, so a scatter fills the device while each destination
// element keeps one writer.
constexpr int kScatterGroups = 64;

// out[rows[m], c] += weights[m] * inp[m, c] for m in order: a thread per
// column and group of destination rows, so each destination element sums
// its terms in m order, as the CPU backend does. `rows` may be a token
// list offset by -v_begin and filtered to [0, limit); other rows are
// skipped (the embedding of a vocabulary shard).
__global__ void scatter_columns_kernel(float* out, const float* inp, const int32_t* rows, int row_offset, int limit,
                                       const float* weights, int M, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int group = static_cast<int>(blockIdx.y);
  for (int m = 0; m < M; ++m) {
    const int row = rows[m] - row_offset;
    if (row < 0 || row >= limit || row % kScatterGroups != group) continue;
    const float x = inp[static_cast<size_t>(m) * C + c];
    out[static_cast<size_t>(row) * C + c] += weights != nullptr ? weights[m] * x : x;
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

void scatter_columns(float* out, const float* inp, const int32_t* rows, int row_offset, int limit,
                     const float* weights, int M, int C, cudaStream_t stream) {
  if (M <= 0 || C <= 0) return;
  const dim3 grid(static_cast<unsigned>((C + kThreads - 1) / kThreads), kScatterGroups);
  scatter_columns_kernel<<<grid, kThreads, 0, stream>>>(out, inp, rows, row_offset, limit, weights, M, C);
  check_launch("scatter_columns");
}

}  // namespace

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
  if (dwte != nullptr) scatter_columns(dwte, dout, tokens, v_begin, Vl, nullptr, B * T, C, stream());
}

void CudaBackend::gather_rows(float* out, const float* inp, const int32_t* rows, const float* weights, int M, int C) {
  launch("gather_rows", gather_rows_kernel, static_cast<size_t>(M) * C, stream(), out, inp, rows, weights, C);
}

void CudaBackend::scatter_add_rows(float* out, const float* inp, const int32_t* rows, const float* weights, int M,
                                   int C) {
  scatter_columns(out, inp, rows, 0, INT32_MAX, weights, M, C, stream());
}

void CudaBackend::gathered_row_dot(float* out, const float* a, const int32_t* rows, const float* b, int M, int C) {
  if (M <= 0) return;
  gathered_row_dot_kernel<<<grid_for_warps(M), kThreads, 0, stream()>>>(out, a, rows, b, M, C);
  check_launch("gathered_row_dot");
}

}  // namespace keel::trainer::cuda
