// One GEMM through cuBLASLt, for the CUDA backend's matmuls. Column-major,
// as cuBLAS sees memory: C[m,n] = op(A) op(B) + beta C, plus bias[m] on
// every column when bias is non-null (the BIAS epilogue). A and B are
// stored and multiplied as GemmInputs says; the scalars are float32, and so
// is C, but for a product of bf16 inputs, which cuBLASLt can write as bf16
// (its float32 result, bias added, rounded to nearest) instead of keel
// writing float32 and rounding it in a pass of its own. The bias is in C's
// type (cublasLt.h, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE).
//
// Determinism: the algorithm comes from cuBLASLt's heuristic once per shape
// and is then reused, so a shape always runs the same code. cuBLAS
// documents bitwise reproducibility run to run on GPUs of the same
// architecture and SM count, and every split-K reduction scheme of
// cuBLASLt is sequenced (in place with counters, or a separate reduction
// pass), none uses atomics.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "trainer/kernels/dtype.h"

#include <array>
#include <cstddef>
#include <map>

namespace keel::trainer::cuda {

// How A and B are stored and multiplied. Every product accumulates in
// float32.
enum class GemmInputs {
  // float32, multiplied in float32: CUBLAS_COMPUTE_32F gives no TF32 rounding.
  kF32,
  // bfloat16, on tensor cores.
  kBF16,
  // float32, which cuBLASLt rounds to bfloat16 for the tensor cores itself
  // (CUBLAS_COMPUTE_32F_FAST_16BF): no bf16 copy of either operand.
  kF32RoundedToBF16,
};
const char* gemm_inputs_name(GemmInputs inputs);

class CublasLtGemm {
 public:
  CublasLtGemm();
  ~CublasLtGemm();
  CublasLtGemm(const CublasLtGemm&) = delete;
  CublasLtGemm& operator=(const CublasLtGemm&) = delete;

  // cuBLASLt's workspace, allocated once: llm.c's figure, enough for every
  // algorithm Hopper's heuristic offers at GPT-2 shapes.
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;

  // Throws common::Error (kInternal) when cuBLASLt fails or finds no
  // algorithm for the shape, or for a bf16 C beside inputs that are not
  // kBF16, or a bias not of C's type. k = 0 is allowed without a bias for
  // beta 1, which leaves C as it is, and beta 0, which zeroes it.
  void run(cudaStream_t stream, bool trans_a, bool trans_b, int m, int n, int k, GemmInputs inputs, const void* a,
           int lda, const void* b, int ldb, float beta, Buffer c, int ldc, ConstBuffer bias);

 private:
  // What the heuristic sees: operations, sizes, leading dimensions, bias,
  // beta, the inputs, C's type and the alignment of each pointer (parameters
  // are offsets into one buffer, so a weight may be aligned to 4 bytes only).
  using Shape = std::array<int64_t, 16>;

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  // The algorithm of each shape.
  std::map<Shape, cublasLtMatmulAlgo_t> algos_;
};

}  // namespace keel::trainer::cuda
