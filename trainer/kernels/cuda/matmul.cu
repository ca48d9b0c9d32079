// The linear layer on cuBLASLt (cublaslt_gemm.h). Row-major [rows, cols] is
// column-major [cols, rows] to cuBLAS, so each product below is written
// transposed: out^T = W x^T and so on.
//
// With bf16 GEMM inputs (CudaBackend's gemm_inputs) a bf16 operand is taken
// as it is: an activation its producer wrote so, or the weights' GEMM copy
// that ZeroStorage rounds once after the float32 masters change (so the
// optimizer, the checkpoint and the gradient reduction never see bf16). A
// float32 operand (a gradient of the residual stream) is rounded to bf16
// (nearest, ties to even) into scratch just before its GEMM. The product
// accumulates in float32: into a float32 output, or one the caller keeps
// as bf16 (the logits, the pre-activation and its gradient, qkv), rounded.
#include "trainer/kernels/cuda/cuda_backend.h"

#include "trainer/kernels/column_sums.h"
#include "trainer/kernels/cuda/cublaslt_gemm.h"
#include "trainer/kernels/cuda/launch.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <initializer_list>
#include <vector>

namespace keel::trainer::cuda {
namespace {

// cuBLASLt's preferred alignment for each operand's copy.
constexpr size_t kSlotAlign = 256;

// The bias gradient in column_sums.h's order: a thread per (column,
// chunk of rows) sums its chunk in double, reading along rows, so a
// warp's loads are one contiguous run; then a warp per column sums the
// chunks in order.
template <typename T>
__global__ void column_chunk_sums_kernel(double* chunk_sums, const T* src, int rows, int cols, int chunks) {
  const int c = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (c >= cols) return;
  for (int k = static_cast<int>(blockIdx.y); k < chunks; k += static_cast<int>(gridDim.y)) {
    const int r0 = k * kColumnChunkRows, r1 = min(rows, r0 + kColumnChunkRows);
    const T* column = src + static_cast<size_t>(r0) * cols + c;
    chunk_sums[static_cast<size_t>(k) * cols + c] = add_in_order(0.0, column, r1 - r0, cols);
  }
}

size_t slot_bytes(size_t count) { return (count * sizeof(__nv_bfloat16) + kSlotAlign - 1) / kSlotAlign * kSlotAlign; }

}  // namespace

GemmInputs CudaBackend::gemm_type() const {
  return gemm_inputs_ == DType::kBF16 ? GemmInputs::kBF16 : GemmInputs::kF32;
}

std::vector<const void*> CudaBackend::gemm_operands(std::initializer_list<Operand> operands) {
  size_t total = 0;
  for (const Operand& op : operands) {
    if (op.data.dtype == DType::kBF16 && gemm_inputs_ != DType::kBF16) {
      throw common::Error(common::ErrorCode::kInternal, "a bf16 GEMM operand on a backend with float32 GEMM inputs");
    }
    if (op.data.dtype == DType::kF32 && op.data.data != nullptr && gemm_inputs_ == DType::kBF16) {
      total += slot_bytes(op.count);
    }
  }
  auto* slot = total > 0 ? static_cast<char*>(scratch(total)) : nullptr;
  std::vector<const void*> out;
  for (const Operand& op : operands) {
    if (op.data.data == nullptr || op.data.dtype == DType::kBF16 || gemm_inputs_ == DType::kF32) {
      out.push_back(op.data.data);
      continue;
    }
    auto* copy = reinterpret_cast<bf16*>(slot);
    round_to_bf16(copy, op.data.f32(), op.count);
    out.push_back(copy);
    slot += slot_bytes(op.count);
  }
  return out;
}

void CudaBackend::matmul_forward(Buffer out, ConstBuffer inp, ConstBuffer weight, ConstBuffer bias, int N, int C,
                                 int OC) {
  if (bias.dtype == DType::kBF16 && out.dtype != DType::kBF16) {
    throw common::Error(common::ErrorCode::kInternal, "a bf16 bias beside a float32 linear output");
  }
  const auto ops = gemm_operands({{weight, static_cast<size_t>(OC) * C}, {inp, static_cast<size_t>(N) * C}});
  // out^T[OC,N] = (W^T)^T[OC,C] x^T[C,N] + bias: W row-major [OC,C] is W^T to cuBLAS.
  const auto product = [&](Buffer to, ConstBuffer b) {
    gemm_->run(stream(), true, false, OC, N, C, gemm_type(), ops[0], C, ops[1], C, 0.0f, to, OC, b);
  };
  // A bf16 out straight from cuBLASLt where it can write one: bf16 inputs,
  // rows of whole 16-byte vectors, and no bias or a bf16 one (cuBLASLt's
  // bias takes C's type) aligned as the outputs. At 084b7bf qkv's and fc's
  // outputs went through linear_out instead: float32 written, read back
  // and rounded, 1.3 ms a step of rounding at 124M.
  if (out.dtype == DType::kF32 ||
      (gemm_type() == GemmInputs::kBF16 && OC % 8 == 0 &&
       (bias.data == nullptr || (bias.dtype == DType::kBF16 && aligned_16(bias.data))))) {
    product(out, bias);
    return;
  }
  // Otherwise float32 into linear_out, rounded after, as the CPU does; a
  // bf16 bias is widened behind the output (scratch holds the operands).
  const size_t n = static_cast<size_t>(N) * OC;
  auto* linear = static_cast<float*>(linear_out((n + static_cast<size_t>(OC)) * sizeof(float)));
  const float* widened = bias.f32();
  if (bias.dtype == DType::kBF16) {
    widen_from_bf16(linear + n, static_cast<const bf16*>(bias.data), static_cast<size_t>(OC));
    widened = linear + n;
  }
  product(linear, widened);
  round_to_bf16(static_cast<bf16*>(out.data), linear, n);
}

void CudaBackend::matmul_backward_through_gelu(Buffer dpre, float* dweight, float* dbias, ConstBuffer dout,
                                               ConstBuffer inp, ConstBuffer weight, ConstBuffer pre, int N, int C,
                                               int OC) {
  if (dpre.data != nullptr && N > 0 && C > 0) {
    // grad^T[C,N] = W^T[C,OC] dout^T[OC,N] in float32 (beta 0: over dpre
    // itself when that is float32), then dpre = GELU'(pre) * grad in one
    // pass: gelu.h's derivative, as the CPU's. Not cuBLASLt's DGELU
    // epilogue, which cuBLASLt ran as a kernel of its own at GPT-2's shapes
    // (cublasLt::globalKernel, 2.3 ms of a 36.5 ms step on the H200,
    // 6ef341d), reading the GEMM's output back as this kernel does.
    const size_t n = static_cast<size_t>(N) * C;
    auto* grad = dpre.dtype == DType::kF32 ? static_cast<float*>(dpre.data)
                                           : static_cast<float*>(linear_out(n * sizeof(float)));
    const auto ops = gemm_operands({{dout, static_cast<size_t>(N) * OC}, {weight, static_cast<size_t>(OC) * C}});
    gemm_->run(stream(), false, false, C, N, OC, gemm_type(), ops[1], C, ops[0], OC, 0.0f, grad, C, nullptr);
    gelu_derivative_times(dpre, grad, pre, n);
  }
  matmul_backward(nullptr, Into::kWrite, dweight, dbias, dout, inp, weight, N, C, OC);
}

void CudaBackend::matmul_backward(float* dinp, Into dinp_into, float* dweight, float* dbias, ConstBuffer dout,
                                  ConstBuffer inp, ConstBuffer weight, int N, int C, int OC) {
  if (dinp != nullptr || dweight != nullptr) {
    const auto ops = gemm_operands({{dout, static_cast<size_t>(N) * OC},
                                    {dinp != nullptr ? weight : nullptr, static_cast<size_t>(OC) * C},
                                    {dweight != nullptr ? inp : nullptr, static_cast<size_t>(N) * C}});
    // dinp^T[C,N] (+)= W^T[C,OC] dout^T[OC,N].
    if (dinp != nullptr) {
      gemm_->run(stream(), false, false, C, N, OC, gemm_type(), ops[1], C, ops[0], OC,
                 dinp_into == Into::kAdd ? 1.0f : 0.0f, dinp, C, nullptr);
    }
    // dW^T[C,OC] += x^T[C,N] dout[N,OC].
    if (dweight != nullptr) {
      gemm_->run(stream(), false, true, C, OC, N, gemm_type(), ops[2], C, ops[0], OC, 1.0f, dweight, C, nullptr);
    }
  }
  if (dbias != nullptr && N > 0 && OC > 0) {
    // Scratch is free again: the GEMMs queued above read their operands first.
    const int chunks = (N + kColumnChunkRows - 1) / kColumnChunkRows;
    auto* chunk_sums = static_cast<double*>(scratch(static_cast<size_t>(chunks) * OC * sizeof(double)));
    const unsigned column_blocks = static_cast<unsigned>((OC + kThreads - 1) / kThreads);
    const unsigned chunk_blocks = static_cast<unsigned>(std::min(chunks, 65535));  // gridDim.y's limit
    with_type<__nv_bfloat16>(dout, [&](const auto* d) {
      column_chunk_sums_kernel<<<dim3(column_blocks, chunk_blocks), kThreads, 0, stream()>>>(chunk_sums, d, N, OC,
                                                                                             chunks);
    });
    check_launch("matmul_backward (bias chunks)");
    column_sum_accumulate(dbias, chunk_sums, chunks, OC, stream());
  }
}

}  // namespace keel::trainer::cuda
