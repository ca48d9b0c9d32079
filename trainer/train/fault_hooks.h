// The trainer's side of fault injection (docs/architecture.md "Health"):
// where a fault the FaultInjector calls for meets the model's memory and
// the checkpoint files. Inert when [faults] configures nothing: each hook
// asks the injector and returns.
#pragma once

#include "checkpoint/file_system.h"
#include "common/config.h"
#include "health/fault_injector.h"
#include "trainer/kernels/backend.h"
#include "trainer/kernels/backend_wrapper.h"
#include "trainer/optim/adamw.h"
#include "trainer/parallel/zero_storage.h"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string_view>
#include <vector>

namespace keel::trainer {

// Flips the bit due now on `target` (FaultInjector::bitflip over `sites`)
// when `where(site)` says where that site's elements are in backend memory
// at this moment; a null buffer: not reachable here (another unit's gradients,
// another block's output), so nothing flips and the flip stays due.
void flip_if_due(Backend& backend, const health::FaultInjector& faults, std::string_view target,
                 const std::vector<health::FaultInjector::Site>& sites,
                 const std::function<Buffer(size_t site)>& where);

// Flips bit `bit` of element `index` of `data` in backend memory, the bit
// numbered as in a float32 (a bf16 element holds bits 16-31 of one; a
// lower bit flips its lowest, bit 16). Returns the element before and
// after, and the bit it flipped.
struct FlippedBit {
  float before = 0, after = 0;
  int bit = 0;
};
FlippedBit flip_bit(Backend& backend, Buffer data, size_t index, int bit);

// The faults a training step meets (the Step calls these hooks): a bit
// flipped in a gradient as backward hands its unit over, in an activation
// as forward makes it, or in the parameters and Adam moments after the
// update; a NaN in the step's first gradients ([faults] nan_target =
// "gradient").
class StepFaults {
 public:
  // The flip sites of this rank: the stage's tensors (whole, and the part
  // it owns) and activations (each block's output shard, then the logits
  // on the last stage), for microbatches of `micro_batch` sequences.
  // Error(kBadConfig) when faults.bitflip_tensor names no tensor (or
  // activation) of the whole model.
  StepFaults(const common::Config& config, const health::FaultInjector& faults, const ZeroStorage& storage,
             int micro_batch);

  // Whether the next gradients handed over get a NaN in their first element.
  void poison_next_gradients(bool poison) { poison_gradient_ = poison; }
  // Unit `unit`'s gradients, numel floats at `grads`, as backward hands them over.
  void on_gradients(Backend& backend, int unit, float* grads, size_t numel);
  // Gpt's activation site `site` (Gpt::ActivationHook) at `data`.
  void on_activation(Backend& backend, int site, Buffer data);
  // After the update: the parameters (this rank's copy, after ZeRO's
  // all-gather) and the Adam moments it owns.
  void after_update(Backend& backend, ZeroStorage& storage, AdamW& optimizer);

 private:
  const health::FaultInjector& faults_;
  const ParameterTable& table_;
  int64_t n_layer_;
  bool poison_gradient_ = false;
  std::vector<health::FaultInjector::Site> tensor_sites_, owned_sites_, activation_sites_;
};

// checkpoint_fault, as a file system under the checkpointer (passed as
// CheckpointerOptions::fs): this rank's file of the chosen checkpoint
// fails, as a real disk would fail it.
//   disk_full    its up-front reservation fails with ENOSPC, before HDF5
//                writes anything (the "no room" path);
//   write_error  the reservation made once the HDF5 skeleton is on disk
//                fails with EIO, with the file half written;
//   corrupt      the file is written and its checksum taken, then one byte
//                in its middle flips (written() does it), so the checkpoint
//                commits and only a full verify finds it.
class CheckpointFaults final : public checkpoint::FileSystemWrapper {
 public:
  CheckpointFaults(checkpoint::FileSystem& target, const health::FaultInjector& faults);

  void reserve(const std::filesystem::path& file, uint64_t bytes) override;
  // On the writer thread, once this rank's file of checkpoint `step` is
  // written and checksummed and before it is reported.
  void written(int64_t step);

 private:
  const health::FaultInjector& faults_;
  std::mutex mutex_;
  std::filesystem::path last_file_;  // the rank file reserved last, and its step
  int64_t last_step_ = -1;
};

// bitflip_target = "blas_core" (FaultInjector::breaks_blas_core): the
// backend the known-answer test proves a BLAS core on, with the lowest bit
// of the first output of every matmul_forward flipped, the smallest wrong
// answer a GEMM kernel can give.
class GemmBitFlip final : public BackendWrapper {
 public:
  using BackendWrapper::BackendWrapper;
  void matmul_forward(Buffer out, ConstBuffer inp, ConstBuffer weight, ConstBuffer bias, int N, int C, int OC) override;
};

}  // namespace keel::trainer
