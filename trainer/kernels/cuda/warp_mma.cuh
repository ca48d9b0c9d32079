// Warp-level tensor-core primitives of sm_80 and later (ldmatrix, mma.sync
// m16n8k16 with bf16 inputs and float32 accumulators) and the shared-memory
// and vector-load facilities the tensor-core kernels use, so that those
// kernels (attention_tc_kernels.cuh) are written against this surface
// alone, with launch.cuh's lane(), warp_sum() and global_warp().
// tests/trainer/warp_emulator.h implements the same surface on the host
// from the PTX ISA's fragment layouts: that is how CI runs the kernels,
// unchanged, against the CPU backend without a GPU.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

// Unrolls the loop that follows (nvcc's #pragma unroll; nothing in the
// host emulation).
#define KEEL_UNROLL _Pragma("unroll")
// The block's dynamic shared memory, as `name` (16-byte aligned).
#define KEEL_DYNAMIC_SHARED_MEMORY(name) extern __shared__ __align__(16) unsigned char name[]

namespace keel::trainer::cuda {

__device__ inline uint32_t shared_address(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// Four 8x8 bf16 matrices from shared memory; lane l gives the address of
// row l % 8 of matrix l / 8, and receives row l / 4, columns 2(l % 4) and
// 2(l % 4) + 1 of each (transposed: column l / 4, rows 2(l % 4) and +1).
__device__ inline void load_matrices(uint32_t (&r)[4], const __nv_bfloat16* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row))
               : "memory");
}
__device__ inline void load_matrices_transposed(uint32_t (&r)[4], const __nv_bfloat16* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row))
               : "memory");
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

// Asynchronous copies from global into shared memory (cp.async, sm_80
// and later): a tile of the next step is on its way while the warps
// multiply the current one. Copies are grouped by commit_async_copies;
// wait_async_copies<N>() returns once no more than the N newest groups are
// in flight. Until its group has landed, neither a copy's source nor its
// destination may be touched. Both addresses 16-byte (copy_4_bytes_async:
// 4-byte) aligned.
__device__ inline void copy_16_bytes_async(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(shared)),
               "l"(__cvta_generic_to_global(global))
               : "memory");
}
__device__ inline void copy_4_bytes_async(void* shared, const void* global) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(shared_address(shared)),
               "l"(__cvta_generic_to_global(global))
               : "memory");
}
// Closes the group of the copies issued since the last commit (an empty
// group when none were).
__device__ inline void commit_async_copies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ inline void wait_async_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four floats from a 16-byte aligned address.
__device__ inline float4 load_float4(const float* p) { return *reinterpret_cast<const float4*>(p); }

}  // namespace keel::trainer::cuda
