// GPT-2 (docs/architecture.md "Model") with optional dropless top-k MoE blocks, written out
// layer by layer: forward() keeps every activation backward() needs, and
// backward() walks the same layers in reverse. There is no autograd.
//
// With a tensor-parallel group (docs/architecture.md "Parallel layout and communication", Megatron-style) every rank of
// it runs the same sequences on its slice of the weights: attention heads
// and MLP columns are split, the token embedding and the cross-entropy are
// split by vocabulary, and between the blocks the residual stream is split
// by position (sequence parallelism): each rank normalises its own rows,
// an all-gather assembles the whole sequence before a column-parallel
// linear, and a reduce-scatter sums a row-parallel linear's partial outputs
// straight into the position shards.
#pragma once

#include "common/config.h"
#include "trainer/comm/communicator.h"
#include "trainer/kernels/backend.h"
#include "trainer/kernels/arena.h"
#include "trainer/model/model_storage.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace keel::trainer {

class Gpt {
 public:
  // Runs on the parameters and gradients of `storage`, whose table is this
  // TP rank's slice of the model, for batches of up to max_batch sequences
  // of config.seq_len tokens. `tp` is the tensor-parallel group (nullptr:
  // none); MoE blocks run without one.
  Gpt(const common::ModelConfig& config, Backend& backend, int max_batch, ModelStorage& storage,
      Communicator* tp = nullptr);
  ~Gpt();
  // Places every activation (in the run's one Arena) before the first forward().
  void lay_out(Arena& arena);

  const common::ModelConfig& config() const { return config_; }
  const ParameterTable& table() const { return storage_.table(); }
  Backend& backend() { return backend_; }

  // Runs B sequences (host tokens, [B, seq_len] each) and returns the mean
  // cross-entropy. aux_loss() then holds the MoE load-balancing loss.
  float forward(const int32_t* inputs, const int32_t* targets, int B);
  float aux_loss() const { return aux_loss_; }

  // Accumulates the gradient of loss_scale * (cross-entropy + aux loss) of
  // the last forward() into the storage's gradients. Overwrites logits().
  void backward(float loss_scale);

  // [B, seq_len, this rank's vocabulary slice] after forward(), in backend memory.
  const float* logits() const;

  // `hook` (nullptr: none) sees activations of every forward(), which it
  // may change (fault injection flips a bit there, and the SDC guard sums
  // the squares of the last two; docs/architecture.md "Health"): site
  // i < n_layer is the output of block i, this rank's [N/tp, C] shard of
  // the residual stream that the next block reads; site n_layer is the
  // logits, [N, this rank's vocabulary slice].
  using ActivationHook = std::function<void(int site, float* data, size_t numel)>;
  void on_activation(ActivationHook hook) { activation_hook_ = std::move(hook); }

 private:
  struct Activations;
  struct MoeLayer;

  void moe_forward(int layer, const float* p, const float* inp, float* out, int N);
  void moe_backward(int layer, const float* p, float* g, float* dinp, const float* dout, float loss_scale, int N);
  // Sequence parallelism: the position shards of all TP ranks into one
  // [N, C] buffer, and the sum of the ranks' [N, C] partials into this
  // rank's shard. Both do nothing without TP, where the callers pass the
  // shard itself for the whole.
  void gather_positions(const float* shard, float* whole, size_t shard_numel);
  void sum_into_positions(const float* partial, float* shard, size_t shard_numel);

  common::ModelConfig config_;
  Backend& backend_;
  ModelStorage& storage_;
  Communicator* tp_;
  int tp_rank_;
  int tp_size_;
  int max_batch_;
  std::unique_ptr<Activations> acts_;
  int batch_ = 0;  // B of the last forward()
  float aux_loss_ = 0.0f;
  ActivationHook activation_hook_;
};

}  // namespace keel::trainer
