#include "trainer/kernels/cuda/cublaslt_gemm.h"

#include "common/error.h"

#include <fmt/format.h>

#include <cstdint>
#include <memory>

namespace keel::trainer::cuda {
namespace {

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw common::Error(common::ErrorCode::kInternal, fmt::format("{}: {} ({})", what, cublasLtGetStatusString(status),
                                                                  cublasLtGetStatusName(status)));
  }
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw common::Error(common::ErrorCode::kInternal, fmt::format("{}: {}", what, cudaGetErrorString(err)));
  }
}

// The largest power of two, up to 256, that divides the address.
int64_t alignment(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  int64_t align = 256;
  while (align > 4 && address % static_cast<uintptr_t>(align) != 0) align /= 2;
  return align;
}

// Owners of cuBLASLt's descriptors for the length of one call.
struct OpDesc {
  cublasLtMatmulDesc_t desc = nullptr;
  ~OpDesc() { cublasLtMatmulDescDestroy(desc); }
};
struct Layout {
  cublasLtMatrixLayout_t desc = nullptr;
  Layout(cudaDataType_t type, int rows, int cols, int ld) {
    check(cublasLtMatrixLayoutCreate(&desc, type, rows, cols, ld), "cublasLtMatrixLayoutCreate");
  }
  ~Layout() { cublasLtMatrixLayoutDestroy(desc); }
};
struct Preference {
  cublasLtMatmulPreference_t desc = nullptr;
  ~Preference() { cublasLtMatmulPreferenceDestroy(desc); }
};

template <class T> void set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  check(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)), "cublasLtMatmulDescSetAttribute");
}
template <class T>
void set(cublasLtMatmulPreference_t desc, cublasLtMatmulPreferenceAttributes_t attr, const T& value) {
  check(cublasLtMatmulPreferenceSetAttribute(desc, attr, &value, sizeof(value)),
        "cublasLtMatmulPreferenceSetAttribute");
}

}  // namespace

const char* gemm_inputs_name(GemmInputs inputs) {
  switch (inputs) {
    case GemmInputs::kF32: return "float32";
    case GemmInputs::kBF16: return "bf16";
    case GemmInputs::kF32RoundedToBF16: return "float32 rounded to bf16 by cuBLASLt";
  }
  return "?";
}

CublasLtGemm::CublasLtGemm() {
  check(cublasLtCreate(&handle_), "cublasLtCreate");
  const cudaError_t err = cudaMalloc(&workspace_, kWorkspaceBytes);
  if (err != cudaSuccess) {
    cublasLtDestroy(handle_);
    check(err, "cudaMalloc (cuBLASLt workspace)");
  }
}

CublasLtGemm::~CublasLtGemm() {
  cudaFree(workspace_);
  cublasLtDestroy(handle_);
}

void CublasLtGemm::run(cudaStream_t stream, bool trans_a, bool trans_b, int m, int n, int k, GemmInputs inputs,
                       const void* a, int lda, const void* b, int ldb, float beta, Buffer c, int ldc,
                       ConstBuffer bias_buffer) {
  if (m <= 0 || n <= 0) return;
  const bool bf16_c = c.dtype == DType::kBF16;
  const void* bias = bias_buffer.data;
  if ((bf16_c && inputs != GemmInputs::kBF16) || (bias != nullptr && bias_buffer.dtype != c.dtype)) {
    throw common::Error(
        common::ErrorCode::kInternal,
        fmt::format("a {} GEMM output with {} inputs{}", dtype_name(c.dtype), gemm_inputs_name(inputs),
                    bias != nullptr ? fmt::format(" and a {} bias", dtype_name(bias_buffer.dtype)) : std::string()));
  }
  if (k <= 0) {
    // An empty sum: C stays beta C, which is all of C for the accumulating
    // backward GEMMs (a batch that routed no token to an expert) and zero
    // for one written over (beta 0), as cblas leaves it on the CPU.
    if (beta == 1.0f && bias == nullptr) return;
    if (beta == 0.0f && bias == nullptr) {
      const size_t element = dtype_bytes(c.dtype);
      check(cudaMemset2DAsync(c.data, static_cast<size_t>(ldc) * element, 0, static_cast<size_t>(m) * element,
                              static_cast<size_t>(n), stream),
            "cudaMemset2DAsync (an empty GEMM written over)");
      return;
    }
    throw common::Error(common::ErrorCode::kInternal,
                        fmt::format("a {}x{} GEMM over an empty inner dimension with beta {}", m, n, beta));
  }
  OpDesc op;
  const cublasComputeType_t compute =
      inputs == GemmInputs::kF32RoundedToBF16 ? CUBLAS_COMPUTE_32F_FAST_16BF : CUBLAS_COMPUTE_32F;
  const cudaDataType_t ab_type = inputs == GemmInputs::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
  check(cublasLtMatmulDescCreate(&op.desc, compute, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  set(op.desc, CUBLASLT_MATMUL_DESC_TRANSA, op_a);
  set(op.desc, CUBLASLT_MATMUL_DESC_TRANSB, op_b);
  if (bias != nullptr) {
    set(op.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    set(op.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
  }
  // The layouts describe the stored matrices, before op().
  const Layout a_layout(ab_type, trans_a ? k : m, trans_a ? m : k, lda);
  const Layout b_layout(ab_type, trans_b ? n : k, trans_b ? k : n, ldb);
  const Layout c_layout(bf16_c ? CUDA_R_16BF : CUDA_R_32F, m, n, ldc);

  const Shape shape = {trans_a,
                       trans_b,
                       m,
                       n,
                       k,
                       lda,
                       ldb,
                       ldc,
                       bias != nullptr,
                       beta != 0.0f,
                       static_cast<int64_t>(inputs),
                       bf16_c,
                       alignment(a),
                       alignment(b),
                       alignment(c.data),
                       bias != nullptr ? alignment(bias) : 0};
  auto found = algos_.find(shape);
  if (found == algos_.end()) {
    Preference pref;
    check(cublasLtMatmulPreferenceCreate(&pref.desc), "cublasLtMatmulPreferenceCreate");
    set(pref.desc, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, kWorkspaceBytes);
    set(pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, static_cast<uint32_t>(alignment(a)));
    set(pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, static_cast<uint32_t>(alignment(b)));
    set(pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, static_cast<uint32_t>(alignment(c.data)));
    set(pref.desc, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, static_cast<uint32_t>(alignment(c.data)));
    cublasLtMatmulHeuristicResult_t result{};
    int found_count = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
        handle_, op.desc, a_layout.desc, b_layout.desc, c_layout.desc, c_layout.desc, pref.desc, 1, &result,
        &found_count);
    check(status, "cublasLtMatmulAlgoGetHeuristic");
    if (found_count == 0) {
      throw common::Error(common::ErrorCode::kInternal,
                          fmt::format("cuBLASLt has no algorithm for a {}x{}x{} {} GEMM (ops {}{}, bias {})", m, n, k,
                                      gemm_inputs_name(inputs), trans_a ? 'T' : 'N',
                                      trans_b ? 'T' : 'N', bias != nullptr));
    }
    found = algos_.emplace(shape, result.algo).first;
  }
  const float alpha = 1.0f;
  check(cublasLtMatmul(handle_, op.desc, &alpha, a, a_layout.desc, b, b_layout.desc, &beta, c.data, c_layout.desc, c.data,
                       c_layout.desc, &found->second, workspace_, kWorkspaceBytes, stream),
        "cublasLtMatmul");
}

}  // namespace keel::trainer::cuda
