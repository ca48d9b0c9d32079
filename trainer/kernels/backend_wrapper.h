// A Backend that forwards every kernel to another one: a fault injector or
// a test derives from it and overrides only the kernel it breaks (the
// FileSystemWrapper pattern of checkpoint/file_system.h).
#pragma once

#include "trainer/kernels/backend.h"

namespace keel::trainer {

class BackendWrapper : public Backend {
 public:
  explicit BackendWrapper(Backend& target) : target_(target) {}

  bool host_memory() const override { return target_.host_memory(); }
  const char* name() const override { return target_.name(); }
  void* alloc(size_t bytes) override { return target_.alloc(bytes); }
  void free(void* ptr) override { target_.free(ptr); }
  void zero(void* ptr, size_t bytes) override { target_.zero(ptr, bytes); }
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override {
    target_.copy_from_host(dst, host_src, bytes);
  }
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override {
    target_.copy_to_host(host_dst, src, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override { target_.copy(dst, src, bytes); }
  void pin_host(void* data, size_t bytes) override { target_.pin_host(data, bytes); }
  void unpin_host(void* data) override { target_.unpin_host(data); }
  void snapshot_to_host(const std::vector<HostCopy>& copies) override { target_.snapshot_to_host(copies); }
  Stream& compute_stream() override { return target_.compute_stream(); }
  void embedding_forward(float* out, const int32_t* tokens, const float* wte, int v_begin, int Vl, const float* wpe,
                         int B, int T, int C) override {
    target_.embedding_forward(out, tokens, wte, v_begin, Vl, wpe, B, T, C);
  }
  void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int v_begin, int Vl,
                          int B, int T, int C) override {
    target_.embedding_backward(dwte, dwpe, dout, tokens, v_begin, Vl, B, T, C);
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                         int N, int C) override {
    target_.layernorm_forward(out, mean, rstd, inp, weight, bias, N, C);
  }
  void add_layernorm_forward(float* sum, const float* addend, float* out, float* mean, float* rstd,
                             const float* weight, const float* bias, int N, int C) override {
    target_.add_layernorm_forward(sum, addend, out, mean, rstd, weight, bias, N, C);
  }
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                          const float* weight, const float* mean, const float* rstd, int N, int C) override {
    target_.layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
  }
  DType gemm_inputs() const override { return target_.gemm_inputs(); }
  void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N, int C,
                      int OC) override {
    target_.matmul_forward(out, inp, weight, bias, N, C, OC);
  }
  void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                       const float* weight, int N, int C, int OC) override {
    target_.matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, C, OC);
  }
  void attention_forward(float* out, float* lse, const AttentionInputs& in) override {
    target_.attention_forward(out, lse, in);
  }
  void attention_backward(const AttentionGrads& grads, const float* dout, const float* out, const float* lse,
                          const AttentionInputs& in) override {
    target_.attention_backward(grads, dout, out, lse, in);
  }
  void attention_merge(float* out, float* lse, const float* part_out, const float* part_lse, int B, int T, int C,
                       int NH) override {
    target_.attention_merge(out, lse, part_out, part_lse, B, T, C, NH);
  }
  void gelu_forward(float* out, const float* inp, size_t n) override { target_.gelu_forward(out, inp, n); }
  void gelu_backward(float* dinp, const float* inp, const float* dout, size_t n) override {
    target_.gelu_backward(dinp, inp, dout, n);
  }
  void accumulate(float* dst, const float* src, size_t n) override { target_.accumulate(dst, src, n); }
  void copy_columns(float* dst, int dst_ld, const float* src, int src_ld, int rows, int cols) override {
    target_.copy_columns(dst, dst_ld, src, src_ld, rows, cols);
  }
  void accumulate_columns(float* dst, int dst_ld, const float* src, int src_ld, int rows, int cols) override {
    target_.accumulate_columns(dst, dst_ld, src, src_ld, rows, cols);
  }
  void crossentropy_stats(float* stats, const float* logits, const int32_t* targets, int N, int v_begin, int Vl,
                          int V) override {
    target_.crossentropy_stats(stats, logits, targets, N, v_begin, Vl, V);
  }
  void crossentropy_combine(float* losses, float* lse, const float* stats, int S, int N) override {
    target_.crossentropy_combine(losses, lse, stats, S, N);
  }
  void crossentropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets, float dloss,
                             int N, int v_begin, int Vl, int V) override {
    target_.crossentropy_backward(dlogits, logits, lse, targets, dloss, N, v_begin, Vl, V);
  }
  void softmax_forward(float* probs, const float* logits, int N, int E) override {
    target_.softmax_forward(probs, logits, N, E);
  }
  void softmax_backward(float* dlogits, const float* dprobs, const float* probs, int N, int E) override {
    target_.softmax_backward(dlogits, dprobs, probs, N, E);
  }
  void gather_rows(float* out, const float* inp, const int32_t* rows, const float* weights, int M, int C) override {
    target_.gather_rows(out, inp, rows, weights, M, C);
  }
  void scatter_add_rows(float* out, const float* inp, const int32_t* rows, const float* weights, int M,
                        int C) override {
    target_.scatter_add_rows(out, inp, rows, weights, M, C);
  }
  void gathered_row_dot(float* out, const float* a, const int32_t* rows, const float* b, int M, int C) override {
    target_.gathered_row_dot(out, a, rows, b, M, C);
  }
  void adamw_update(float* params, const float* grads, float* m, float* v, size_t n, float lr, float beta1, float beta2,
                    float eps, float weight_decay, float grad_scale, int64_t t) override {
    target_.adamw_update(params, grads, m, v, n, lr, beta1, beta2, eps, weight_decay, grad_scale, t);
  }
  double sum_squares(const float* x, size_t n) override { return target_.sum_squares(x, n); }
  double sum(const float* x, size_t n) override { return target_.sum(x, n); }

 protected:
  Backend& target_;
};

}  // namespace keel::trainer
