// The linear layer on cuBLASLt (cublaslt_gemm.h). Row-major [rows, cols] is
// column-major [cols, rows] to cuBLAS, so each product below is written
// transposed: out^T = W x^T and so on.
//
// With bf16 GEMM inputs (CudaBackend's gemm_inputs) each operand is rounded
// to bf16 (nearest, ties to even) into scratch just before its GEMM: the
// float32 weights stay the only copy, so the optimizer, the checkpoint and
// the gradient reduction never see bf16, and the product accumulates in
// float32 into a float32 output.
#include "trainer/kernels/cuda/cuda_backend.h"

#include "trainer/kernels/cuda/cublaslt_gemm.h"
#include "trainer/kernels/cuda/launch.cuh"

#include <cuda_bf16.h>

#include <initializer_list>
#include <vector>

namespace keel::trainer::cuda {
namespace {

// cuBLASLt's preferred alignment for each operand's copy.
constexpr size_t kSlotAlign = 256;

__global__ void round_to_bf16_kernel(__nv_bfloat16* out, const float* in, size_t n) {
  for (size_t i = first_index(); i < n; i += grid_stride()) out[i] = __float2bfloat16_rn(in[i]);
}

size_t slot_bytes(size_t count) { return (count * sizeof(__nv_bfloat16) + kSlotAlign - 1) / kSlotAlign * kSlotAlign; }

}  // namespace

std::vector<const void*> CudaBackend::gemm_operands(std::initializer_list<Operand> operands) {
  std::vector<const void*> out;
  if (gemm_inputs_ == DType::kF32) {
    for (const Operand& op : operands) out.push_back(op.data);
    return out;
  }
  size_t total = 0;
  for (const Operand& op : operands) total += op.data != nullptr ? slot_bytes(op.count) : 0;
  auto* slot = static_cast<char*>(scratch(total));
  for (const Operand& op : operands) {
    if (op.data == nullptr) {
      out.push_back(nullptr);
      continue;
    }
    auto* copy = reinterpret_cast<__nv_bfloat16*>(slot);
    launch("round_to_bf16", round_to_bf16_kernel, op.count, stream(), copy, op.data);
    out.push_back(copy);
    slot += slot_bytes(op.count);
  }
  return out;
}

void CudaBackend::matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N, int C,
                                 int OC) {
  const auto ops = gemm_operands({{weight, static_cast<size_t>(OC) * C}, {inp, static_cast<size_t>(N) * C}});
  // out^T[OC,N] = (W^T)^T[OC,C] x^T[C,N] + bias: W row-major [OC,C] is W^T to cuBLAS.
  gemm_->run(stream(), true, false, OC, N, C, gemm_type(), ops[0], C, ops[1], C, 0.0f, out, OC, bias);
}

void CudaBackend::matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                                  const float* weight, int N, int C, int OC) {
  if (dinp != nullptr || dweight != nullptr) {
    const auto ops = gemm_operands({{dout, static_cast<size_t>(N) * OC},
                                    {dinp != nullptr ? weight : nullptr, static_cast<size_t>(OC) * C},
                                    {dweight != nullptr ? inp : nullptr, static_cast<size_t>(N) * C}});
    // dinp^T[C,N] += W^T[C,OC] dout^T[OC,N].
    if (dinp != nullptr)
      gemm_->run(stream(), false, false, C, N, OC, gemm_type(), ops[1], C, ops[0], OC, 1.0f, dinp, C, nullptr);
    // dW^T[C,OC] += x^T[C,N] dout[N,OC].
    if (dweight != nullptr) {
      gemm_->run(stream(), false, true, C, OC, N, gemm_type(), ops[2], C, ops[0], OC, 1.0f, dweight, C, nullptr);
    }
  }
  if (dbias != nullptr) column_sum_accumulate(dbias, dout, N, OC, stream());
}

}  // namespace keel::trainer::cuda
