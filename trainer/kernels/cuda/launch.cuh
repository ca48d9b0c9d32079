// What the CUDA backend's kernel files share: error checks, grid sizing and
// fixed-order reductions. Internal to trainer/kernels/cuda.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "common/error.h"
#include "trainer/kernels/dtype.h"

namespace keel::trainer::cuda {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
// Resident blocks per SM that fill it at kThreads (2048 threads on Hopper).
constexpr int kBlocksPerSm = 8;

// Loads one thread keeps in flight in add_in_order.
constexpr int kLoadsInFlight = 16;

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw common::Error(common::ErrorCode::kInternal, std::string(what) + ": " + cudaGetErrorString(err));
  }
}

// Blocks of kThreads for a grid-stride loop over n items: enough to fill
// the device, no more.
inline unsigned grid_for(size_t n) {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  const size_t needed = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>(needed, static_cast<size_t>(sms) * kBlocksPerSm)));
}

// Blocks of kThreads that give each of `rows` rows one warp.
inline unsigned grid_for_warps(size_t rows) {
  constexpr size_t kWarpsPerBlock = kThreads / kWarp;
  return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

// Turns a failed launch into an Error (call right after <<<>>>).
inline void check_launch(const char* name) { check(cudaGetLastError(), name); }

// Launches kernel(args..., n), a grid-stride loop over n elements, and
// checks the launch; nothing for n = 0 (a zero-block grid is an error).
template <typename... KernelArgs, typename... Args>
void launch(const char* name, void (*kernel)(KernelArgs...), size_t n, cudaStream_t stream, Args... args) {
  if (n == 0) return;
  kernel<<<grid_for(n), kThreads, 0, stream>>>(args..., n);
  check_launch(name);
}

__device__ inline size_t first_index() { return blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; }
__device__ inline size_t grid_stride() { return static_cast<size_t>(gridDim.x) * blockDim.x; }
// The warp of this thread, counted over the grid, and the lane in it.
__device__ inline size_t global_warp() { return first_index() / kWarp; }
__device__ inline int lane() { return static_cast<int>(threadIdx.x % kWarp); }

// Butterfly sum and max over a warp. The tree is the same on every run, so
// the result depends on the 32 inputs only; every lane gets it.
template <typename T> __device__ inline T warp_sum(T x) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}
__device__ inline float warp_max(float x) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Sum and max over a block of kThreads (all threads must call; every thread
// gets the result). Fixed tree: warps first, then the warps' results.
template <typename T> __device__ inline T block_sum(T x) {
  __shared__ T warps[kThreads / kWarp];
  x = warp_sum(x);
  __syncthreads();  // `warps` may still be read by a previous call
  if (lane() == 0) warps[threadIdx.x / kWarp] = x;
  __syncthreads();
  T total = lane() < kThreads / kWarp ? warps[lane()] : T(0);
  return warp_sum(total);
}
// A float32 result stored as an output buffer holds it: as it is, or
// rounded to bf16 (nearest, ties to even, as dtype.h's to_bf16).
__device__ inline void store(float* to, float value) { *to = value; }
__device__ inline void store(__nv_bfloat16* to, float value) { *to = __float2bfloat16_rn(value); }
// An input buffer's element as float32 (a bf16 one widened, exactly).
__device__ inline float load(const float* from) { return *from; }
__device__ inline float load(const __nv_bfloat16* from) { return __bfloat162float(*from); }
__device__ inline double load(const double* from) { return *from; }

// ---- elementwise maps ----
// A memory-bound elementwise kernel moves 16 bytes per load and store: a
// thread takes kVector elements at once (one uint4 of bf16, two float4 of
// float32). Scalar 2- and 4-byte accesses left the H200 at under half its
// bandwidth: GELU's forward took 56 us a call on [8192, 3072] bf16, 100 MB
// moved (084b7bf's profile).
constexpr int kVector = 8;

__device__ inline void load_vector(const float* from, float (&to)[kVector]) {
  const float4 a = reinterpret_cast<const float4*>(from)[0], b = reinterpret_cast<const float4*>(from)[1];
  to[0] = a.x, to[1] = a.y, to[2] = a.z, to[3] = a.w, to[4] = b.x, to[5] = b.y, to[6] = b.z, to[7] = b.w;
}
__device__ inline void load_vector(const __nv_bfloat16* from, float (&to)[kVector]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(from);
  const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int k = 0; k < kVector / 2; ++k) {
    const float2 f = __bfloat1622float2(pairs[k]);
    to[2 * k] = f.x, to[2 * k + 1] = f.y;
  }
}
__device__ inline void store_vector(float* to, const float (&from)[kVector]) {
  reinterpret_cast<float4*>(to)[0] = make_float4(from[0], from[1], from[2], from[3]);
  reinterpret_cast<float4*>(to)[1] = make_float4(from[4], from[5], from[6], from[7]);
}
// Each value rounded to nearest, ties to even: store()'s bits.
__device__ inline void store_vector(__nv_bfloat16* to, const float (&from)[kVector]) {
  uint4 raw;
  auto* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int k = 0; k < kVector / 2; ++k) pairs[k] = __floats2bfloat162_rn(from[2 * k], from[2 * k + 1]);
  *reinterpret_cast<uint4*>(to) = raw;
}

template <typename F, typename... In, size_t... I>
__device__ inline float apply_at(const F& f, const float (&args)[sizeof...(In)][kVector], int k,
                                 std::index_sequence<I...>) {
  return f(args[I][k]...);
}

// out[i] = f(in[i]...) for i < n, each input widened to float32 and the
// result stored as out's type: the scalar loop's values to the bit, whatever
// the grid. `vectors` is n / kVector when every pointer is 16-byte aligned
// (map() checks), 0 otherwise; the elements past them go one at a time.
// out may be one of the inputs: each element is read, then written, by one
// thread.
template <typename F, typename Out, typename... In>
__global__ void map_kernel(F f, size_t vectors, size_t n, Out* out, const In*... in) {
  for (size_t v = first_index(); v < vectors; v += grid_stride()) {
    const size_t i = v * kVector;
    float args[sizeof...(In)][kVector];
    int a = 0;
    (load_vector(in + i, args[a++]), ...);
    float result[kVector];
#pragma unroll
    for (int k = 0; k < kVector; ++k) result[k] = apply_at<F, In...>(f, args, k, std::index_sequence_for<In...>{});
    store_vector(out + i, result);
  }
  for (size_t i = vectors * kVector + first_index(); i < n; i += grid_stride()) store(out + i, f(load(in + i)...));
}

inline bool aligned_16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Launches map_kernel over n elements; nothing for n = 0.
template <typename F, typename Out, typename... In>
void map(const char* name, cudaStream_t stream, F f, size_t n, Out* out, const In*... in) {
  if (n == 0) return;
  const bool vectorised = aligned_16(out) && (aligned_16(in) && ...);
  const size_t vectors = vectorised ? n / kVector : 0;
  map_kernel<<<grid_for(std::max<size_t>(vectors, n - vectors * kVector)), kThreads, 0, stream>>>(f, vectors, n, out,
                                                                                                 in...);
  check_launch(name);
}

// acc plus x[0], x[stride], ..., x[(count - 1) * stride], each as a double
// (a bf16 one widened)
// (squared when `squares`), added one after another in that order: the
// one-load-at-a-time loop's sum to the bit, with kLoadsInFlight loads
// issued, unconditionally, before the first of their adds. One at a time,
// a thread waits out a memory latency per element: the H200 profile of
// c6a9a61 had the norm's chunk sums alone at 7.4 ms of a 45 ms step. (A
// version that guarded each load with `< count` profiled slower still on
// the column sums: the guards kept the loads apart.)
template <typename T>
__device__ inline double add_in_order(double acc, const T* x, size_t count, size_t stride, bool squares = false) {
  size_t i = 0;
  for (; i + kLoadsInFlight <= count; i += kLoadsInFlight) {
    T v[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) v[u] = x[(i + u) * stride];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const double xu = load(v + u);
      acc += squares ? xu * xu : xu;
    }
  }
  for (; i < count; ++i) {
    const double xi = load(x + i * stride);
    acc += squares ? xi * xi : xi;
  }
  return acc;
}

// The blocks of one launch split among up to kMax spans, span s taking
// blocks [first_block[s], first_block[s + 1]), one chunk of it each: part
// of a kernel's parameters (the batched sums of squares, AdamW). The host
// adds spans in order; a block finds its own.
template <int kMax>
struct BlockSplit {
  unsigned first_block[kMax + 1] = {};
  int count = 0;

  bool full() const { return count == kMax; }
  // Appends a span of `blocks` blocks (0 for an empty one).
  void add(size_t blocks) {
    first_block[count + 1] = first_block[count] + static_cast<unsigned>(blocks);
    ++count;
  }
  unsigned blocks() const { return first_block[count]; }
  // This block's span, the last s in [0, count) with first_block[s] <=
  // blockIdx.x (an empty span owns none), and its chunk within it.
  __device__ int span() const {
    int lo = 0, hi = count;
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      (first_block[mid] <= blockIdx.x ? lo : hi) = mid;
    }
    return lo;
  }
  __device__ size_t chunk(int s) const { return blockIdx.x - first_block[s]; }
};

__device__ inline float block_max(float x) {
  __shared__ float warps[kThreads / kWarp];
  x = warp_max(x);
  __syncthreads();
  if (lane() == 0) warps[threadIdx.x / kWarp] = x;
  __syncthreads();
  const float m = lane() < kThreads / kWarp ? warps[lane()] : -INFINITY;
  return warp_max(m);
}

// dst[c] += sum over r of src[r * cols + c], in double, r in order
// (cuda_backend.cu). The last sums of matmul's dbias (over its chunks'
// double sums) and of layernorm's per-chunk partials.
void column_sum_accumulate(float* dst, const float* src, int rows, int cols, cudaStream_t stream);
void column_sum_accumulate(float* dst, const double* src, int rows, int cols, cudaStream_t stream);

}  // namespace keel::trainer::cuda
