// The reference backend. Two rules shape everything here:
// * Determinism across thread counts. OpenBLAS's bits depend on how a GEMM
//   is partitioned (with 0.3.21, splitting the same product into different
//   blocks changes low bits), and its own threading partitions by thread
//   count. So OpenBLAS runs single-threaded, every GEMM is cut into tiles
//   whose sizes depend on the shape only, the tiles run in our parallel
//   region, and every reduction sums in an order fixed by the shape.
// * Speed. The CPU trainer has to beat PyTorch, so GEMMs go to OpenBLAS,
//   attention skips the masked upper triangle block by block, and GELU and
//   the softmaxes use an exp written so the compiler vectorises it.
#include "trainer/kernels/cpu_backend.h"

#include "common/error.h"
#include "trainer/kernels/adamw_step.h"
#include "trainer/kernels/column_sums.h"
#include "trainer/kernels/gelu.h"
#include "trainer/kernels/rotary.h"
#include "trainer/kernels/swiglu.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace keel::trainer {
namespace {

constexpr size_t kAlignment = 64;
// Below this many elements a parallel region costs more than it saves.
constexpr size_t kParallelMin = size_t{1} << 15;
// sum and sum_squares reduce chunks of this size into partials, then sum
// the partials serially, so the order depends on n only.
constexpr size_t kReduceChunk = size_t{1} << 16;
// Rows per partial in a norm's dweight/dbias reduction.
constexpr int kNormRowChunk = 32;
// Channels per work item where threads split a reduction by channel.
constexpr int kChannelBlock = 32;
// Queries per attention block: each block meets only the keys at or before
// its last row, so the masked triangle costs almost nothing.
constexpr int kQueryBlock = 64;
// GEMM tiles are halved until they hold about this much work or an edge
// would drop below kGemmMinEdge. Each tile repacks its panels of both
// operands, so smaller tiles buy parallelism beyond ~8 threads with packing
// overhead that costs the 2-core case (measured on the B=8, T=256, C=256
// block: 64e6/64 was ~10% slower than this).
constexpr double kGemmTileFlops = 128e6;
constexpr int kGemmMinEdge = 128;

inline float madd(float a, float b, float c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  // Without hardware FMA std::fma is a slow library call.
  return a * b + c;
#endif
}

// exp(x) to about 1.5 ulp (Cephes' polynomial) for x in [-87, 88], clamped
// outside. glibc's vector expf is reachable only under -ffast-math, which
// keel does not use; this one is plain arithmetic, so `omp simd` loops
// vectorise it.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = madd(x, 1.44269504088896341f, kShift);
  const float n = t - kShift;
  float r = madd(n, -0.693359375f, x);  // ln 2 split in two for exact reduction
  r = madd(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = madd(p, r, 1.3981999507e-3f);
  p = madd(p, r, 8.3334519073e-3f);
  p = madd(p, r, 4.1665795894e-2f);
  p = madd(p, r, 1.6666665459e-1f);
  p = madd(p, r, 5.0000001201e-1f);
  const float e = madd(p, r * r, r) + 1.0f;
  const int32_t pow2 = (std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(kShift) + 127) << 23;
  return e * std::bit_cast<float>(pow2);
}

// Sums load(0..n) in 16 independent lanes folded by a fixed tree. The lanes
// vectorise without reassociation, so the result depends on n alone, not on
// alignment or on which thread runs it.
template <typename Acc, typename Load>
inline Acc fixed_order_sum(size_t n, Load load) {
  constexpr size_t kLanes = 16;
  Acc acc[kLanes] = {};
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t j = 0; j < kLanes; ++j) acc[j] += load(i + j);
  }
  for (size_t j = 0; i + j < n; ++j) acc[j] += load(i + j);
  for (size_t width = kLanes / 2; width > 0; width /= 2) {
    for (size_t j = 0; j < width; ++j) acc[j] += acc[j + width];
  }
  return acc[0];
}

// A result stored as an output buffer holds it (bf16: rounded to nearest,
// ties to even); an input element as float32 (bf16 widened, exactly).
inline void put(float* to, float value) { *to = value; }
inline void put(bf16* to, float value) { *to = to_bf16(value); }
inline float widen(float x) { return x; }
inline float widen(bf16 x) { return to_float(x); }

inline float row_sum(const float* x, int n) {
  return fixed_order_sum<float>(n, [x](size_t i) { return x[i]; });
}

inline float row_dot(const float* a, const float* b, int n) {
  return fixed_order_sum<float>(n, [a, b](size_t i) { return a[i] * b[i]; });
}

inline float row_max(const float* x, int n) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// C = alpha * op(A) op(B) + beta * C, row-major. See the file comment for
// why tiles are fixed by shape. The parallel region has no if() clause on
// purpose: the OpenMP build of OpenBLAS takes its thread count from
// omp_get_max_threads() unless it is called inside an active parallel
// region.
void gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
          int ldb, float beta, float* c, int ldc) {
  if (m <= 0 || n <= 0) return;
  int tile_m = m;
  int tile_n = n;
  auto halve = [](int edge) { return (edge / 2 + 31) / 32 * 32; };
  while (2.0 * tile_m * tile_n * k > kGemmTileFlops) {
    // Splitting the longer edge keeps tiles square-ish, which minimises
    // the packing each tile repeats.
    if (tile_m >= tile_n && tile_m >= 2 * kGemmMinEdge) {
      tile_m = halve(tile_m);
    } else if (tile_n >= 2 * kGemmMinEdge) {
      tile_n = halve(tile_n);
    } else if (tile_m >= 2 * kGemmMinEdge) {
      tile_m = halve(tile_m);
    } else {
      break;
    }
  }
  const int tiles_m = (m + tile_m - 1) / tile_m;
  const int tiles_n = (n + tile_n - 1) / tile_n;
  const CBLAS_TRANSPOSE op_a = trans_a ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE op_b = trans_b ? CblasTrans : CblasNoTrans;
#pragma omp parallel for schedule(dynamic)
  for (int tile = 0; tile < tiles_m * tiles_n; ++tile) {
    const int i0 = tile / tiles_n * tile_m;
    const int j0 = tile % tiles_n * tile_n;
    const int rows = std::min(tile_m, m - i0);
    const int cols = std::min(tile_n, n - j0);
    const float* a_tile = trans_a ? a + i0 : a + static_cast<size_t>(i0) * lda;
    const float* b_tile = trans_b ? b + static_cast<size_t>(j0) * ldb : b + j0;
    cblas_sgemm(CblasRowMajor, op_a, op_b, rows, cols, k, alpha, a_tile, lda, b_tile, ldb, beta,
                c + static_cast<size_t>(i0) * ldc + j0, ldc);
  }
}

// dst[c] += sum over r of src[r*cols + c] in column_sums.h's order. Each
// thread owns whole columns, so the order is the same for any thread
// count; accumulating in double keeps long columns accurate.
template <typename T> void column_sum_accumulate(float* dst, const T* src, int rows, int cols) {
  const int blocks = (cols + kChannelBlock - 1) / kChannelBlock;
#pragma omp parallel for schedule(static) if (static_cast<size_t>(rows) * cols > kParallelMin)
  for (int blk = 0; blk < blocks; ++blk) {
    const int c0 = blk * kChannelBlock;
    const int width = std::min(kChannelBlock, cols - c0);
    double total[kChannelBlock] = {};
    for (int r0 = 0; r0 < rows; r0 += kColumnChunkRows) {
      double chunk[kChannelBlock] = {};
      for (int r = r0; r < std::min(rows, r0 + kColumnChunkRows); ++r) {
        const T* row = src + static_cast<size_t>(r) * cols + c0;
#pragma omp simd
        for (int j = 0; j < width; ++j) chunk[j] += widen(row[j]);
      }
#pragma omp simd
      for (int j = 0; j < width; ++j) total[j] += chunk[j];
    }
    for (int j = 0; j < width; ++j) dst[c0 + j] += static_cast<float>(total[j]);
  }
}

// Softmax of row[0..len) in place, zeros in row[len..width); returns the
// log-sum-exp of the scores it replaced.
inline float causal_softmax_row(float* row, int len, int width) {
  if (len == 0) {  // a query before every key of a chunk
    std::fill(row, row + width, 0.0f);
    return -INFINITY;
  }
  const float max = row_max(row, len);
#pragma omp simd
  for (int i = 0; i < len; ++i) row[i] = exp_approx(row[i] - max);
  const float sum = row_sum(row, len);
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int i = 0; i < len; ++i) row[i] *= inv;
  std::fill(row + len, row + width, 0.0f);
  return max + std::log(sum);
}

// Reduces fixed chunks into double partials, then the partials in order.
template <typename Load>
double chunked_sum(size_t n, Load load) {
  const size_t chunks = (n + kReduceChunk - 1) / kReduceChunk;
  std::vector<double> partial(chunks);
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (size_t chunk = 0; chunk < chunks; ++chunk) {
    const size_t begin = chunk * kReduceChunk;
    const size_t len = std::min(kReduceChunk, n - begin);
    partial[chunk] = fixed_order_sum<double>(len, [&load, begin](size_t i) { return load(begin + i); });
  }
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

}  // namespace

// Unset, omp_get_max_threads() is the CPUs this process may run on;
// OMP_NUM_THREADS (keeld sets it per rank) overrides that.
CpuBackend::CpuBackend(int threads, DType gemm_inputs)
    : threads_(threads > 0 ? threads : omp_get_max_threads()), gemm_inputs_(gemm_inputs) {
  // OpenBLAS itself runs single-threaded: the parallelism is ours (GEMM
  // tiles, attention heads). The OpenMP build would stay single-threaded
  // inside our parallel regions anyway, but a binary that resolves
  // libopenblas.so.0 to Debian's default pthreads build would not, and its
  // own threads would make results depend on the thread count. The OpenMP
  // build's openblas_set_num_threads also sets the OpenMP count, so ours
  // comes after it.
  openblas_set_num_threads(1);
  // A dynamic team could hand a GEMM tile loop one thread while
  // omp_get_max_threads() > 1, and the OpenMP OpenBLAS would thread again.
  omp_set_dynamic(0);
  omp_set_num_threads(threads_);
}

// ---- memory ----

void* CpuBackend::alloc(size_t bytes) {
  const size_t rounded = std::max(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  void* ptr = std::aligned_alloc(kAlignment, rounded);
  if (ptr == nullptr) throw std::bad_alloc();
  std::memset(ptr, 0, rounded);
  return ptr;
}

void CpuBackend::free(void* ptr) { std::free(ptr); }

void CpuBackend::zero(void* ptr, size_t bytes) { std::memset(ptr, 0, bytes); }

void CpuBackend::copy_from_host(void* dst, const void* host_src, size_t bytes) {
  std::memcpy(dst, host_src, bytes);
}

void CpuBackend::copy_to_host(void* host_dst, const void* src, size_t bytes) { std::memcpy(host_dst, src, bytes); }

void CpuBackend::copy(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }

// ---- embedding ----

void CpuBackend::embedding_forward(float* out, const int32_t* tokens, const float* wte, int v_begin, int Vl,
                                   const float* wpe, int B, int T, int C) {
#pragma omp parallel for schedule(static)
  for (int bt = 0; bt < B * T; ++bt) {
    const int row = tokens[bt] - v_begin;
    float* o = out + static_cast<size_t>(bt) * C;
    if (row >= 0 && row < Vl) {
      std::copy_n(wte + static_cast<size_t>(row) * C, C, o);
    } else {
      std::fill_n(o, C, 0.0f);
    }
    if (wpe == nullptr) continue;
    const float* p = wpe + static_cast<size_t>(bt % T) * C;
#pragma omp simd
    for (int c = 0; c < C; ++c) o[c] += p[c];
  }
}

void CpuBackend::embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int v_begin,
                                    int Vl, int B, int T, int C) {
  if (dwpe != nullptr) {
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; ++t) {
      float* dst = dwpe + static_cast<size_t>(t) * C;
      for (int b = 0; b < B; ++b) {
        const float* src = dout + (static_cast<size_t>(b) * T + t) * C;
#pragma omp simd
        for (int c = 0; c < C; ++c) dst[c] += src[c];
      }
    }
  }
  if (dwte != nullptr) {
    // A token can repeat anywhere in the batch, so threads split channels
    // rather than positions and each walks the positions in order.
    const int blocks = (C + kChannelBlock - 1) / kChannelBlock;
#pragma omp parallel for schedule(static)
    for (int blk = 0; blk < blocks; ++blk) {
      const int c0 = blk * kChannelBlock;
      const int width = std::min(kChannelBlock, C - c0);
      for (int bt = 0; bt < B * T; ++bt) {
        const int row = tokens[bt] - v_begin;
        if (row < 0 || row >= Vl) continue;
        float* dst = dwte + static_cast<size_t>(row) * C + c0;
        const float* src = dout + static_cast<size_t>(bt) * C + c0;
#pragma omp simd
        for (int c = 0; c < width; ++c) dst[c] += src[c];
      }
    }
  }
}

// ---- row norms ----

namespace {

template <typename Out>
void norm_row(Out* o, float* mean, float* rstd, const float* x, const float* weight, const float* bias, int C,
              RowNorm norm) {
  const float mu = norm.centred() ? row_sum(x, C) / static_cast<float>(C) : 0.0f;
  // LayerNorm's two passes: the variance from centred values does not cancel.
  const float var = fixed_order_sum<float>(C, [x, mu](size_t i) {
                      const float dx = x[i] - mu;
                      return dx * dx;
                    }) /
                    static_cast<float>(C);
  const float rs = 1.0f / std::sqrt(var + norm.eps);
  if (bias != nullptr) {
#pragma omp simd
    for (int c = 0; c < C; ++c) put(o + c, (x[c] - mu) * rs * weight[c] + bias[c]);
  } else {
#pragma omp simd
    for (int c = 0; c < C; ++c) put(o + c, (x[c] - mu) * rs * weight[c]);
  }
  *mean = mu;
  *rstd = rs;
}

}  // namespace

void CpuBackend::norm_forward(Buffer out, float* mean, float* rstd, const float* inp, const float* weight,
                              const float* bias, int N, int C, RowNorm norm) {
  with_type<bf16>(out, [&](auto* o) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) {
      const size_t row = static_cast<size_t>(n) * C;
      norm_row(o + row, mean + n, rstd + n, inp + row, weight, bias, C, norm);
    }
  });
}

void CpuBackend::add_norm_forward(float* sum, const float* addend, Buffer out, float* mean, float* rstd,
                                  const float* weight, const float* bias, int N, int C, RowNorm norm) {
  with_type<bf16>(out, [&](auto* o) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) {
      const size_t row = static_cast<size_t>(n) * C;
      float* x = sum + row;
      const float* a = addend + row;
#pragma omp simd
      for (int c = 0; c < C; ++c) x[c] += a[c];
      norm_row(o + row, mean + n, rstd + n, x, weight, bias, C, norm);
    }
  });
}

void CpuBackend::norm_backward(float* dinp, bf16* dinp_bf16, float* dweight, float* dbias, const float* dout,
                               const float* inp, const float* weight, const float* mean, const float* rstd, int N,
                               int C, RowNorm norm) {
  // dweight/dbias: each fixed chunk of rows sums into its own partial, the
  // partials are then summed in chunk order.
  const int chunks = (N + kNormRowChunk - 1) / kNormRowChunk;
  const bool want_params = dweight != nullptr || dbias != nullptr;
  std::vector<float> partial_w(want_params ? static_cast<size_t>(chunks) * C : 0);
  std::vector<float> partial_b(want_params ? static_cast<size_t>(chunks) * C : 0);
#pragma omp parallel for schedule(static)
  for (int chunk = 0; chunk < chunks; ++chunk) {
    float* pw = want_params ? partial_w.data() + static_cast<size_t>(chunk) * C : nullptr;
    float* pb = want_params ? partial_b.data() + static_cast<size_t>(chunk) * C : nullptr;
    const int n_end = std::min(N, (chunk + 1) * kNormRowChunk);
    for (int n = chunk * kNormRowChunk; n < n_end; ++n) {
      const float* x = inp + static_cast<size_t>(n) * C;
      const float* dy = dout + static_cast<size_t>(n) * C;
      const float mu = mean[n];
      const float rs = rstd[n];
      if (want_params) {
#pragma omp simd
        for (int c = 0; c < C; ++c) {
          pw[c] += dy[c] * ((x[c] - mu) * rs);
          pb[c] += dy[c];
        }
      }
      if (dinp != nullptr) {
        // RMSNorm centres nothing, so its gradient has no mean(dy * w) term.
        const auto dy_w = [dy, weight](size_t i) { return dy[i] * weight[i]; };
        const float dnorm_mean = norm.centred() ? fixed_order_sum<float>(C, dy_w) / static_cast<float>(C) : 0.0f;
        const float dnorm_norm_mean = fixed_order_sum<float>(C, [dy, weight, x, mu, rs](size_t i) {
                                        return dy[i] * weight[i] * ((x[i] - mu) * rs);
                                      }) /
                                      static_cast<float>(C);
        float* dx = dinp + static_cast<size_t>(n) * C;
#pragma omp simd
        for (int c = 0; c < C; ++c) {
          const float normed = (x[c] - mu) * rs;
          dx[c] += rs * (dy[c] * weight[c] - dnorm_mean - normed * dnorm_norm_mean);
        }
        if (dinp_bf16 != nullptr) {
          bf16* rounded = dinp_bf16 + static_cast<size_t>(n) * C;
          for (int c = 0; c < C; ++c) rounded[c] = to_bf16(dx[c]);
        }
      }
    }
  }
  if (!want_params) return;
#pragma omp parallel for schedule(static) if (static_cast<size_t>(chunks) * C > kParallelMin)
  for (int c = 0; c < C; ++c) {
    double sw = 0.0;
    double sb = 0.0;
    for (int chunk = 0; chunk < chunks; ++chunk) {
      sw += partial_w[static_cast<size_t>(chunk) * C + c];
      sb += partial_b[static_cast<size_t>(chunk) * C + c];
    }
    if (dweight != nullptr) dweight[c] += static_cast<float>(sw);
    if (dbias != nullptr) dbias[c] += static_cast<float>(sb);
  }
}

size_t CpuBackend::scratch_bytes() const {
  return (rounded_.capacity() + gelu_input_grad_.capacity() + linear_out_.capacity()) * sizeof(float) +
         queued_sums_.capacity() * sizeof(double);
}

// ---- matmul ----

namespace {

// A float32 result kept as bf16 (linear_out_ rounded into its buffer),
// and a bf16 array widened (exactly) where float32 code reads it.
void round_into(bf16* to, const float* from, size_t n) {
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (size_t i = 0; i < n; ++i) to[i] = to_bf16(from[i]);
}
void widen_into(float* to, const bf16* from, size_t n) {
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (size_t i = 0; i < n; ++i) to[i] = to_float(from[i]);
}

}  // namespace

void CpuBackend::round_to_bf16(bf16* out, const float* in, size_t n) { round_into(out, in, n); }

std::vector<const float*> CpuBackend::gemm_operands(std::initializer_list<std::pair<ConstBuffer, size_t>> operands) {
  size_t total = 0;
  for (const auto& [buffer, count] : operands) {
    if (buffer.dtype == DType::kBF16 && gemm_inputs_ != DType::kBF16) {
      throw common::Error(common::ErrorCode::kInternal, "a bf16 GEMM operand on a backend with float32 GEMM inputs");
    }
    if (buffer.data != nullptr && gemm_inputs_ == DType::kBF16) total += count;
  }
  if (rounded_.size() < total) rounded_.resize(total);
  float* slot = rounded_.data();
  std::vector<const float*> out;
  for (const auto& [buffer, count] : operands) {
    if (buffer.data == nullptr || gemm_inputs_ == DType::kF32) {
      out.push_back(buffer.f32());
      continue;
    }
    if (buffer.dtype == DType::kBF16) {
      widen_into(slot, static_cast<const bf16*>(buffer.data), count);
    } else {
      const float* from = buffer.f32();
#pragma omp parallel for schedule(static) if (count > kParallelMin)
      for (size_t i = 0; i < count; ++i) slot[i] = bf16_rounded(from[i]);
    }
    out.push_back(slot);
    slot += count;
  }
  return out;
}

void CpuBackend::matmul_forward(Buffer out, ConstBuffer inp, ConstBuffer weight, ConstBuffer bias, int N, int C,
                                int OC) {
  if (bias.dtype == DType::kBF16 && out.dtype != DType::kBF16) {
    throw common::Error(common::ErrorCode::kInternal, "a bf16 bias beside a float32 linear output");
  }
  const size_t n = static_cast<size_t>(N) * OC;
  float* linear = static_cast<float*>(out.data);
  if (out.dtype == DType::kBF16) {
    if (linear_out_.size() < n) linear_out_.resize(n);
    linear = linear_out_.data();
  }
  if (bias.data != nullptr) {
    const float* row = bias.f32();
    if (row == nullptr) {
      if (bias_widened_.size() < static_cast<size_t>(OC)) bias_widened_.resize(OC);
      widen_into(bias_widened_.data(), static_cast<const bf16*>(bias.data), static_cast<size_t>(OC));
      row = bias_widened_.data();
    }
#pragma omp parallel for schedule(static) if (n > kParallelMin)
    for (int r = 0; r < N; ++r) std::memcpy(linear + static_cast<size_t>(r) * OC, row, sizeof(float) * OC);
  }
  const auto ops = gemm_operands({{inp, static_cast<size_t>(N) * C}, {weight, static_cast<size_t>(OC) * C}});
  gemm(false, true, N, OC, C, 1.0f, ops[0], C, ops[1], C, bias.data != nullptr ? 1.0f : 0.0f, linear, OC);
  if (out.dtype == DType::kBF16) round_into(static_cast<bf16*>(out.data), linear, n);
}

void CpuBackend::matmul_backward_through_gelu(Buffer dpre, float* dweight, float* dbias, ConstBuffer dout,
                                              ConstBuffer inp, ConstBuffer weight, ConstBuffer pre, int N, int C,
                                              int OC) {
  const size_t n = static_cast<size_t>(N) * C;
  if (dpre.data == nullptr) {
    matmul_backward(nullptr, Into::kWrite, dweight, dbias, dout, inp, weight, N, C, OC);
    return;
  }
  if (gelu_input_grad_.size() < n) gelu_input_grad_.resize(n);
  float* dgelu = gelu_input_grad_.data();
  matmul_backward(dgelu, Into::kWrite, dweight, dbias, dout, inp, weight, N, C, OC);
  float* wide = static_cast<float*>(dpre.data);
  if (dpre.dtype == DType::kBF16) {
    if (linear_out_.size() < n) linear_out_.resize(n);
    wide = linear_out_.data();
  }
  zero(wide, n * sizeof(float));
  gelu_backward(wide, pre, dgelu, n);
  if (dpre.dtype == DType::kBF16) round_into(static_cast<bf16*>(dpre.data), wide, n);
}

void CpuBackend::matmul_backward(float* dinp, Into dinp_into, float* dweight, float* dbias, ConstBuffer dout,
                                 ConstBuffer inp, ConstBuffer weight, int N, int C, int OC) {
  const auto ops = gemm_operands({{dout, static_cast<size_t>(N) * OC},
                                  {dinp != nullptr ? weight : nullptr, static_cast<size_t>(OC) * C},
                                  {dweight != nullptr ? inp : nullptr, static_cast<size_t>(N) * C}});
  if (dinp != nullptr) {
    gemm(false, false, N, C, OC, 1.0f, ops[0], OC, ops[1], C, dinp_into == Into::kAdd ? 1.0f : 0.0f, dinp, C);
  }
  if (dweight != nullptr) gemm(true, false, OC, C, N, 1.0f, ops[0], OC, ops[2], C, 1.0f, dweight, C);
  if (dbias != nullptr) with_type<bf16>(dout, [&](const auto* d) { column_sum_accumulate(dbias, d, N, OC); });
}

// ---- attention ----

namespace {

// The keys query row t of `in` sees: rows [0, visible_keys(in, t)).
int visible_keys(const Backend::AttentionInputs& in, int t) {
  return std::clamp(in.q_offset + t - in.k_offset + 1, 0, in.Tk);
}

// The float32 views attention computes on. With bf16 GEMM inputs it
// multiplies what the GPU's tensor cores do (attention_tc.cu): q, k and v
// rounded to bf16 (bf16 ones widened as they are), here as compact copies
// (rows of C), and `views` pointing at them; the probabilities, score
// gradients and dout are rounded where the products take them. With
// float32 GEMM inputs, the caller's float32 views as they are.
struct FloatViews {
  std::vector<float> q, k, v;
  Backend::AttentionInputs views;
};
FloatViews float_views(const Backend::AttentionInputs& in, bool bf16_inputs) {
  if (!bf16_inputs) {
    if (in.dtype != DType::kF32) {
      throw common::Error(common::ErrorCode::kInternal, "bf16 attention inputs on a backend with float32 GEMM inputs");
    }
    return {{}, {}, {}, in};
  }
  FloatViews r{{}, {}, {}, in};
  auto round_rows = [&](std::vector<float>& to, const void* from, int rows, int ld, int width) {
    to.resize(static_cast<size_t>(rows) * width);
    with_type<bf16>(ConstBuffer(from, in.dtype), [&](const auto* x) {
#pragma omp parallel for schedule(static) if (to.size() > kParallelMin)
      for (int row = 0; row < rows; ++row) {
        for (int c = 0; c < width; ++c) {
          to[static_cast<size_t>(row) * width + c] = bf16_rounded(widen(x[static_cast<size_t>(row) * ld + c]));
        }
      }
    });
  };
  round_rows(r.q, in.q, in.B * in.Tq, in.ld_q, in.C);
  round_rows(r.k, in.k, in.B * in.Tk, in.ld_kv, in.kv_width());
  round_rows(r.v, in.v, in.B * in.Tk, in.ld_kv, in.kv_width());
  r.views.q = r.q.data();
  r.views.k = r.k.data();
  r.views.v = r.v.data();
  r.views.ld_q = in.C;
  r.views.ld_kv = in.kv_width();
  r.views.dtype = DType::kF32;
  return r;
}

void round_rows_to_bf16(float* rows, int count, int width, int ld) {
  for (int r = 0; r < count; ++r) {
    for (int j = 0; j < width; ++j) rows[static_cast<size_t>(r) * ld + j] = bf16_rounded(rows[static_cast<size_t>(r) * ld + j]);
  }
}

}  // namespace

void CpuBackend::attention_forward(Buffer out_buffer, float* lse, const AttentionInputs& views) {
  const bool bf16 = gemm_inputs_ == DType::kBF16;
  const FloatViews floats = float_views(views, bf16);
  const AttentionInputs& in = floats.views;
  const int B = in.B, Tq = in.Tq, Tk = in.Tk, C = in.C, NH = in.NH, d = C / NH, group = NH / in.kv_heads();
  // A bf16 out: the float32 output here first, rounded into it at the end.
  const size_t out_n = static_cast<size_t>(B) * Tq * C;
  std::vector<float> wide(out_buffer.dtype == DType::kBF16 ? out_n : 0);
  float* out = out_buffer.dtype == DType::kBF16 ? wide.data() : static_cast<float*>(out_buffer.data);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  const int blocks = (Tq + kQueryBlock - 1) / kQueryBlock;
  // Every (batch, head, query block) is independent, so dynamic scheduling
  // balances the uneven triangle without touching the results. A block's
  // probabilities live in a buffer of its thread, never in the output; its
  // scores stop at the last key its last query sees.
#pragma omp parallel
  {
    std::vector<float> probs(static_cast<size_t>(kQueryBlock) * Tk);
#pragma omp for schedule(dynamic)
    for (int unit = 0; unit < B * NH * blocks; ++unit) {
      const int bh = unit / blocks;
      const int b = bh / NH;
      const int h = bh % NH;
      const int r0 = unit % blocks * kQueryBlock;
      const int r1 = std::min(Tq, r0 + kQueryBlock);
      const int keys = visible_keys(in, r1 - 1);
      const float* q = static_cast<const float*>(in.q) + static_cast<size_t>(b) * Tq * in.ld_q + h * d;
      const float* k = static_cast<const float*>(in.k) + static_cast<size_t>(b) * Tk * in.ld_kv + h / group * d;
      const float* v = static_cast<const float*>(in.v) + static_cast<size_t>(b) * Tk * in.ld_kv + h / group * d;
      float* o = out + (static_cast<size_t>(b) * Tq + r0) * C + h * d;
      float* a = probs.data();
      if (keys == 0) {
        for (int t = r0; t < r1; ++t) {
          std::fill(o + static_cast<size_t>(t - r0) * C, o + static_cast<size_t>(t - r0) * C + d, 0.0f);
          lse[static_cast<size_t>(bh) * Tq + t] = -INFINITY;
        }
        continue;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r1 - r0, keys, d, scale,
                  q + static_cast<size_t>(r0) * in.ld_q, in.ld_q, k, in.ld_kv, 0.0f, a, Tk);
      for (int t = r0; t < r1; ++t) {
        lse[static_cast<size_t>(bh) * Tq + t] =
            causal_softmax_row(a + static_cast<size_t>(t - r0) * Tk, visible_keys(in, t), keys);
      }
      if (bf16) round_rows_to_bf16(a, r1 - r0, keys, Tk);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r1 - r0, d, keys, 1.0f, a, Tk, v, in.ld_kv, 0.0f, o, C);
    }
  }
  if (out_buffer.dtype == DType::kBF16) round_into(static_cast<trainer::bf16*>(out_buffer.data), wide.data(), out_n);
}

void CpuBackend::attention_backward(const AttentionGrads& grads, const float* dout, ConstBuffer out_buffer,
                                    const float* lse, const AttentionInputs& views) {
  const bool bf16 = gemm_inputs_ == DType::kBF16;
  const FloatViews floats = float_views(views, bf16);
  const AttentionInputs& in = floats.views;
  // A bf16 out widened (exactly) for D_t.
  std::vector<float> wide;
  if (out_buffer.dtype == DType::kBF16) {
    wide.resize(static_cast<size_t>(in.B) * in.Tq * in.C);
    widen_into(wide.data(), static_cast<const trainer::bf16*>(out_buffer.data), wide.size());
  }
  const float* out = out_buffer.dtype == DType::kBF16 ? wide.data() : out_buffer.f32();
  const int B = in.B, Tq = in.Tq, Tk = in.Tk, C = in.C, NH = in.NH, d = C / NH, KVH = in.kv_heads();
  const int group = NH / KVH, kv_width = in.kv_width();
  // dout rounded as a GEMM operand; D_t = dO_t . O_t takes it unrounded.
  std::vector<float> dout_rounded;
  if (bf16) {
    dout_rounded.assign(dout, dout + static_cast<size_t>(B) * Tq * C);
    round_rows_to_bf16(dout_rounded.data(), B * Tq, C, C);
  }
  const float* dout_operand = bf16 ? dout_rounded.data() : dout;
  // bf16 gradients: the float32 ones summed from zero in dense arrays
  // here, each rounded into them at the end (they are overwritten).
  const bool overwrite = grads.dtype == DType::kBF16;
  if (overwrite && !bf16) {
    throw common::Error(common::ErrorCode::kInternal, "bf16 attention gradients on a backend with float32 GEMM inputs");
  }
  std::vector<float> dq_wide, dk_wide, dv_wide;
  if (overwrite) {
    dq_wide.assign(static_cast<size_t>(B) * Tq * C, 0.0f);
    dk_wide.assign(static_cast<size_t>(B) * Tk * kv_width, 0.0f);
    dv_wide.assign(static_cast<size_t>(B) * Tk * kv_width, 0.0f);
  }
  float* const dq_base = overwrite ? dq_wide.data() : static_cast<float*>(grads.dq);
  float* const dk_base = overwrite ? dk_wide.data() : static_cast<float*>(grads.dk);
  float* const dv_base = overwrite ? dv_wide.data() : static_cast<float*>(grads.dv);
  const int ld_dq = overwrite ? C : views.ld_q, ld_dkv = overwrite ? kv_width : views.ld_kv;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  const int blocks = (Tq + kQueryBlock - 1) / kQueryBlock;
  // One (batch, key/value head) per work item: dK and dV gather from every
  // query block of every query head of the group, so those run in order
  // (head by head, block by block) on one thread.
#pragma omp parallel
  {
    std::vector<float> probs(static_cast<size_t>(kQueryBlock) * Tk);
    std::vector<float> dscores(static_cast<size_t>(kQueryBlock) * Tk);
#pragma omp for schedule(dynamic)
    for (int bkv = 0; bkv < B * KVH; ++bkv) {
      const int b = bkv / KVH;
      const int kvh = bkv % KVH;
      const float* k = static_cast<const float*>(in.k) + static_cast<size_t>(b) * Tk * in.ld_kv + kvh * d;
      const float* v = static_cast<const float*>(in.v) + static_cast<size_t>(b) * Tk * in.ld_kv + kvh * d;
      float* dk = dk_base + static_cast<size_t>(b) * Tk * ld_dkv + kvh * d;
      float* dv = dv_base + static_cast<size_t>(b) * Tk * ld_dkv + kvh * d;
      for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
        const int bh = b * NH + h;
        const float* q = static_cast<const float*>(in.q) + static_cast<size_t>(b) * Tq * in.ld_q + h * d;
        float* dq = dq_base + static_cast<size_t>(b) * Tq * ld_dq + h * d;
        for (int blk = 0; blk < blocks; ++blk) {
          const int r0 = blk * kQueryBlock;
          const int r1 = std::min(Tq, r0 + kQueryBlock);
          const int rows = r1 - r0;
          const int keys = visible_keys(in, r1 - 1);
          if (keys == 0) continue;
          float* p = probs.data();
          float* ds = dscores.data();
          const size_t first_row = (static_cast<size_t>(b) * Tq + r0) * C + h * d;
          const float* dy = dout + first_row;
          const float* dy_operand = dout_operand + first_row;
          const float* o = out + first_row;
          // P again from the scores and the saved log-sum-exp.
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, keys, d, scale,
                      q + static_cast<size_t>(r0) * in.ld_q, in.ld_q, k, in.ld_kv, 0.0f, p, Tk);
          for (int t = r0; t < r1; ++t) {
            float* p_row = p + static_cast<size_t>(t - r0) * Tk;
            const float shift = lse[static_cast<size_t>(bh) * Tq + t];
            const int len = visible_keys(in, t);
  #pragma omp simd
            for (int j = 0; j < len; ++j) p_row[j] = exp_approx(p_row[j] - shift);
            std::fill(p_row + len, p_row + keys, 0.0f);
          }
          // dP = dO V^T.
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, keys, d, 1.0f, dy_operand, C, v, in.ld_kv, 0.0f,
                      ds, Tk);
          // dS = P * (dP - D) * scale with D = dO . O, zero past the visible keys.
          for (int t = r0; t < r1; ++t) {
            const float* p_row = p + static_cast<size_t>(t - r0) * Tk;
            float* ds_row = ds + static_cast<size_t>(t - r0) * Tk;
            const int len = visible_keys(in, t);
            const float row_d = row_dot(dy + static_cast<size_t>(t - r0) * C, o + static_cast<size_t>(t - r0) * C, d);
  #pragma omp simd
            for (int j = 0; j < len; ++j) ds_row[j] = p_row[j] * (ds_row[j] - row_d) * scale;
            std::fill(ds_row + len, ds_row + keys, 0.0f);
          }
          if (bf16) {
            round_rows_to_bf16(p, rows, keys, Tk);
            round_rows_to_bf16(ds, rows, keys, Tk);
          }
          // dV += P^T dO, dQ += dS K, dK += dS^T Q.
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, keys, d, rows, 1.0f, p, Tk, dy_operand, C, 1.0f, dv,
                      ld_dkv);
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, d, keys, 1.0f, ds, Tk, k, in.ld_kv, 1.0f,
                      dq + static_cast<size_t>(r0) * ld_dq, ld_dq);
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, keys, d, rows, 1.0f, ds, Tk,
                      q + static_cast<size_t>(r0) * in.ld_q, in.ld_q, 1.0f, dk, ld_dkv);
        }
      }
    }
  }
  if (overwrite) {
    // Into the caller's views, C of each of their rows.
    auto round_rows = [](void* to, int ld, const std::vector<float>& from, int width) {
      auto* dst = static_cast<trainer::bf16*>(to);
      const size_t rows = from.size() / static_cast<size_t>(width);
#pragma omp parallel for schedule(static) if (from.size() > kParallelMin)
      for (size_t r = 0; r < rows; ++r) {
        round_into(dst + r * static_cast<size_t>(ld), from.data() + r * width, static_cast<size_t>(width));
      }
    };
    round_rows(grads.dq, views.ld_q, dq_wide, C);
    round_rows(grads.dk, views.ld_kv, dk_wide, kv_width);
    round_rows(grads.dv, views.ld_kv, dv_wide, kv_width);
  }
}

void CpuBackend::attention_merge(float* out, float* lse, const float* part_out, const float* part_lse, int B, int T,
                                 int C, int NH) {
  const int d = C / NH;
#pragma omp parallel for schedule(static) if (static_cast<size_t>(B) * NH * T * d > kParallelMin)
  for (int row = 0; row < B * NH * T; ++row) {
    const int b = row / (NH * T), h = row / T % NH, t = row % T;
    const float a = lse[row], c = part_lse[row];
    if (c == -INFINITY) continue;  // the second set of keys adds nothing
    const float max = std::max(a, c);
    const float wa = a == -INFINITY ? 0.0f : std::exp(a - max), wc = std::exp(c - max);
    const float sum = wa + wc, mine = wa / sum, part = wc / sum;
    float* o = out + (static_cast<size_t>(b) * T + t) * C + h * d;
    const float* po = part_out + (static_cast<size_t>(b) * T + t) * C + h * d;
#pragma omp simd
    for (int j = 0; j < d; ++j) o[j] = mine * o[j] + part * po[j];
    lse[row] = max + std::log(sum);
  }
}

// ---- GELU (gelu.h: the formula CUDA shares) ----

namespace {

// exp_approx as a type, so that the formula inlines it into the simd loop.
struct ApproxExp {
  float operator()(float x) const { return exp_approx(x); }
};

}  // namespace

void CpuBackend::gelu_forward(Buffer out, ConstBuffer inp, size_t n) {
  with_type<bf16>(out, [&](auto* to) {
    with_type<bf16>(inp, [&](const auto* from) {
#pragma omp parallel for simd schedule(static) if (parallel : n > kParallelMin)
      for (size_t i = 0; i < n; ++i) put(to + i, gelu(widen(from[i]), ApproxExp{}));
    });
  });
}

void CpuBackend::gelu_backward(float* dinp, ConstBuffer inp, const float* dout, size_t n) {
  with_type<bf16>(inp, [&](const auto* x) {
#pragma omp parallel for simd schedule(static) if (parallel : n > kParallelMin)
    for (size_t i = 0; i < n; ++i) dinp[i] += gelu_grad(widen(x[i]), ApproxExp{}) * dout[i];
  });
}

// ---- SwiGLU (swiglu.h: the formula CUDA shares) ----

void CpuBackend::swiglu_forward(Buffer out, ConstBuffer inp, int N, int F) {
  with_type<bf16>(out, [&](auto* to) {
    with_type<bf16>(inp, [&](const auto* from) {
#pragma omp parallel for schedule(static) if (static_cast<size_t>(N) * F > kParallelMin)
      for (int n = 0; n < N; ++n) {
        const auto* gate = from + static_cast<size_t>(n) * 2 * F;
        auto* o = to + static_cast<size_t>(n) * F;
#pragma omp simd
        for (int j = 0; j < F; ++j) put(o + j, swiglu(widen(gate[j]), widen(gate[F + j]), ApproxExp{}));
      }
    });
  });
}

void CpuBackend::swiglu_backward(Buffer dinp, ConstBuffer inp, const float* dout, int N, int F) {
  with_type<bf16>(dinp, [&](auto* to) {
    with_type<bf16>(inp, [&](const auto* from) {
#pragma omp parallel for schedule(static) if (static_cast<size_t>(N) * F > kParallelMin)
      for (int n = 0; n < N; ++n) {
        const size_t row = static_cast<size_t>(n) * 2 * F;
        const float* dy = dout + static_cast<size_t>(n) * F;
        for (int j = 0; j < F; ++j) {
          float dgate = 0.0f, dup = 0.0f;
          swiglu_grad(widen(from[row + j]), widen(from[row + F + j]), dy[j], ApproxExp{}, &dgate, &dup);
          put(to + row + j, dgate);
          put(to + row + F + j, dup);
        }
      }
    });
  });
}

// ---- rotary positions (rotary.h: the formula CUDA shares) ----

namespace {

template <bool kBackward>
void rotate_rows(Buffer x, int ld, const float* cos, const float* sin, int B, int T, int position, int heads, int d) {
  const int half = d / 2;
  with_type<bf16>(x, [&](auto* rows) {
#pragma omp parallel for schedule(static) if (static_cast<size_t>(B) * T * heads * d > kParallelMin)
    for (int bt = 0; bt < B * T; ++bt) {
      const size_t angle = static_cast<size_t>(position + bt % T) * half;
      for (int h = 0; h < heads; ++h) {
        auto* head = rows + static_cast<size_t>(bt) * ld + static_cast<size_t>(h) * d;
        for (int j = 0; j < half; ++j) {
          float x1 = widen(head[j]), x2 = widen(head[j + half]);
          rotate_pair<kBackward>(x1, x2, cos[angle + j], sin[angle + j]);
          put(head + j, x1);
          put(head + j + half, x2);
        }
      }
    }
  });
}

}  // namespace

void CpuBackend::rotary_forward(Buffer x, int ld, const float* cos, const float* sin, int B, int T, int position,
                                int heads, int d) {
  rotate_rows<false>(x, ld, cos, sin, B, T, position, heads, d);
}

void CpuBackend::rotary_backward(Buffer x, int ld, const float* cos, const float* sin, int B, int T, int position,
                                 int heads, int d) {
  rotate_rows<true>(x, ld, cos, sin, B, T, position, heads, d);
}


// ---- residual ----

void CpuBackend::accumulate(float* dst, const float* src, size_t n) {
#pragma omp parallel for simd schedule(static) if (parallel : n > kParallelMin)
  for (size_t i = 0; i < n; ++i) dst[i] += src[i];
}

void CpuBackend::copy_columns(float* dst, int dst_ld, const float* src, int src_ld, int rows, int cols) {
  const size_t bytes = static_cast<size_t>(cols) * sizeof(float);
#pragma omp parallel for schedule(static) if (parallel : static_cast <size_t>(rows) * cols > kParallelMin)
  for (int r = 0; r < rows; ++r) {
    std::memcpy(dst + static_cast<size_t>(r) * dst_ld, src + static_cast<size_t>(r) * src_ld, bytes);
  }
}

void CpuBackend::accumulate_columns(float* dst, int dst_ld, const float* src, int src_ld, int rows, int cols) {
#pragma omp parallel for schedule(static) if (parallel : static_cast <size_t>(rows) * cols > kParallelMin)
  for (int r = 0; r < rows; ++r) {
    float* d = dst + static_cast<size_t>(r) * dst_ld;
    const float* s = src + static_cast<size_t>(r) * src_ld;
#pragma omp simd
    for (int c = 0; c < cols; ++c) d[c] += s[c];
  }
}

// ---- cross-entropy ----

void CpuBackend::crossentropy_stats(float* stats, ConstBuffer logits, const int32_t* targets, int N, int v_begin,
                                    int Vl, int V) {
  // The shard's real classes are its first `real` columns.
  const int real = std::clamp(V - v_begin, 0, Vl);
  with_type<bf16>(logits, [&](const auto* all) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(all)>>;
#pragma omp parallel
    {
      // A bf16 row widened once, then the float32 row's code.
      std::vector<float> e(static_cast<size_t>(real)), widened(std::is_same_v<T, bf16> ? real : 0);
#pragma omp for schedule(static)
      for (int n = 0; n < N; ++n) {
        const T* row = all + static_cast<size_t>(n) * Vl;
        const float* x = nullptr;
        if constexpr (std::is_same_v<T, bf16>) {
          for (int c = 0; c < real; ++c) widened[c] = widen(row[c]);
          x = widened.data();
        } else {
          x = row;
        }
        float* s = stats + static_cast<size_t>(n) * 3;
        const int target = targets[n] - v_begin;
        s[2] = target >= 0 && target < real ? x[target] : 0.0f;
        if (real == 0) {
          s[0] = -std::numeric_limits<float>::infinity();
          s[1] = 0.0f;
          continue;
        }
        const float max = row_max(x, real);
#pragma omp simd
        for (int c = 0; c < real; ++c) e[c] = exp_approx(x[c] - max);
        s[0] = max;
        s[1] = row_sum(e.data(), real);
      }
    }
  });
}

void CpuBackend::crossentropy_combine(float* losses, float* lse, const float* stats, int S, int N) {
  const size_t shard = static_cast<size_t>(N) * 3;
#pragma omp parallel for schedule(static) if (static_cast<size_t>(N) * S > kParallelMin)
  for (int n = 0; n < N; ++n) {
    float max = -std::numeric_limits<float>::infinity();
    for (int s = 0; s < S; ++s) max = std::max(max, stats[s * shard + static_cast<size_t>(n) * 3]);
    float sum = 0.0f, target = 0.0f;
    for (int s = 0; s < S; ++s) {
      const float* st = stats + s * shard + static_cast<size_t>(n) * 3;
      if (st[1] > 0.0f) sum += st[1] * std::exp(st[0] - max);
      target += st[2];
    }
    lse[n] = max + std::log(sum);
    losses[n] = lse[n] - target;
  }
}

void CpuBackend::crossentropy_backward(Buffer dlogits, ConstBuffer logits, const float* lse, const int32_t* targets,
                                       float dloss, int N, int v_begin, int Vl, int V) {
  const int real = std::clamp(V - v_begin, 0, Vl);
  with_type<bf16>(dlogits, [&](auto* dall) {
    with_type<bf16>(logits, [&](const auto* all) {
#pragma omp parallel for schedule(static)
      for (int n = 0; n < N; ++n) {
        const auto* x = all + static_cast<size_t>(n) * Vl;
        auto* d = dall + static_cast<size_t>(n) * Vl;
        const float shift = lse[n];
        const int target = targets[n] - v_begin;
#pragma omp simd
        for (int c = 0; c < real; ++c) {
          put(d + c, dloss * (exp_approx(widen(x[c]) - shift) - (c == target ? 1.0f : 0.0f)));
        }
        for (int c = real; c < Vl; ++c) put(d + c, 0.0f);
      }
    });
  });
}

void CpuBackend::crossentropy_and_gradient(Buffer dlogits, float* losses, float* lse, ConstBuffer logits,
                                           const int32_t* targets, float dloss, int N, int Vp, int V) {
  // The reference is the three kernels it stands for; the CPU gains
  // nothing from one pass.
  std::vector<float> stats(static_cast<size_t>(N) * 3);
  crossentropy_stats(stats.data(), logits, targets, N, 0, Vp, V);
  crossentropy_combine(losses, lse, stats.data(), 1, N);
  crossentropy_backward(dlogits, logits, lse, targets, dloss, N, 0, Vp, V);
}

// ---- router softmax ----

void CpuBackend::softmax_forward(float* probs, const float* logits, int N, int E) {
#pragma omp parallel for schedule(static) if (static_cast<size_t>(N) * E > kParallelMin)
  for (int n = 0; n < N; ++n) {
    const float* x = logits + static_cast<size_t>(n) * E;
    float* p = probs + static_cast<size_t>(n) * E;
    const float max = row_max(x, E);
#pragma omp simd
    for (int e = 0; e < E; ++e) p[e] = exp_approx(x[e] - max);
    const float inv = 1.0f / row_sum(p, E);
#pragma omp simd
    for (int e = 0; e < E; ++e) p[e] *= inv;
  }
}

void CpuBackend::softmax_backward(float* dlogits, const float* dprobs, const float* probs, int N, int E) {
#pragma omp parallel for schedule(static) if (static_cast<size_t>(N) * E > kParallelMin)
  for (int n = 0; n < N; ++n) {
    const float* p = probs + static_cast<size_t>(n) * E;
    const float* dp = dprobs + static_cast<size_t>(n) * E;
    float* dx = dlogits + static_cast<size_t>(n) * E;
    const float dot = row_dot(p, dp, E);
#pragma omp simd
    for (int e = 0; e < E; ++e) dx[e] += p[e] * (dp[e] - dot);
  }
}

// ---- row gather/scatter ----

void CpuBackend::gather_rows(float* out, const float* inp, const int32_t* rows, const float* weights, int M,
                             int C) {
#pragma omp parallel for schedule(static) if (static_cast<size_t>(M) * C > kParallelMin)
  for (int m = 0; m < M; ++m) {
    float* dst = out + static_cast<size_t>(m) * C;
    const float* src = inp + static_cast<size_t>(rows[m]) * C;
    if (weights == nullptr) {
      std::memcpy(dst, src, sizeof(float) * C);
    } else {
      const float w = weights[m];
#pragma omp simd
      for (int c = 0; c < C; ++c) dst[c] = w * src[c];
    }
  }
}

void CpuBackend::scatter_add_rows(float* out, const float* inp, const int32_t* rows, const float* weights, int M,
                                  int C) {
  // Destinations repeat, so threads split channels and each walks m in
  // increasing order, as the contract requires.
  const int blocks = (C + kChannelBlock - 1) / kChannelBlock;
#pragma omp parallel for schedule(static) if (static_cast<size_t>(M) * C > kParallelMin)
  for (int blk = 0; blk < blocks; ++blk) {
    const int c0 = blk * kChannelBlock;
    const int width = std::min(kChannelBlock, C - c0);
    for (int m = 0; m < M; ++m) {
      float* dst = out + static_cast<size_t>(rows[m]) * C + c0;
      const float* src = inp + static_cast<size_t>(m) * C + c0;
      if (weights == nullptr) {
#pragma omp simd
        for (int c = 0; c < width; ++c) dst[c] += src[c];
      } else {
        const float w = weights[m];
#pragma omp simd
        for (int c = 0; c < width; ++c) dst[c] += w * src[c];
      }
    }
  }
}

void CpuBackend::gathered_row_dot(float* out, const float* a, const int32_t* rows, const float* b, int M, int C) {
#pragma omp parallel for schedule(static) if (static_cast<size_t>(M) * C > kParallelMin)
  for (int m = 0; m < M; ++m) {
    out[m] = row_dot(a + static_cast<size_t>(rows[m]) * C, b + static_cast<size_t>(m) * C, C);
  }
}

// ---- optimizer ----

void CpuBackend::adamw_update(const std::vector<AdamwTensor>& tensors, float lr, float beta1, float beta2, float eps,
                              float grad_scale, int64_t t) {
  for (const AdamwTensor& x : tensors) {
    const AdamwStep step = AdamwStep::at(lr, beta1, beta2, eps, x.weight_decay, grad_scale, t);
    if (x.copy != nullptr) {
#pragma omp parallel for schedule(static) if (x.n > kParallelMin)
      for (size_t i = 0; i < x.n; ++i) x.copy[i] = to_bf16(step.apply(x.params, x.grads, x.m, x.v, i));
      continue;
    }
#pragma omp parallel for simd schedule(static) if (parallel : x.n > kParallelMin)
    for (size_t i = 0; i < x.n; ++i) step.apply(x.params, x.grads, x.m, x.v, i);
  }
}

double CpuBackend::sum_squares(const float* x, size_t n) {
  return chunked_sum(n, [x](size_t i) {
    const double xi = x[i];
    return xi * xi;
  });
}

void CpuBackend::queue_sum_squares(ConstBuffer x, size_t n) {
  with_type<bf16>(x, [&](const auto* from) {
    queued_sums_.push_back(chunked_sum(n, [from](size_t i) {
      const double xi = widen(from[i]);
      return xi * xi;
    }));
  });
}

void CpuBackend::queue_sums_of_squares(const std::vector<FloatSpan>& spans) {
  for (const FloatSpan& span : spans) queue_sum_squares(span.data, span.numel);
}

std::vector<double> CpuBackend::take_queued_sums() { return std::exchange(queued_sums_, {}); }

double CpuBackend::sum(const float* x, size_t n) {
  return chunked_sum(n, [x](size_t i) { return static_cast<double>(x[i]); });
}

void CpuBackend::queue_sum(const float* x, size_t n) { queued_sums_.push_back(sum(x, n)); }

}  // namespace keel::trainer
