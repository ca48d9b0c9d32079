// Where the model's parameters and gradients live while it runs
// (docs/architecture.md "Parallel layout and communication"). Gpt asks for a unit's parameters right before it uses them
// and hands back a unit's gradients as soon as its backward is complete, in
// the units of ParameterTable. That is all ZeRO needs: ZeRO-3 gathers a
// unit's parameters a unit ahead, ZeRO-2 reduce-scatters its gradients
// while the units below it are still running backward, and a replicated
// model simply points into its flat buffers.
#pragma once

#include "trainer/params/parameters.h"

namespace keel::trainer {

class ModelStorage {
 public:
  virtual ~ModelStorage() = default;

  virtual const ParameterTable& table() const = 0;

  // The parameters of `unit`, laid out like the flat buffer from
  // table().unit_begin(unit): tensor t is at result + offset - unit_begin.
  // A block's parameters stay valid until another block is acquired (the
  // storage may reuse one buffer for all blocks); unit 0's until the
  // optimizer changes the parameters.
  virtual const float* acquire_parameters(int unit) = 0;
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
