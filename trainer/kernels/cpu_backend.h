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
  bool host_memory() const override { return true; }
  Stream& compute_stream() override { return stream_; }

  void embedding_forward(float* out, const int32_t* tokens, const float* wte, int v_begin, int Vl,
                         const float* wpe, int B, int T, int C) override;
  void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int v_begin, int Vl,
                          int B, int T, int C) override;
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                         const float* bias, int N, int C) override;
  void add_layernorm_forward(float* sum, const float* addend, float* out, float* mean, float* rstd,
                             const float* weight, const float* bias, int N, int C) override;
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                          const float* weight, const float* mean, const float* rstd, int N, int C) override;
  void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N, int C,
                      int OC) override;
  void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                       const float* weight, int N, int C, int OC) override;
  void attention_forward(float* out, float* lse, const AttentionInputs& in) override;
  void attention_backward(const AttentionGrads& grads, const float* dout, const float* out, const float* lse,
                          const AttentionInputs& in) override;
  void attention_merge(float* out, float* lse, const float* part_out, const float* part_lse, int B, int T, int C,
                       int NH) override;
  void gelu_forward(float* out, const float* inp, size_t n) override;
  void gelu_backward(float* dinp, const float* inp, const float* dout, size_t n) override;
  void accumulate(float* dst, const float* src, size_t n) override;
  void copy_columns(float* dst, int dst_ld, const float* src, int src_ld, int rows, int cols) override;
  void accumulate_columns(float* dst, int dst_ld, const float* src, int src_ld, int rows, int cols) override;
  void crossentropy_stats(float* stats, const float* logits, const int32_t* targets, int N, int v_begin, int Vl,
                          int V) override;
  void crossentropy_combine(float* losses, float* lse, const float* stats, int S, int N) override;
  void crossentropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                             float dloss, int N, int v_begin, int Vl, int V) override;
  void softmax_forward(float* probs, const float* logits, int N, int E) override;
  void softmax_backward(float* dlogits, const float* dprobs, const float* probs, int N, int E) override;
  void gather_rows(float* out, const float* inp, const int32_t* rows, const float* weights, int M,
                   int C) override;
  void scatter_add_rows(float* out, const float* inp, const int32_t* rows, const float* weights, int M,
                        int C) override;
  void gathered_row_dot(float* out, const float* a, const int32_t* rows, const float* b, int M, int C) override;
  void adamw_update(float* params, const float* grads, float* m, float* v, size_t n, float lr, float beta1,
                    float beta2, float eps, float weight_decay, float grad_scale, int64_t t) override;
  double sum_squares(const float* x, size_t n) override;
  double sum(const float* x, size_t n) override;

 private:
  // The operands of one matmul call as the GEMMs take them: the pointers
  // themselves, or bf16-rounded copies in rounded_ (a null operand stays null).
  std::vector<const float*> gemm_operands(std::initializer_list<std::pair<const float*, size_t>> operands);

  int threads_;
  DType gemm_inputs_;
  std::vector<float> rounded_;  // grows to the largest call's operands, then stays
  HostStream stream_;
};

}  // namespace keel::trainer
