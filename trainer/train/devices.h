// What `[train] device` selects (docs/architecture.md "Kernels"): the
// backend that runs the model, and the communicator that can move that
// backend's memory. The one place that knows which backends this build has.
#pragma once

#include "common/config.h"
#include "store/store.h"
#include "trainer/comm/communicator.h"
#include "trainer/comm/flight_recorder.h"
#include "trainer/kernels/backend.h"

#include <chrono>
#include <memory>
#include <string>

namespace keel::trainer {

// "cpu": CpuBackend on train.threads threads. "cuda": CudaBackend on the
// process's first visible GPU (keeld narrows CUDA_VISIBLE_DEVICES to one
// GPU per rank). A build without CUDA, or a machine without a GPU or with
// too old a driver, is a kBadConfig error that says so; a GPU that fails
// to start is kInternal, which keeld retries.
std::unique_ptr<Backend> make_backend(const common::TrainConfig& train);

// Joins one process group of `size` ranks as `rank`: Gloo for a backend
// in host memory, NCCL for device memory. `rank_failed_key` is where the
// Store says a peer failed (Gloo watches it; NCCL sees failures itself).
// Gloo binds `bind_address`, the node's address (KEEL_BIND_ADDRESS).
std::unique_ptr<Communicator> join_group(Backend& backend, store::Store& store, const std::string& name, int rank,
                                         int size, std::chrono::milliseconds timeout,
                                         std::shared_ptr<FlightRecorder> recorder, const std::string& rank_failed_key,
                                         const std::string& bind_address);

}  // namespace keel::trainer
