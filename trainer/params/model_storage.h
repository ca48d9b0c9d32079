// Where the model's parameters and gradients live while it runs
// (docs/architecture.md "Parallel layout and communication"). Gpt asks for a unit's parameters right before it uses
// them and hands back a unit's gradients as soon as its backward is complete, in the units of ParameterTable. That is
// all ZeRO needs: ZeRO-3 gathers a unit's parameters a unit ahead, ZeRO-2 reduce-scatters its gradients while the units
// below it are still running backward, and a replicated model simply points into its flat buffers.
#pragma once

#include "trainer/kernels/dtype.h"
#include "trainer/params/parameters.h"

namespace keel::trainer {

// One unit's parameters, laid out like the flat buffer from
// table().unit_begin(unit): tensor t at offset - unit_begin.
struct UnitParameters {
  const float* f32 = nullptr;  // the float32 master values
  // The same values rounded to bf16 for the GEMMs, made once after the
  // parameters change rather than at every GEMM that multiplies them
  // (docs/architecture.md "GPU step"); null where the GEMMs take float32.
  const bf16* gemm = nullptr;

  // The tensor at `offset` as the norms, the embedding and the bias adds
  // read it; null for kNoTensor.
  const float* at(size_t offset) const { return offset == kNoTensor ? nullptr : f32 + offset; }
  // The weight at `offset` as a GEMM multiplies it.
  ConstBuffer weight(size_t offset) const {
    return gemm != nullptr ? ConstBuffer(gemm + offset) : ConstBuffer(f32 + offset);
  }
  // The bias at `offset` as a linear writing `out` adds it: the GEMM copy
  // into a bf16 output, as torch's autocast adds a bf16 bias (and cuBLASLt
  // can then write the output itself), the float32 master otherwise.
  ConstBuffer bias(size_t offset, Buffer out) const {
    if (offset == kNoTensor) return nullptr;
    return gemm != nullptr && out.dtype == DType::kBF16 ? ConstBuffer(gemm + offset) : ConstBuffer(f32 + offset);
  }
};

class ModelStorage {
 public:
  virtual ~ModelStorage() = default;

  virtual const ParameterTable& table() const = 0;

  // The parameters of `unit`. A block's stay valid until another block is
  // acquired (the storage may reuse one buffer for all blocks); unit 0's
  // until the optimizer changes the parameters.
  virtual UnitParameters acquire_parameters(int unit) = 0;
  // A hint that `unit` is acquired next: a storage that fetches parameters
  // may start fetching them now, while the model computes.
  virtual void prefetch_parameters(int unit) { (void)unit; }

  // Where backward accumulates the gradients of `unit` (same layout as
  // acquire_parameters), valid until gradients_ready(unit). Backward walks
  // the blocks top down and holds unit 0 throughout.
  virtual float* unit_gradients(int unit) = 0;
  // Every gradient of `unit` for the current microbatch is in place.
  virtual void gradients_ready(int unit) = 0;
};

}  // namespace keel::trainer
