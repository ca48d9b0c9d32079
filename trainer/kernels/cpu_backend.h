// The reference backend: OpenBLAS (OpenMP build) for GEMM, C++ loops with
// OpenMP elsewhere. Every reduction runs in a fixed, shape-determined order,
// so results do not depend on the thread count. OpenBLAS's own results
// change with how it splits a product, so every GEMM is cut into tiles whose
// sizes depend on the shape only, each tile one single-threaded sgemm inside
// keel's OpenMP region.
#pragma once

#include "trainer/kernels/backend.h"

#include <initializer_list>
#include <utility>
#include <vector>

namespace keel::trainer {

class CpuBackend final : public Backend {
 public:
  // threads <= 0: every core. Sets the process's OpenMP thread count and
  // keeps OpenBLAS single-threaded (keel's tiles supply the parallelism).
  // gemm_inputs kBF16 rounds the operands into buffers of this backend
  // before the fp32 sgemm: what tensor cores compute, so CPU runs are the
  // reference and the test bed for bf16 training too.
  explicit CpuBackend(int threads = 0, DType gemm_inputs = DType::kF32);
  const char* name() const override { return "cpu"; }
  int threads() const { return threads_; }
  DType gemm_inputs() const override { return gemm_inputs_; }

  void* alloc(size_t bytes) override;
  void free(void* ptr) override;
  void zero(void* ptr, size_t bytes) override;
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  size_t scratch_bytes() const override;
  bool host_memory() const override { return true; }
  Stream& compute_stream() override { return stream_; }

#define KEEL_BACKEND_KERNEL(ret, name, params, args) ret name params override;
#include "trainer/kernels/backend_kernels.def"
#undef KEEL_BACKEND_KERNEL

 private:
  // The operands of one matmul call as the GEMMs take them: the float32
  // pointers themselves, or with bf16 GEMM inputs copies in rounded_ of
  // their values rounded to bf16 (a bf16 operand widened as it is). A null
  // operand stays null.
  std::vector<const float*> gemm_operands(std::initializer_list<std::pair<ConstBuffer, size_t>> operands);

  int threads_;
  DType gemm_inputs_;
  std::vector<float> rounded_;  // grows to the largest call's operands, then stays
  // matmul_backward_through_gelu's gradient of GELU's output, likewise.
  std::vector<float> gelu_input_grad_;
  // matmul_forward's float32 output where out is bf16, and
  // matmul_backward_through_gelu's dpre where that is.
  std::vector<float> linear_out_;
  std::vector<float> bias_widened_;  // matmul_forward's bf16 bias as float32
  std::vector<double> queued_sums_;  // the queued sums' values, computed at once
  HostStream stream_;
};

}  // namespace keel::trainer
