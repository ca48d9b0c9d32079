// A host emulation of the surface the tensor-core kernels are written
// against (trainer/kernels/cuda/warp_mma.cuh and launch.cuh's warp
// helpers), so that a test includes a kernel header unchanged and runs it
// on the CPU: every CUDA thread of a block is a std::thread, a warp's
// collective operations (ldmatrix, mma.sync, shuffles) meet at a barrier
// of its 32 threads, and __syncthreads at one of the block's.
//
// ldmatrix and mma.sync follow the PTX ISA's fragment layouts (m8n8.x4
// b16 loads, m16n8k16 row.col bf16 -> f32): what the emulation proves is
// that a kernel's lane addressing and fragment bookkeeping are right, the
// part a GPU run would otherwise be the first to test. It also stops on
// what the hardware would fault on or silently misread: an ldmatrix row
// not 16-byte aligned, a float4 load or a cp.async not aligned to its
// size, shared memory outside the block's dynamic allocation, cp.async
// copies a thread never waited for. Shared memory starts as NaN bytes, so
// reading what no thread wrote shows in the results, and so does reading
// what a cp.async has not yet brought (see AsyncCopies). Sums
// inside one mma run in double, the hardware's order being unspecified.
//
// Include it before the kernel header, outside any namespace.
#pragma once

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define KEEL_UNROLL
#define __device__
#define __global__
#define __launch_bounds__(threads)
#define KEEL_DYNAMIC_SHARED_MEMORY(name) unsigned char* name = keel::emulator::shared_memory()

using std::max;
using std::min;

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local Dim3 threadIdx, blockIdx;
inline Dim3 gridDim, blockDim;

struct __nv_bfloat16 {
  uint16_t bits;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};

namespace keel::emulator {

// Round to nearest, ties to even, as __float2bfloat16_rn.
inline uint16_t to_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  uint32_t u = 0;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f = 0;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// What the threads of one warp exchange in a collective operation.
struct Warp {
  std::barrier<> meet{32};
  uint32_t address[32] = {};
  uint32_t a[32][4] = {}, b[32][2] = {};
  float c[32][4] = {};
  float value[32] = {};
};

inline void fail(const char* what) {
  // A thread of the emulated block cannot throw to the test: stop loudly.
  std::fprintf(stderr, "warp emulator: %s\n", what);
  std::abort();
}

// The cp.async copies a thread has in flight: each destination is
// poisoned (NaN bytes) when the copy is issued and written when a wait
// covers its group, so a kernel that reads a tile before waiting for it,
// or issues a copy over one another warp still reads, shows it in its
// results.
struct AsyncCopy {
  unsigned char* to;
  const void* from;
  size_t bytes;
};
struct AsyncCopies {
  std::vector<AsyncCopy> open;                   // issued since the last commit
  std::deque<std::vector<AsyncCopy>> committed;  // oldest first
};
inline AsyncCopies& async_copies() {
  thread_local AsyncCopies copies;
  return copies;
}

// The block being emulated.
struct Block {
  std::vector<unsigned char> shared;
  std::vector<std::unique_ptr<Warp>> warps;
  std::unique_ptr<std::barrier<>> all;
};
inline Block& block() {
  static Block b;
  return b;
}
inline unsigned char* shared_memory() { return block().shared.data(); }
inline int lane() { return static_cast<int>(threadIdx.x % 32); }
inline Warp& warp() { return *block().warps[threadIdx.x / 32]; }

// Runs body() as kernel<<<(grid_x, grid_y), threads, shared_bytes>>>: the
// blocks one after another, each with `threads` threads at once.
inline void launch(unsigned grid_x, unsigned grid_y, unsigned threads, size_t shared_bytes,
                   const std::function<void()>& body) {
  gridDim = {grid_x, grid_y, 1};
  blockDim = {threads, 1, 1};
  for (unsigned by = 0; by < grid_y; ++by) {
    for (unsigned bx = 0; bx < grid_x; ++bx) {
      Block& b = block();
      b.shared.assign(shared_bytes, 0xff);  // NaN bytes
      b.warps.clear();
      for (unsigned w = 0; w < (threads + 31) / 32; ++w) b.warps.push_back(std::make_unique<Warp>());
      b.all = std::make_unique<std::barrier<>>(threads);
      std::vector<std::thread> running;
      for (unsigned t = 0; t < threads; ++t) {
        running.emplace_back([&, t, bx, by] {
          threadIdx = {t, 0, 0};
          blockIdx = {bx, by, 0};
          body();
          const AsyncCopies& copies = async_copies();
          if (!copies.open.empty() || !copies.committed.empty()) fail("cp.async copies never waited for");
        });
      }
      for (std::thread& t : running) t.join();
    }
  }
}

}  // namespace keel::emulator

inline void __syncthreads() { keel::emulator::block().all->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int mask) {
  auto& w = keel::emulator::warp();
  const int l = keel::emulator::lane();
  w.value[l] = v;
  w.meet.arrive_and_wait();
  const float got = w.value[l ^ mask];
  w.meet.arrive_and_wait();
  return got;
}

inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return {{keel::emulator::to_bf16(lo)}, {keel::emulator::to_bf16(hi)}};
}

namespace keel::trainer::cuda {

constexpr int kThreads = 256;
constexpr int kWarp = 32;

inline int lane() { return emulator::lane(); }
// launch.cuh's stores and loads of an element as float32.
inline void store(float* to, float value) { *to = value; }
inline void store(__nv_bfloat16* to, float value) { to->bits = emulator::to_bf16(value); }
inline float load(const float* from) { return *from; }
inline float load(const __nv_bfloat16* from) { return emulator::from_bf16(from->bits); }
inline size_t global_warp() { return (blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x) / kWarp; }
template <typename T>
inline T warp_sum(T x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

inline uint32_t shared_address(const void* p) {
  const auto* byte = static_cast<const unsigned char*>(p);
  const auto& shared = emulator::block().shared;
  if (byte < shared.data() || byte >= shared.data() + shared.size()) emulator::fail("address outside shared memory");
  return static_cast<uint32_t>(byte - shared.data());
}

// ldmatrix.m8n8.x4(.trans): lane 8i + j gives row j of matrix i; lane
// 4r + w receives, of every matrix, row r's elements 2w and 2w + 1
// (transposed: rows 2w and 2w + 1 of column r), the first in the low half.
inline void emulated_ldmatrix(uint32_t (&r)[4], const __nv_bfloat16* row, bool transposed) {
  auto& w = emulator::warp();
  const int l = emulator::lane();
  const uint32_t address = shared_address(row);
  if (address % 16 != 0) emulator::fail("ldmatrix row address not 16-byte aligned");
  w.address[l] = address;
  w.meet.arrive_and_wait();
  const int r_of = l / 4, word = l % 4;
  for (int i = 0; i < 4; ++i) {
    uint16_t half[2];
    for (int h = 0; h < 2; ++h) {
      const int matrix_row = transposed ? 2 * word + h : r_of, column = transposed ? r_of : 2 * word + h;
      const uint32_t at = w.address[8 * i + matrix_row] + 2 * static_cast<uint32_t>(column);
      if (at + 2 > emulator::block().shared.size()) emulator::fail("ldmatrix reads past shared memory");
      std::memcpy(&half[h], emulator::shared_memory() + at, 2);
    }
    r[i] = half[0] | (static_cast<uint32_t>(half[1]) << 16);
  }
  w.meet.arrive_and_wait();
}
inline void load_matrices(uint32_t (&r)[4], const __nv_bfloat16* row) { emulated_ldmatrix(r, row, false); }
inline void load_matrices_transposed(uint32_t (&r)[4], const __nv_bfloat16* row) { emulated_ldmatrix(r, row, true); }

// mma.m16n8k16.row.col.f32.bf16.bf16.f32, from the fragments of all 32
// lanes: A (lane 4g + t) holds {g, 2t}, {g + 8, 2t}, {g, 2t + 8},
// {g + 8, 2t + 8} (pairs along the row); B holds rows 2t and 2t + 8 (pairs
// down) of column g; C and D rows g and g + 8, columns 2t and 2t + 1.
inline void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  auto& w = emulator::warp();
  const int l = emulator::lane();
  for (int i = 0; i < 4; ++i) {
    w.a[l][i] = a[i];
    w.c[l][i] = c[i];
  }
  w.b[l][0] = b0;
  w.b[l][1] = b1;
  w.meet.arrive_and_wait();
  auto half = [](uint32_t reg, int h) { return emulator::from_bf16(static_cast<uint16_t>(h != 0 ? reg >> 16 : reg)); };
  float A[16][16], B[16][8];
  for (int from = 0; from < 32; ++from) {
    const int g = from / 4, t = from % 4;
    for (int i = 0; i < 8; ++i) {
      const int row = g + (i / 2 % 2) * 8, column = 2 * t + i % 2 + (i / 4) * 8;
      A[row][column] = half(w.a[from][i / 2], i % 2);
    }
    for (int i = 0; i < 4; ++i) B[2 * t + i % 2 + (i / 2) * 8][g] = half(w.b[from][i / 2], i % 2);
  }
  const int g = l / 4, t = l % 4;
  float d[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i / 2) * 8, column = 2 * t + i % 2;
    double sum = w.c[l][i];
    for (int k = 0; k < 16; ++k) sum += static_cast<double>(A[row][k]) * B[k][column];
    d[i] = static_cast<float>(sum);
  }
  w.meet.arrive_and_wait();
  for (int i = 0; i < 4; ++i) c[i] = d[i];
}

inline uint32_t bf16_pair(float lo, float hi) {
  return emulator::to_bf16(lo) | (static_cast<uint32_t>(emulator::to_bf16(hi)) << 16);
}

inline void emulated_copy_async(void* shared, const void* global, size_t bytes) {
  const uint32_t at = shared_address(shared);
  if (at % bytes != 0 || reinterpret_cast<uintptr_t>(global) % bytes != 0) {
    emulator::fail("cp.async address not aligned to its size");
  }
  if (at + bytes > emulator::block().shared.size()) emulator::fail("cp.async writes past shared memory");
  auto* to = static_cast<unsigned char*>(shared);
  std::memset(to, 0xff, bytes);
  emulator::async_copies().open.push_back({to, global, bytes});
}
inline void copy_16_bytes_async(void* shared, const void* global) { emulated_copy_async(shared, global, 16); }
inline void copy_4_bytes_async(void* shared, const void* global) { emulated_copy_async(shared, global, 4); }
inline void commit_async_copies() {
  auto& copies = emulator::async_copies();
  copies.committed.push_back(std::move(copies.open));
  copies.open.clear();
}
template <int N>
inline void wait_async_copies() {
  auto& copies = emulator::async_copies();
  while (copies.committed.size() > static_cast<size_t>(N)) {
    for (const auto& c : copies.committed.front()) std::memcpy(c.to, c.from, c.bytes);
    copies.committed.pop_front();
  }
}

inline float4 load_float4(const float* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) emulator::fail("float4 load not 16-byte aligned");
  return {p[0], p[1], p[2], p[3]};
}

}  // namespace keel::trainer::cuda
