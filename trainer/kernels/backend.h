// The kernel interface the model is built from (docs/architecture.md "Kernels"). The CPU
// backend (OpenBLAS for GEMM, plain C++ elsewhere) is the reference; a CUDA
// backend implements the same interface and tests hold the two against each
// other.
//
// Contracts that hold for every kernel:
// * Pointers are memory of this backend (host for CPU, device for CUDA),
//   obtained from alloc(). Tensors are dense and row-major.
// * N is a number of token positions (B*T rows), C a channel count.
// * Forward kernels overwrite their outputs. Backward kernels ACCUMULATE
//   (+=) into every gradient they produce, so residual branches, tied
//   embeddings and gradient accumulation need no extra kernels; callers zero
//   gradient buffers when they must start from zero.
// * A nullable gradient pointer means "not needed": the kernel skips it.
// * In deterministic mode (always, for the CPU backend) results are
//   bit-identical from run to run: no atomics, and reductions run in an
//   order that depends on the shapes only, never on the thread count.
#pragma once

#include "trainer/kernels/dtype.h"
#include "trainer/kernels/stream.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace keel::trainer {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;

  // ---- memory ----
  // Whether this backend's memory is host memory (copies are memcpy), so
  // that host code may read and write it directly.
  virtual bool host_memory() const { return false; }
  virtual void* alloc(size_t bytes) = 0;  // zero-filled, 64-byte aligned at least
  virtual void free(void* ptr) = 0;
  virtual void zero(void* ptr, size_t bytes) = 0;
  virtual void copy_from_host(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void copy_to_host(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;  // both in backend memory

  // ---- host staging (docs/architecture.md "Checkpoints") ----
  // Page-locks host memory [data, data + bytes) so copies between it and
  // this backend run at full bus speed; unpin_host(data) undoes it before
  // the memory is freed. Nothing to do where copies are memcpy.
  virtual void pin_host(void* data, size_t bytes) {
    (void)data;
    (void)bytes;
  }
  virtual void unpin_host(void* data) { (void)data; }
  // Copies each region of backend memory to the host once the work queued
  // on the compute stream so far is done (on CUDA, on a copy stream of its
  // own), and returns when every copy has landed.
  struct HostCopy {
    void* host;
    const void* src;
    size_t bytes;
  };
  virtual void snapshot_to_host(const std::vector<HostCopy>& copies) {
    for (const HostCopy& c : copies) copy_to_host(c.host, c.src, c.bytes);
  }

  // ---- streams (stream.h) ----
  // Where every kernel below runs. A communicator given this stream
  // (Communicator::set_compute_stream) starts a collective only after the
  // kernels queued before it.
  virtual Stream& compute_stream() = 0;

  // ---- embedding, vocabulary split over TP ranks (docs/architecture.md "Parallel layout and communication") ----
  // wte holds rows [v_begin, v_begin + Vl) of the token table (a single
  // rank: v_begin = 0, Vl = the padded vocabulary).
  // out[b,t,:] = wte[tokens[b,t] - v_begin,:] when the token lies in that
  // range, else 0, plus wpe[t,:] when wpe is non-null.
  virtual void embedding_forward(float* out, const int32_t* tokens, const float* wte, int v_begin, int Vl,
                                 const float* wpe, int B, int T, int C) = 0;
  virtual void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int v_begin,
                                  int Vl, int B, int T, int C) = 0;

  // ---- layernorm over the last dim, eps 1e-5; saves mean[N] and rstd[N] ----
  virtual void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                                 const float* weight, const float* bias, int N, int C) = 0;
  // The residual add before a LayerNorm in one pass over the rows:
  // sum += addend, then layernorm_forward(out, mean, rstd, sum, ...). Bit for
  // bit what accumulate() followed by layernorm_forward() gives.
  virtual void add_layernorm_forward(float* sum, const float* addend, float* out, float* mean, float* rstd,
                                     const float* weight, const float* bias, int N, int C) = 0;
  virtual void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                                  const float* inp, const float* weight, const float* mean,
                                  const float* rstd, int N, int C) = 0;

  // ---- linear: out[N,OC] = inp[N,C] @ weight[OC,C]^T + bias[OC] (bias nullable) ----
  // What the two matmul kernels multiply (docs/architecture.md "Dtypes"):
  // kF32, or kBF16: every operand rounded to bfloat16 (nearest, ties to
  // even) and the products summed in float32. Every buffer, and every other
  // kernel, stays float32 either way.
  virtual DType gemm_inputs() const = 0;
  virtual void matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                              int N, int C, int OC) = 0;
  virtual void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                               const float* inp, const float* weight, int N, int C, int OC) = 0;

  // ---- causal attention, flash style ----
  // Queries and keys live in separate views, so the same kernels serve
  // self-attention (q, k and v side by side in one qkv buffer) and ring
  // attention (a chunk of queries against another rank's chunk of keys).
  // Rows are positions: q[b, t] is row b*Tq + t of `q`, ld_q floats after
  // the row before it; k and v likewise over Tk rows with ld_kv. Head h owns
  // channels h*d..(h+1)*d of every row, d = C / NH. Query row t sits at
  // position q_offset + t and key row j at k_offset + j; a query sees the
  // keys at or before its own position. Scores are scaled by 1/sqrt(d).
  struct AttentionInputs {
    const float* q;
    const float* k;
    const float* v;
    int ld_q, ld_kv;
    int B, Tq, Tk, C, NH;
    int q_offset = 0, k_offset = 0;
  };
  // The gradients of q, k and v, laid out as the inputs.
  struct AttentionGrads {
    float* dq;
    float* dk;
    float* dv;
  };
  // Self-attention over qkv[B, T, 3C]: q, then k, then v at every position.
  static AttentionInputs self_attention(const float* qkv, int B, int T, int C, int NH) {
    return {qkv, qkv + C, qkv + 2 * C, 3 * C, 3 * C, B, T, T, C, NH};
  }
  static AttentionGrads self_attention_grads(float* dqkv, int C) { return {dqkv, dqkv + C, dqkv + 2 * C}; }

  // out[B, Tq, C] holds the heads side by side; lse[B, NH, Tq] each query
  // row's log-sum-exp of its scores: all the backward needs to recompute
  // the probabilities (exp(score - lse)), so no [Tq, Tk] matrix is ever
  // kept. A query row that sees no key gets out = 0 and lse = -inf.
  virtual void attention_forward(float* out, float* lse, const AttentionInputs& in) = 0;
  // Accumulates into the gradients of the keys in `in` and of its queries.
  // out and lse are those of the query rows over EVERY key they see (after
  // attention_merge, in ring attention), so each chunk of keys is exact on
  // its own: P = exp(score - lse), and D_t = dout_t . out_t stands for the
  // row sum of P dP over all keys.
  virtual void attention_backward(const AttentionGrads& grads, const float* dout, const float* out, const float* lse,
                                  const AttentionInputs& in) = 0;
  // Joins attention over two sets of keys for the same queries: (out, lse)
  // over the first and (part_out, part_lse) over the second become, in
  // place, out and lse over both. Shapes as attention_forward's outputs.
  virtual void attention_merge(float* out, float* lse, const float* part_out, const float* part_lse, int B, int T,
                               int C, int NH) = 0;

  // ---- GELU, tanh form ----
  virtual void gelu_forward(float* out, const float* inp, size_t n) = 0;
  virtual void gelu_backward(float* dinp, const float* inp, const float* dout, size_t n) = 0;

  // ---- residual: dst += src ----
  virtual void accumulate(float* dst, const float* src, size_t n) = 0;

  // ---- a block of columns of a matrix (the k and v of qkv rows) ----
  // dst[r, c] = src[r, c] (copy_columns) or dst[r, c] += src[r, c]
  // (accumulate_columns) for r < rows and c < cols, where a row of dst
  // starts dst_ld floats after the one before and a row of src src_ld.
  virtual void copy_columns(float* dst, int dst_ld, const float* src, int src_ld, int rows, int cols) = 0;
  virtual void accumulate_columns(float* dst, int dst_ld, const float* src, int src_ld, int rows, int cols) = 0;

  // ---- softmax cross-entropy, vocabulary split over TP ranks ----
  // logits[N,Vl] hold classes [v_begin, v_begin + Vl) of the padded
  // vocabulary; only classes below V are real, padded ones never take part.
  // A single rank is the case v_begin = 0, Vl = Vp. Three passes, so that
  // the ranks only exchange three floats per row:
  // stats[N,3] per row over this shard's real classes: the max logit
  // (-inf when the shard has none), the sum of exp(logit - max), and the
  // target's logit when the target lies in this shard (else 0).
  virtual void crossentropy_stats(float* stats, const float* logits, const int32_t* targets, int N, int v_begin,
                                  int Vl, int V) = 0;
  // Combines the stats of S shards ([S,N,3], shard after shard, as
  // all_gather returns them): lse[n] = log of the sum of exp over every
  // class, losses[n] = lse[n] - the target's logit. Shards are combined in
  // index order whatever the caller.
  virtual void crossentropy_combine(float* losses, float* lse, const float* stats, int S, int N) = 0;
  // dlogits = dloss * (softmax - onehot) over this shard, zero in padded
  // columns. OVERWRITES (not accumulates) dlogits, which may alias logits.
  virtual void crossentropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                                     float dloss, int N, int v_begin, int Vl, int V) = 0;

  // ---- row softmax over probs[N,E] (MoE router) ----
  virtual void softmax_forward(float* probs, const float* logits, int N, int E) = 0;
  virtual void softmax_backward(float* dlogits, const float* dprobs, const float* probs, int N, int E) = 0;

  // ---- row gather/scatter (MoE dispatch and combine) ----
  // out[m,:] = weights[m] * inp[rows[m],:] for m < M (weights nullable: 1).
  virtual void gather_rows(float* out, const float* inp, const int32_t* rows, const float* weights, int M,
                           int C) = 0;
  // out[rows[m],:] += weights[m] * inp[m,:] (weights nullable: 1), summed
  // over m in increasing order for each destination row.
  virtual void scatter_add_rows(float* out, const float* inp, const int32_t* rows, const float* weights,
                                int M, int C) = 0;
  // out[m] = dot(a[rows[m],:], b[m,:]): the gradient of a combine weight.
  virtual void gathered_row_dot(float* out, const float* a, const int32_t* rows, const float* b, int M, int C) = 0;

  // ---- optimizer ----
  // One AdamW step on n elements with bias correction for step t (1-based);
  // grads are multiplied by grad_scale first (gradient clipping).
  virtual void adamw_update(float* params, const float* grads, float* m, float* v, size_t n, float lr,
                            float beta1, float beta2, float eps, float weight_decay, float grad_scale,
                            int64_t t) = 0;
  // sum(x^2) in double, reduced in a fixed order.
  virtual double sum_squares(const float* x, size_t n) = 0;
  // sum(x) in double, reduced in a fixed order.
  virtual double sum(const float* x, size_t n) = 0;
};

}  // namespace keel::trainer
