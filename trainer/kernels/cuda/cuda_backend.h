// The CUDA backend (docs/architecture.md "Kernels"): every kernel of
// backend.h on one device, on one non-blocking compute stream. The CPU
// backend is the reference it is tested against (tests/trainer/
// cuda_backend_test.cpp).
//
// * Precision: float32 arithmetic everywhere; the GEMMs' inputs are
//   float32 (no TF32: the CPU and GPU agree to float32 rounding) or, for
//   speed, bfloat16 on tensor cores (matmul.cu), and so are the arrays
//   the model keeps in their type (docs/architecture.md "Dtypes"). Either
//   way cuBLASLt accumulates in float32 (CUBLAS_COMPUTE_32F).
// * Determinism: always on. No kernel uses atomics; every reduction sums
//   in an order fixed by the shape; cuBLASLt runs one algorithm per shape
//   (cublaslt_gemm.h). The same inputs on the same GPU model give the same
//   bits, run after run.
// * Streams: kernels, zero() and copy() are queued on compute_stream() and
//   return at once, and so does a copy_from_host of up to
//   kQueuedUploadBytes (a microbatch's tokens: 32 KB at 124M, batch 8),
//   through a pinned staging slot, so that a forward does not wait for the
//   stream to upload its targets (the 084b7bf step waited there); it waits
//   only when its slot comes round again (eight uploads on, four
//   microbatches of a one-stage model) before the stream has run the
//   slot's last copy. copy_to_host, a larger copy_from_host,
//   sum and sum_squares wait for the stream: their host side is done when
//   they return.
//   snapshot_to_host runs on a copy stream of its own, after the compute
//   work queued before it; into pinned memory (pin_host: cudaHostRegister)
//   its copies are DMA at full bus speed, which is all the stall a
//   checkpoint costs training.
// * Errors: a CUDA or cuBLASLt failure throws common::Error with
//   ErrorCode::kInternal; a kernel that faults while running surfaces at the
//   next call that waits for the stream.
//
// Plain C++ can include this header: it needs only the CUDA runtime API's
// types.
#pragma once

#include "trainer/kernels/backend.h"
#include "trainer/kernels/cuda/cuda_stream.h"
#include "trainer/kernels/dtype.h"

#include <array>
#include <cstddef>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

namespace keel::trainer::cuda {

class CublasLtGemm;
enum class GemmInputs;

// cudaSuccess when a CUDA device can be used. Otherwise the error, and *why
// (if non-null) says it in words: cudaErrorNoDevice or
// cudaErrorInsufficientDriver when the machine has no usable GPU, anything
// else when one failed to start.
cudaError_t device_status(std::string* why);
inline bool device_available(std::string* why) { return device_status(why) == cudaSuccess; }

class CudaBackend final : public Backend {
 public:
  // Makes `device` current on the calling thread and creates the stream
  // and cuBLASLt state there. The backend must be used from threads whose
  // current device is `device` (one device per process is keel's layout:
  // keeld gives each rank one GPU through CUDA_VISIBLE_DEVICES).
  // gemm_inputs: what the GEMMs multiply, kF32 or kBF16.
  explicit CudaBackend(int device = 0, DType gemm_inputs = DType::kF32);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  const char* name() const override { return "cuda"; }
  int device() const { return device_; }
  DType gemm_inputs() const override { return gemm_inputs_; }
  cudaStream_t stream() const { return stream_->get(); }

  void* alloc(size_t bytes) override;
  void free(void* ptr) override;
  void zero(void* ptr, size_t bytes) override;
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  size_t scratch_bytes() const override;
  void pin_host(void* data, size_t bytes) override;
  void unpin_host(void* data) override;
  void snapshot_to_host(const std::vector<HostCopy>& copies) override;
  Stream& compute_stream() override { return *stream_; }

#define KEEL_BACKEND_KERNEL(ret, name, params, args) ret name params override;
#include "trainer/kernels/backend_kernels.def"
#undef KEEL_BACKEND_KERNEL

 private:
  // Device working memory of at least `bytes`, reused by every kernel that
  // needs partial results (they all run in order on the compute stream).
  // It only grows, so after the first step no kernel allocates.
  void* scratch(size_t bytes);
  // out = GELU'(pre) * grad, elementwise, rounded when out is bf16; out
  // may be grad itself (elementwise.cu): the last step of
  // matmul_backward_through_gelu.
  void gelu_derivative_times(Buffer out, const float* grad, ConstBuffer pre, size_t n);
  // out = in widened to float32, exactly (elementwise.cu).
  void widen_from_bf16(float* out, const bf16* in, size_t n);
  // A float32 GEMM output to be kept as bf16 (matmul_forward's where
  // cuBLASLt cannot write bf16 itself, matmul_backward_through_gelu's):
  // it must outlive the GEMM operands scratch holds meanwhile.
  void* linear_out(size_t bytes);
  // Grows `buffer` (of `size` bytes) to at least `bytes`.
  void* grown(void*& buffer, size_t& size, size_t bytes);
  // Sums of x or x^2 over fixed chunks, then of the chunks in order, on the host.
  double chunked_sum(const float* x, size_t n, bool squares);
  // Where the next queued sum's `chunks` partials go, queued_partials_
  // grown to hold them (keeping those queued before).
  double* queued_room(size_t chunks);
  // chunked_sum's partials of x or x^2 queued, for take_queued_sums.
  void queue_chunk_sums(ConstBuffer x, size_t n, bool squares);
  // The GEMM operands as the GEMMs take them: the pointers themselves (a
  // bf16 operand, or any with float32 GEMM inputs), or bf16 copies in
  // scratch (a null operand stays null). matmul.cu.
  struct Operand {
    ConstBuffer data;
    size_t count;
  };
  std::vector<const void*> gemm_operands(std::initializer_list<Operand> operands);
  // How the GEMMs take those operands (cublaslt_gemm.h). matmul.cu.
  GemmInputs gemm_type() const;
  // out[rows[m] - row_offset, :] += weights[m] * inp[m, :] for m < M, in
  // increasing m for each destination row, skipping rows outside
  // [0, limit) (weights nullable: 1): the embedding's backward over a
  // vocabulary shard and the MoE combine. rows.cu.
  void scatter_columns(float* out, const float* inp, const int32_t* rows, int row_offset, int limit,
                       const float* weights, int M, int C);

  int device_;
  DType gemm_inputs_;
  std::unique_ptr<CudaStream> stream_;
  std::unique_ptr<CudaStream> copy_stream_;
  std::unique_ptr<CublasLtGemm> gemm_;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  void* linear_out_ = nullptr;
  size_t linear_out_bytes_ = 0;
  // queue_sum_squares: every queued sum's chunk partials side by side, and
  // where each sum's run of them starts.
  double* queued_partials_ = nullptr;
  size_t queued_capacity_ = 0;  // partials
  std::vector<size_t> queued_starts_;  // one per sum, then the end
  // copy_from_host's staging for small copies, used in turn: a slot is
  // reused once the stream has run the copy out of it (its event), which
  // the uploads between give the stream time to.
  struct UploadSlot {
    void* pinned = nullptr;  // kQueuedUploadBytes, cudaMallocHost
    cudaEvent_t copied = nullptr;
  };
  std::array<UploadSlot, 8> upload_slots_;
  size_t next_upload_ = 0;
};

}  // namespace keel::trainer::cuda
