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
#include "trainer/kernels/host_device.h"
#include "trainer/kernels/stream.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace keel::trainer {

// A run of float32s in backend memory.
struct FloatSpan {
  const float* data = nullptr;
  size_t numel = 0;
};

// How a backward kernel puts an input gradient: added to what the array
// holds (a gradient with several sources: the residual stream's, the MoE
// router's beside its experts'), or written over it (one source, so
// nothing zeroes the array first and the GEMM does not read it back).
enum class Into { kAdd, kWrite };

// A row normalisation (backend_kernels.def "row norms"): GPT-2's
// LayerNorm, or Llama's RMSNorm, which neither centres nor shifts.
struct RowNorm {
  enum class Kind { kLayerNorm, kRmsNorm };
  Kind kind = Kind::kLayerNorm;
  float eps = 1e-5f;
  KEEL_HOST_DEVICE bool centred() const { return kind == Kind::kLayerNorm; }
};

// One tensor of an AdamW step (Backend::adamw_update): n elements of its
// parameters, their gradients and both moments, and its weight decay.
struct AdamwTensor {
  float* params = nullptr;
  const float* grads = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  size_t n = 0;
  float weight_decay = 0.0f;
  // Non-null: the updated parameters rounded to bf16 are written here too
  // (the GEMMs' copy, ZeroStorage::owned_gemm_copy), in the same pass.
  bf16* copy = nullptr;
};

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
  // host_src may be reused when copy_from_host returns. A copy of up to
  // kQueuedUploadBytes (a microbatch's tokens) is queued with the kernels,
  // without waiting for them; a larger one may wait.
  static constexpr size_t kQueuedUploadBytes = size_t{1} << 20;
  virtual void copy_from_host(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void copy_to_host(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;  // both in backend memory
  // Bytes of the backend's own working buffers (GEMM operand copies,
  // reduction partials, a GEMM library's workspace), which grow to the
  // largest call's need and then stay: memory beside what alloc() handed
  // out, so that a rank's footprint is its allocations plus this.
  virtual size_t scratch_bytes() const = 0;

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

  // What the matmul kernels multiply (docs/architecture.md "Dtypes"):
  // kF32, or kBF16: every operand rounded to bfloat16 (nearest, ties to
  // even) and the products summed in float32. A float32 operand is rounded
  // where the GEMM takes it; with kBF16 an activation input may also come
  // as bf16 already (the GELU output, which only GEMMs read), so that
  // nothing rounds it twice; so may attention's q, k and v.
  virtual DType gemm_inputs() const = 0;

  // ---- the layout of attention's inputs ----
  // Queries and keys live in separate views, so the same kernels serve
  // self-attention (q, k and v side by side in one qkv buffer) and ring
  // attention (a chunk of queries against another rank's chunk of keys).
  // Rows are positions: q[b, t] is row b*Tq + t of `q`, ld_q elements
  // after the row before it; k and v likewise over Tk rows with ld_kv. Query
  // head h owns channels h*d..(h+1)*d of every row of q, d = C / NH; the
  // keys and values have KVH heads of d channels (grouped-query attention:
  // query head h reads key/value head h / (NH / KVH); KVH = 0 means NH, a
  // key/value head per query head). Query row t sits at position
  // q_offset + t and key row j at k_offset + j; a query sees the keys at or
  // before its own position. Scores are scaled by 1/sqrt(d).
  // q, k and v hold `dtype` elements: bf16 only where gemm_inputs() is
  // kBF16 (the qkv linear's output kept so), kInternal otherwise.
  struct AttentionInputs {
    const void* q;
    const void* k;
    const void* v;
    int ld_q, ld_kv;
    int B, Tq, Tk, C, NH;
    int q_offset = 0, k_offset = 0;
    DType dtype = DType::kF32;
    int KVH = 0;
    KEEL_HOST_DEVICE int kv_heads() const { return KVH > 0 ? KVH : NH; }
    KEEL_HOST_DEVICE int head_dim() const { return C / NH; }
    KEEL_HOST_DEVICE int kv_width() const { return kv_heads() * head_dim(); }  // channels of a row of k (and of v)
  };
  // The gradients of q, k and v, laid out as the inputs, of `dtype`:
  // float32 ones are summed into (ring attention adds each chunk of keys'
  // share; a key/value head's sums its query heads' in head order); bf16
  // ones, only where gemm_inputs() is kBF16 (self-attention's dqkv, which
  // only the qkv linear's GEMMs read), are overwritten with each float32
  // gradient rounded, so nothing zeroes them first or rounds them after
  // (kInternal on a float32 backend).
  struct AttentionGrads {
    void* dq;
    void* dk;
    void* dv;
    DType dtype = DType::kF32;
  };
  // Self-attention over qkv[B, T, C + 2 KVH d]: the queries, then the keys,
  // then the values at every position (KVH = 0: NH, so rows of 3C).
  static AttentionInputs self_attention(ConstBuffer qkv, int B, int T, int C, int NH, int KVH = 0) {
    const auto* base = static_cast<const std::byte*>(qkv.data);
    const int kv = (KVH > 0 ? KVH : NH) * (C / NH), ld = C + 2 * kv;
    const size_t bytes = dtype_bytes(qkv.dtype);
    return {base, base + C * bytes, base + (C + kv) * bytes, ld, ld, B, T, T, C, NH, 0, 0, qkv.dtype, KVH};
  }
  // Their gradients, laid out alike; kv_width = KVH d (0: C).
  static AttentionGrads self_attention_grads(Buffer dqkv, int C, int kv_width = 0) {
    auto* base = static_cast<std::byte*>(dqkv.data);
    const size_t bytes = dtype_bytes(dqkv.dtype);
    const int kv = kv_width > 0 ? kv_width : C;
    return {base, base + C * bytes, base + (C + kv) * bytes, dqkv.dtype};
  }

  // ---- the kernels (backend_kernels.def: every kernel with its contract) ----
#define KEEL_BACKEND_KERNEL(ret, name, params, args) virtual ret name params = 0;
#include "trainer/kernels/backend_kernels.def"
#undef KEEL_BACKEND_KERNEL
};

}  // namespace keel::trainer
