// Causal attention on tensor cores (docs/architecture.md "GPU step"): the
// bf16 path of attention_forward and attention_backward, taken when the
// GEMMs multiply bf16 and the head dimension is 64 or 128. Flash attention
// in the FlashAttention-2 arrangement, on mma.sync m16n8k16 (bf16 inputs,
// float32 accumulators, which Hopper runs at full tensor-core rate):
// * a block of 4 warps takes a tile of 64 rows, each warp 16 of them, and
//   walks the other side's tiles of 64; tiles are read from the views into
//   shared memory as bf16 (float32 views rounded, bf16 ones copied by
//   cp.async, the next tile on its way while the warps multiply the
//   current one; rows 16 bytes longer than the head, so ldmatrix's eight
//   rows fall on different banks);
// * forward, per query tile: S = Q K^T, an online softmax in base 2 kept
//   per row (the 4 lanes of a quad hold a row's columns), P rounded to
//   bf16 straight from S's accumulators into the A operand of O += P V;
//   the log-sum-exp is written in natural log, as the interface says;
//   only tile pairs the causal diagonal or an edge cuts are masked;
// * backward: per row first D_t = dO_t . O_t, the log-sum-exp in base 2
//   and dO rounded to bf16 (scratch the backend lends); then per key tile dK and dV
//   over the query tiles that see it (S^T = K Q^T, dP^T = V dO^T, P^T and
//   dS^T, then dV += P^T dO and dK += dS^T Q), and per query tile dQ over
//   its key tiles (dQ += dS K). Every output row has one writer and every
//   sum runs in a fixed order: no atomics, the same bits run after run,
//   which the SDC rerun and bit-identical resume need. One writer is also
//   what lets a bf16 dqkv be written, rounded, instead of added to.
// The CPU reference rounds the same operands (cpu_backend.cpp, attention
// with bf16 GEMM inputs); the two differ by summation order and by where
// P is rounded (before normalisation here, after on the CPU). The kernels
// live in attention_tc_kernels.cuh over warp_mma.cuh's primitives, so that
// tests run them unchanged in a host emulation of those primitives
// (tests/trainer/warp_emulator.h).
#include "trainer/kernels/cuda/attention_tc.h"

#include "trainer/kernels/cuda/launch.cuh"
#include "trainer/kernels/cuda/warp_mma.cuh"
// After the two above: the kernels use what they declare.
#include "trainer/kernels/cuda/attention_tc_kernels.cuh"

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace keel::trainer::cuda {
namespace {

using namespace tc_attention;

// Above 48 KiB a kernel must ask for its dynamic shared memory; each
// launch site asks once (a function-local static), not at every launch.
template <class Kernel>
bool allow_shared_memory(Kernel kernel, size_t bytes) {
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
        "cudaFuncSetAttribute (attention's shared memory)");
  return true;
}

template <class Kernel, class... Args>
void launch_tiles(const char* name, Kernel kernel, int tiles, const Inputs& in, size_t shared_bytes,
                  cudaStream_t stream, Args... args) {
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(in.B * in.NH));
  kernel<<<grid, kTileThreads, shared_bytes, stream>>>(args...);
  check_launch(name);
}

float attention_scale(int d) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))); }

// Calls run(std::integral_constant<int, D>, T{}) for the views' head
// dimension and element type.
template <class Run>
void with_head_dim(const Inputs& in, Run&& run) {
  auto with_element = [&](auto dim) {
    if (in.dtype == DType::kBF16) {
      run(dim, __nv_bfloat16{});
    } else {
      run(dim, float{});
    }
  };
  if (in.C / in.NH == 64) {
    with_element(std::integral_constant<int, 64>{});
  } else {
    with_element(std::integral_constant<int, 128>{});
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool tensor_core_attention_fits(const Inputs& in) {
  const int d = in.NH > 0 && in.C % in.NH == 0 ? in.C / in.NH : 0;
  // Rows of whole 16-byte vectors: 4 floats or 8 bf16.
  const int vector = static_cast<int>(16 / dtype_bytes(in.dtype));
  // Grouped-query attention runs on the float32 kernels (attention.cu) for
  // now: these read a key/value head per query head.
  return (d == 64 || d == 128) && in.kv_heads() == in.NH && in.ld_q % vector == 0 && in.ld_kv % vector == 0 &&
         aligned16(in.q) && aligned16(in.k) && aligned16(in.v) && in.Tq > 0 && in.Tk > 0 &&
         static_cast<long>(in.B) * in.NH <= 65535;
}

size_t tensor_core_attention_scratch_bytes(const Inputs& in) {
  const size_t rows = static_cast<size_t>(in.B) * in.NH * in.Tq;
  return static_cast<size_t>(in.B) * in.Tq * in.C * sizeof(__nv_bfloat16) + 2 * rows * sizeof(float);
}

void tensor_core_attention_forward(cudaStream_t stream, Buffer out, float* lse, const Inputs& in) {
  with_head_dim(in, [&](auto dim, auto element) {
    with_type<__nv_bfloat16>(out, [&](auto* to) {
      constexpr int D = decltype(dim)::value;
      using T = decltype(element);
      using O = std::remove_pointer_t<decltype(to)>;
      static const bool allowed = allow_shared_memory(attention_forward_tc_kernel<D, T, O>, kForwardSharedBytes<D>);
      (void)allowed;
      launch_tiles("attention_forward (tensor cores)", attention_forward_tc_kernel<D, T, O>, tiles_of(in.Tq), in,
                   kForwardSharedBytes<D>, stream, to, lse, in, attention_scale(D) * kLog2e);
    });
  });
}

void tensor_core_attention_backward(cudaStream_t stream, const Backend::AttentionGrads& grads, const float* dout,
                                    ConstBuffer out, const float* lse, const Inputs& in, void* scratch) {
  const size_t rows = static_cast<size_t>(in.B) * in.NH * in.Tq;
  // dO's bf16 copy first: cudaMalloc's alignment is what its 16-byte copies need.
  RowStats stats;
  stats.dout = static_cast<__nv_bfloat16*>(scratch);
  stats.lse2 = reinterpret_cast<float*>(stats.dout + static_cast<size_t>(in.B) * in.Tq * in.C);
  stats.dots = stats.lse2 + rows;
  with_type<__nv_bfloat16>(out, [&](const auto* o) {
    attention_row_stats_kernel<<<grid_for_warps(rows), kThreads, 0, stream>>>(stats, dout, o, lse, in);
  });
  check_launch("attention_backward (row statistics)");
  with_head_dim(in, [&](auto dim, auto element) {
    with_type<__nv_bfloat16>(Buffer(grads.dq, grads.dtype), [&](auto* dq) {
      constexpr int D = decltype(dim)::value;
      using T = decltype(element);
      using G = std::remove_pointer_t<decltype(dq)>;
      static const bool allowed =
          allow_shared_memory(attention_backward_keys_tc_kernel<D, T, G>, kBackwardKeysSharedBytes<D>) &&
          allow_shared_memory(attention_backward_queries_tc_kernel<D, T, G>, kBackwardQueriesSharedBytes<D>);
      (void)allowed;
      launch_tiles("attention_backward (keys, tensor cores)", attention_backward_keys_tc_kernel<D, T, G>,
                   tiles_of(in.Tk), in, kBackwardKeysSharedBytes<D>, stream, static_cast<G*>(grads.dk),
                   static_cast<G*>(grads.dv), stats, in, attention_scale(D));
      launch_tiles("attention_backward (queries, tensor cores)", attention_backward_queries_tc_kernel<D, T, G>,
                   tiles_of(in.Tq), in, kBackwardQueriesSharedBytes<D>, stream, dq, stats, in, attention_scale(D));
    });
  });
}

}  // namespace keel::trainer::cuda
