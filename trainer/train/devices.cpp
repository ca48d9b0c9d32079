#include "trainer/train/devices.h"

#include "common/error.h"
#include "trainer/comm/gloo_communicator.h"
#include "trainer/kernels/cpu_backend.h"

#ifdef KEEL_HAVE_CUDA
#include "trainer/comm/nccl_communicator.h"
#include "trainer/kernels/cuda/cuda_backend.h"
#endif

#include <fmt/format.h>

namespace keel::trainer {

using common::Error;
using common::ErrorCode;

std::unique_ptr<Backend> make_backend(const common::TrainConfig& train) {
  const DType gemm_inputs = train.gemm_precision() == "bf16" ? DType::kBF16 : DType::kF32;
  if (train.device == "cpu") return std::make_unique<CpuBackend>(static_cast<int>(train.threads), gemm_inputs);
#ifdef KEEL_HAVE_CUDA
  std::string why;
  const cudaError_t status = cuda::device_status(&why);
  if (status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver) {
    throw Error(ErrorCode::kBadConfig,
                fmt::format("train.device = \"cuda\" but no GPU can be used ({}); set train.device = \"cpu\" or run "
                            "on a machine with a GPU",
                            why));
  }
  if (status != cudaSuccess) {
    // A GPU that is there but failed (still held by the last generation,
    // an Xid, an ECC error) may work again: an internal error, which keeld
    // restarts, not a config one, which ends the job.
    throw Error(ErrorCode::kInternal, fmt::format("the GPU failed to start: {}", why));
  }
  return std::make_unique<cuda::CudaBackend>(0, gemm_inputs);
#else
  throw Error(ErrorCode::kBadConfig, "train.device = \"cuda\" but this keel-trainer was built without CUDA "
                                     "(no nvcc at build time); set train.device = \"cpu\" or rebuild with the "
                                     "CUDA toolkit");
#endif
}

std::unique_ptr<Communicator> join_group(Backend& backend, store::Store& store, const std::string& name, int rank,
                                         int size, std::chrono::milliseconds timeout,
                                         std::shared_ptr<FlightRecorder> recorder,
                                         const std::string& rank_failed_key, const std::string& bind_address) {
  if (backend.host_memory()) {
    return std::make_unique<GlooCommunicator>(store, name, rank, size, timeout, std::move(recorder), rank_failed_key,
                                              bind_address);
  }
#ifdef KEEL_HAVE_CUDA
  if (auto* gpu = dynamic_cast<cuda::CudaBackend*>(&backend)) {
    return std::make_unique<NcclCommunicator>(store, name, rank, size, gpu->device(), timeout, std::move(recorder));
  }
#endif
  throw Error(ErrorCode::kInternal, fmt::format("no communicator moves the memory of backend {}", backend.name()));
}

}  // namespace keel::trainer
