// The CUDA backend's memory, streams and reductions; the kernels live in
// one file per family beside this one (elementwise, rows, layernorm,
// matmul, attention, softmax).
#include "trainer/kernels/cuda/cuda_backend.h"

#include "trainer/kernels/cuda/cublaslt_gemm.h"
#include "trainer/kernels/cuda/launch.cuh"

#include "common/log.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <vector>

namespace keel::trainer::cuda {
namespace {

// sum and sum_squares reduce chunks of this many elements to double
// partials, then add the partials in order on the host: the order depends
// on n only, as on the CPU backend.
constexpr size_t kReduceChunk = size_t{1} << 16;

size_t chunks_of(size_t n) { return (n + kReduceChunk - 1) / kReduceChunk; }

// The sum of chunk `chunk` of x[0, n) (of its squares with `squares`), by
// the block: every thread must call.
template <typename T> __device__ double chunk_sum(const T* x, size_t n, size_t chunk, bool squares) {
  const size_t begin = chunk * kReduceChunk;
  const size_t end = begin + kReduceChunk < n ? begin + kReduceChunk : n;
  const size_t first = begin + threadIdx.x;
  const size_t count = first < end ? (end - first + blockDim.x - 1) / blockDim.x : 0;
  return block_sum(add_in_order(0.0, x + first, count, blockDim.x, squares));
}

template <typename T> __global__ void chunk_sums_kernel(double* partials, const T* x, size_t n, bool squares) {
  const double acc = chunk_sum(x, n, blockIdx.x, squares);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// Up to kMax spans for one launch of span_squares_kernel, passed by value
// (kernel parameters, about 1.3 KB): a block sums a chunk of its span.
struct SpanBatch {
  static constexpr int kMax = 64;
  const float* data[kMax];
  size_t numel[kMax];
  BlockSplit<kMax> split;
};

// Each chunk of each span as chunk_sums_kernel sums it, so a span's
// partials are bit for bit those of queue_sum_squares.
__global__ void span_squares_kernel(double* partials, SpanBatch batch) {
  const int s = batch.split.span();
  const double acc = chunk_sum(batch.data[s], batch.numel[s], batch.split.chunk(s), true);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// Rows a warp brings into shared memory at a time.
constexpr int kStagedRows = 256;

// A warp per column: its lanes load the column's rows together, then lane
// 0 adds them in row order from shared memory. With a thread per column
// (3 blocks for a 768-wide bias) the loads came one latency after
// another: the H200 profile of 6ef341d had the bias gradients' adds at 18
// us a call, 0.87 ms a step, and 084b7bf's had the LayerNorms' (then
// still a thread a column) among 1.6 ms of column sums.
template <typename T>
__global__ void column_sum_kernel(float* dst, const T* src, int rows, int cols) {
  __shared__ double staged[kThreads / kWarp][kStagedRows];
  const size_t c = global_warp();
  if (c >= static_cast<size_t>(cols)) return;  // the whole warp: lanes share c
  double* mine = staged[threadIdx.x / kWarp];
  double total = 0.0;
  for (int r0 = 0; r0 < rows; r0 += kStagedRows) {
    const int n = min(kStagedRows, rows - r0);
    for (int r = lane(); r < n; r += kWarp) mine[r] = src[static_cast<size_t>(r0 + r) * cols + c];
    __syncwarp();
    if (lane() == 0) total = add_in_order(total, mine, static_cast<size_t>(n), 1);
    __syncwarp();  // lane 0 is done before the next rows overwrite these
  }
  if (lane() == 0) dst[c] += static_cast<float>(total);
}

template <typename T>
void launch_column_sum(float* dst, const T* src, int rows, int cols, cudaStream_t stream) {
  if (cols <= 0) return;
  column_sum_kernel<<<grid_for_warps(static_cast<size_t>(cols)), kThreads, 0, stream>>>(dst, src, rows, cols);
  check_launch("column_sum_accumulate");
}

}  // namespace

cudaError_t device_status(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it so later calls do not report it again
    if (why != nullptr) *why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
    return err;
  }
  if (count == 0) {
    if (why != nullptr) *why = "no CUDA device";
    return cudaErrorNoDevice;
  }
  return cudaSuccess;
}

void column_sum_accumulate(float* dst, const float* src, int rows, int cols, cudaStream_t stream) {
  launch_column_sum(dst, src, rows, cols, stream);
}
void column_sum_accumulate(float* dst, const double* src, int rows, int cols, cudaStream_t stream) {
  launch_column_sum(dst, src, rows, cols, stream);
}

CudaBackend::CudaBackend(int device, DType gemm_inputs) : device_(device), gemm_inputs_(gemm_inputs) {
  std::string why;
  if (!device_available(&why)) throw common::Error(common::ErrorCode::kInternal, "no usable CUDA device: " + why);
  check(cudaSetDevice(device), "cudaSetDevice");
  stream_ = CudaStream::create();
  copy_stream_ = CudaStream::create();
  gemm_ = std::make_unique<CublasLtGemm>();
  // Pinned here, not in a first step: page-locking can synchronise.
  for (UploadSlot& slot : upload_slots_) {
    check(cudaMallocHost(&slot.pinned, kQueuedUploadBytes), "cudaMallocHost (upload staging)");
    check(cudaEventCreateWithFlags(&slot.copied, cudaEventDisableTiming), "cudaEventCreate (upload staging)");
  }
}

CudaBackend::~CudaBackend() {
  // Kernels still queued may use the scratch memory.
  cudaStreamSynchronize(stream_->get());
  cudaFree(linear_out_);
  cudaFree(scratch_);
  cudaFree(queued_partials_);
  for (UploadSlot& slot : upload_slots_) {
    cudaFreeHost(slot.pinned);
    if (slot.copied != nullptr) cudaEventDestroy(slot.copied);
  }
}

// ---- memory ----

void* CudaBackend::alloc(size_t bytes) {
  void* ptr = nullptr;
  bytes = bytes == 0 ? 1 : bytes;  // a distinct pointer, as aligned_alloc gives
  const cudaError_t err = cudaMalloc(&ptr, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    throw common::Error(common::ErrorCode::kInternal,
                        fmt::format("out of device memory allocating {:.1f} MiB on GPU {}; shrink train.batch_size or "
                                    "model.seq_len, or add GPUs",
                                    static_cast<double>(bytes) / (1 << 20), device_));
  }
  check(err, "cudaMalloc");
  // The contract promises zeros. cudaMemset would run on the legacy
  // default stream, which a non-blocking stream does not wait for, so the
  // zeroing goes on the compute stream and alloc waits for it: the memory
  // is ready for any stream when alloc returns.
  check(cudaMemsetAsync(ptr, 0, bytes, stream()), "cudaMemsetAsync");
  stream_->synchronize();
  return ptr;
}

void CudaBackend::free(void* ptr) {
  // Kernels still queued may use the memory; CUDA does not promise that
  // cudaFree waits for them in every case.
  stream_->synchronize();
  cudaFree(ptr);
}

void CudaBackend::zero(void* ptr, size_t bytes) {
  if (bytes == 0) return;
  check(cudaMemsetAsync(ptr, 0, bytes, stream()), "cudaMemsetAsync");
}

void CudaBackend::copy_from_host(void* dst, const void* host_src, size_t bytes) {
  if (bytes == 0) return;
  // The caller may reuse host_src as soon as this returns: a small copy
  // is taken into a pinned slot first and queued from there.
  if (bytes <= kQueuedUploadBytes) {
    UploadSlot& slot = upload_slots_[next_upload_++ % upload_slots_.size()];
    check(cudaEventSynchronize(slot.copied), "cudaEventSynchronize (upload staging)");
    std::memcpy(slot.pinned, host_src, bytes);
    check(cudaMemcpyAsync(dst, slot.pinned, bytes, cudaMemcpyHostToDevice, stream()), "cudaMemcpyAsync to device");
    check(cudaEventRecord(slot.copied, stream()), "cudaEventRecord (upload staging)");
    return;
  }
  check(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream()), "cudaMemcpyAsync to device");
  stream_->synchronize();
}

void CudaBackend::copy_to_host(void* host_dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  check(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream()), "cudaMemcpyAsync to host");
  stream_->synchronize();
}

void CudaBackend::copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream()), "cudaMemcpyAsync on device");
}

void CudaBackend::pin_host(void* data, size_t bytes) {
  const cudaError_t err = cudaHostRegister(data, bytes, cudaHostRegisterDefault);
  if (err != cudaSuccess) {
    // Pageable memory still copies, through the driver's bounce buffer:
    // slower, never wrong.
    cudaGetLastError();
    common::logger("kernels")->warn("could not pin {:.1f} MiB of host staging memory ({}): checkpoint snapshots "
                                    "copy from the GPU at pageable speed",
                                    static_cast<double>(bytes) / (1 << 20), cudaGetErrorString(err));
  }
}

void CudaBackend::unpin_host(void* data) {
  // Memory pin_host could not pin is not registered: nothing to undo.
  if (cudaHostUnregister(data) != cudaSuccess) cudaGetLastError();
}

void CudaBackend::snapshot_to_host(const std::vector<HostCopy>& copies) {
  copy_stream_->wait(*stream_->record());
  for (const HostCopy& c : copies) {
    if (c.bytes == 0) continue;
    check(cudaMemcpyAsync(c.host, c.src, c.bytes, cudaMemcpyDeviceToHost, copy_stream_->get()),
          "cudaMemcpyAsync (snapshot)");
  }
  copy_stream_->synchronize();
}

size_t CudaBackend::scratch_bytes() const {
  return scratch_bytes_ + linear_out_bytes_ + queued_capacity_ * sizeof(double) + CublasLtGemm::kWorkspaceBytes;
}

void* CudaBackend::scratch(size_t bytes) { return grown(scratch_, scratch_bytes_, bytes); }
void* CudaBackend::linear_out(size_t bytes) { return grown(linear_out_, linear_out_bytes_, bytes); }

void* CudaBackend::grown(void*& buffer, size_t& size, size_t bytes) {
  if (bytes > size) {
    // Queued kernels may still use the old memory.
    stream_->synchronize();
    cudaFree(buffer);
    buffer = nullptr;
    size = 0;
    check(cudaMalloc(&buffer, bytes), "cudaMalloc (scratch)");
    size = bytes;
  }
  return buffer;
}

// ---- reductions ----

double CudaBackend::chunked_sum(const float* x, size_t n, bool squares) {
  if (n == 0) return 0.0;
  const size_t chunks = chunks_of(n);
  auto* partials = static_cast<double*>(scratch(chunks * sizeof(double)));
  chunk_sums_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, stream()>>>(partials, x, n, squares);
  check_launch(squares ? "sum_squares" : "sum");
  std::vector<double> host(chunks);
  copy_to_host(host.data(), partials, chunks * sizeof(double));
  double total = 0.0;
  for (double p : host) total += p;
  return total;
}

double CudaBackend::sum_squares(const float* x, size_t n) { return chunked_sum(x, n, true); }

void CudaBackend::queue_chunk_sums(ConstBuffer x, size_t n, bool squares) {
  const size_t chunks = chunks_of(n);
  double* partials = queued_room(chunks);
  if (chunks > 0) {
    with_type<__nv_bfloat16>(x, [&](const auto* from) {
      chunk_sums_kernel<<<static_cast<unsigned>(chunks), kThreads, 0, stream()>>>(partials, from, n, squares);
    });
    check_launch(squares ? "queue_sum_squares" : "queue_sum");
  }
  queued_starts_.push_back(queued_starts_.back() + chunks);
}

void CudaBackend::queue_sum_squares(ConstBuffer x, size_t n) { queue_chunk_sums(x, n, true); }
void CudaBackend::queue_sum(const float* x, size_t n) { queue_chunk_sums(x, n, false); }

void CudaBackend::queue_sums_of_squares(const std::vector<FloatSpan>& spans) {
  for (size_t next = 0; next < spans.size();) {
    SpanBatch batch{};
    for (; next < spans.size() && !batch.split.full(); ++next) {
      const int s = batch.split.count;
      batch.data[s] = spans[next].data;
      batch.numel[s] = spans[next].numel;
      batch.split.add(chunks_of(spans[next].numel));
    }
    double* partials = queued_room(batch.split.blocks());
    if (batch.split.blocks() > 0) {
      span_squares_kernel<<<batch.split.blocks(), kThreads, 0, stream()>>>(partials, batch);
      check_launch("queue_sums_of_squares");
    }
    for (int s = 0; s < batch.split.count; ++s) queued_starts_.push_back(queued_starts_.back() + chunks_of(batch.numel[s]));
  }
}

double* CudaBackend::queued_room(size_t chunks) {
  if (queued_starts_.empty()) queued_starts_.push_back(0);
  const size_t begin = queued_starts_.back();
  if (begin + chunks > queued_capacity_) {
    // Grows (the first step only), keeping the partials queued so far.
    const size_t capacity = std::max(2 * queued_capacity_, begin + chunks);
    double* grown_partials = nullptr;
    check(cudaMalloc(&grown_partials, capacity * sizeof(double)), "cudaMalloc (queued sums)");
    stream_->synchronize();
    if (begin > 0) {
      check(cudaMemcpy(grown_partials, queued_partials_, begin * sizeof(double), cudaMemcpyDeviceToDevice),
            "cudaMemcpy (queued sums)");
    }
    cudaFree(queued_partials_);
    queued_partials_ = grown_partials;
    queued_capacity_ = capacity;
  }
  return queued_partials_ + begin;
}

std::vector<double> CudaBackend::take_queued_sums() {
  if (queued_starts_.empty()) return {};
  std::vector<double> host(queued_starts_.back());
  if (!host.empty()) copy_to_host(host.data(), queued_partials_, host.size() * sizeof(double));
  std::vector<double> sums;
  for (size_t i = 0; i + 1 < queued_starts_.size(); ++i) {
    double total = 0.0;  // as chunked_sum adds them
    for (size_t c = queued_starts_[i]; c < queued_starts_[i + 1]; ++c) total += host[c];
    sums.push_back(total);
  }
  queued_starts_.clear();
  return sums;
}

double CudaBackend::sum(const float* x, size_t n) { return chunked_sum(x, n, false); }

}  // namespace keel::trainer::cuda
