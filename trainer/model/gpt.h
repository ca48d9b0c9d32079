// GPT-2 (docs/architecture.md "Model") with optional dropless top-k MoE blocks, written out
// layer by layer: forward() keeps every activation backward() needs, and
// backward() walks the same layers in reverse. There is no autograd.
//
// With a pipeline (docs/architecture.md "Pipeline parallelism") a rank
// runs one stage: a range of blocks, the embedding if it is the first and
// the head and loss if it is the last, and keeps the activations of each
// microbatch in flight in a slot of its own.
//
// With context parallelism (docs/architecture.md "Context parallelism")
// the ranks of a CP group run the same sequences, each its ContextSplit
// share of their positions, and attention passes queries' keys and values
// around the group as a ring.
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
#include "trainer/params/model_storage.h"
#include "trainer/parallel/context_split.h"
#include "trainer/parallel/process_groups.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace keel::trainer {

class Gpt {
 public:
  // Runs the chunks of pipeline stage storage.table().stage() (the whole
  // model with one stage) on the parameters and gradients of `storage`,
  // whose table is this TP and EP rank's slice of that stage, for batches
  // of up to max_batch sequences of config.seq_len tokens, with `slots`
  // passes (a microbatch through a chunk) in flight at once, each keeping
  // its activations until its backward. It talks to the TP, CP and EP
  // groups of `groups`. With `split_backward` (zero-bubble schedules) a
  // slot also keeps what weight_gradients() reads.
  Gpt(const common::ModelConfig& config, Backend& backend, int max_batch, ModelStorage& storage,
      const ProcessGroups& groups = ProcessGroups::none(), int slots = 1, bool split_backward = false);
  ~Gpt();
  // Places every activation (in the run's one Arena) before the first forward().
  void lay_out(Arena& arena);

  const common::ModelConfig& config() const { return config_; }
  const ParameterTable& table() const { return storage_.table(); }
  const ModelStage& stage() const { return storage_.table().stage(); }
  Backend& backend() { return backend_; }
  int slots() const;

  // Runs chunk `chunk` of this stage (ModelStage: one without
  // interleaving) on B sequences into activation slot `slot`: the first
  // virtual stage embeds `inputs` (host tokens, [B, seq_len]), the others
  // start from stage_input(slot); the last virtual stage scores `targets`
  // (host tokens, [B, seq_len]) for loss(slot), the others leave
  // stage_output(slot). With CP each rank takes its own positions of the
  // sequences. Either
  // token pointer may be null where it is not read. aux_loss() then holds
  // the chunk's MoE load-balancing loss. `backward_scale`, when the pass
  // will be back-propagated, is the loss_scale its backward() will be
  // given: a rank that holds the whole vocabulary then writes the loss's
  // gradient over the logits as it scores them (one kernel instead of
  // two; Backend::crossentropy_and_gradient).
  void forward(const int32_t* inputs, const int32_t* targets, int B, int slot = 0, int chunk = 0,
               std::optional<float> backward_scale = std::nullopt);
  float aux_loss() const { return aux_loss_; }
  // The mean cross-entropy over this rank's positions of slot's forward (0
  // off the scoring stage), before its backward frees the slot; waits for
  // the device.
  float loss(int slot = 0);
  // loss(slot) without waiting: queues the sum of the positions' losses on
  // the backend (Backend::queue_sum) and returns how many positions it
  // sums, loss(slot) being static_cast<float>(sum / positions); nothing
  // is queued and 0 returned off the scoring stage.
  int queue_loss(int slot = 0);

  // Accumulates the gradient of loss_scale * (cross-entropy + aux loss) of
  // the forward in `slot` into the storage's gradients and frees the slot.
  // A virtual stage other than the last starts from output_gradient(slot);
  // one other than the first leaves input_gradient(). Overwrites logits(slot)
  // (unless the forward did, with the same loss_scale as its backward_scale).
  // With `weights` false (split_backward) it computes the input gradients
  // alone and the slot stays taken until weight_gradients(slot).
  void backward(float loss_scale, int slot = 0, bool weights = true);
  // The weight gradients of a backward(..., weights = false) of `slot`,
  // accumulated and handed over unit by unit as backward() would have; frees
  // the slot. Bit for bit what the whole backward gives, and no
  // communication: a zero-bubble schedule runs it while transfers are in
  // flight.
  void weight_gradients(int slot);

  // The residual stream where stages meet: this rank's [B*T/tp, C] shard
  // of positions (T = seq_len/cp), in backend memory. boundary_numel(B) floats each.
  size_t boundary_numel(int B) const;
  // Of the pass in `slot`, where the virtual stage before or after exists:
  float* stage_input(int slot);               // the previous virtual stage's output
  const float* stage_output(int slot) const;  // its chunk's last block's output
  float* output_gradient(int slot);           // that output's gradient, from the next virtual stage
  const float* input_gradient() const;        // after backward(): stage_input's gradient

  // Per MoE block of the last forward of `slot`, in order: its layer and
  // the tokens the router sent to each expert, over the whole microbatch
  // (every dp x cp rank's share), counting each of a token's k choices.
  struct ExpertTokens {
    int64_t layer;
    std::vector<double> tokens;
  };
  std::vector<ExpertTokens> expert_tokens(int slot = 0) const;

  // [B, seq_len/cp, this rank's vocabulary slice] after forward() on the
  // last stage, in backend memory (with CP in ContextSplit's order), in the
  // GEMMs' input type (bf16 where they take bf16, as torch's autocast
  // keeps them); their gradient instead after a forward given a
  // backward_scale, or after backward().
  ConstBuffer logits(int slot = 0) const;

  // `hook` (nullptr: none) sees activations of every forward(), which it
  // may change (fault injection flips a bit there, and the SDC guard sums
  // the squares of the last two; docs/architecture.md "Health"): site
  // i < n_layer is the output of block i (on the stage that runs it), this
  // rank's [N/tp, C] shard of the residual stream that the next block
  // reads; site n_layer is the logits (last stage), [N, this rank's
  // vocabulary slice], in logits()' type.
  using ActivationHook = std::function<void(int site, Buffer data, size_t numel)>;
  void on_activation(ActivationHook hook) { activation_hook_ = std::move(hook); }

 private:
  struct Slot;
  struct Scratch;
  struct MoeLayer;
  struct Sizes;
  struct WeightTerm;
  struct BackwardPass;
  Sizes sizes() const;
  const ModelParts& parts() const;
  // The blocks' and the final norm (LayerNorm or RMSNorm, its eps).
  RowNorm row_norm() const;
  // The MLP's activation of pre [rows, Fin] into out [rows, Fl]: GELU, or
  // SwiGLU of the packed gate and up.
  void activation_forward(Buffer out, ConstBuffer pre, int rows);
  // Its backward into dpre [rows, Fin], which holds zeros, from dact.
  void activation_backward(float* dpre, ConstBuffer pre, const float* dact, int rows);
  // Rotary positions (where the model has them) on the queries and keys of
  // qkv [N, W], each row by its global position; with `backward`, their
  // gradients in dqkv turned back.
  void rotate_queries_and_keys(Buffer qkv, int B, bool backward);

  // Block `block` of the stage (its index among the stage's blocks) on the
  // pass in `s`, from the residual stream `residual`: the attention branch,
  // then the MLP (or MoE) branch, each added to the stream; returns the
  // block's output.
  const float* block_forward(Slot& s, int block, const float* residual);
  // Its backward: from the gradient of its output in the scratch dresidual
  // to that of its input there, the branches in reverse.
  void block_backward(const BackwardPass& pass, int block);
  // Whether the stage's block `block` is an MoE block.
  bool is_moe(int block) const;
  // The rounded copy of dresidual the backward writes for the linear that
  // reads it next where that is the dense MLP of `block` (null for MoE).
  bf16* rounded_for_mlp(const BackwardPass& pass, int block) const;
  // A row-parallel linear's output: the scratch partial sums, to be
  // reduce-scattered into `shard`, with TP; `shard` itself without.
  float* partial_or(ArenaArray<float>& shard);

  // Attention of B sequences' queries in qkv [N, W] over every key they
  // see, into out [N, Cl] and lse; with CP the ranks pass their q, k and v
  // around the group and merge what each chunk of keys gives.
  // qkv and out are in the GEMMs' input type without CP, float32 with it
  // (the ring carries float32 keys and merges float32 outputs).
  void attend(ConstBuffer qkv, Buffer out, float* lse, int B);
  // Its gradient from the scratch datty into the scratch dqkv.
  void attend_backward(ConstBuffer qkv, ConstBuffer out, const float* lse, int B);
  // This rank's k and v of qkv [N, W], packed as [N, 2KVl] into the
  // ring's first buffer: what travels around the ring.
  const float* packed_keys(const float* qkv, int B);
  // Calls visit(query chunk, key chunk, inputs) for each pair of this
  // rank's query chunks in qkv and CP rank owner's key chunks in `held`
  // that the causal mask does not hide entirely; `held` is qkv rows
  // [N, W] or, `packed`, k and v rows [N, 2KVl].
  void visible_pairs(const float* qkv, const float* held, bool packed, int owner, int B,
                     const std::function<void(int, int, const Backend::AttentionInputs&)>& visit);
  void moe_forward(Slot& slot, int block, const UnitParameters& p, const float* inp, float* out, int N);
  // The expert side's segments of a forward whose slots per expert are
  // `count`, and under EP the slots sent to and received from each EP rank.
  void plan_dispatch(MoeLayer& moe, const std::vector<int>& count);
  // all_to_all_v over EP of rows of `width` floats: in_rows[q] rows to EP
  // rank q, out_rows[q] from it.
  void exchange_rows(const float* in, const std::vector<size_t>& in_rows, float* out,
                     const std::vector<size_t>& out_rows, int width);
  // The embedding's gradients (unit 0's wte and wpe, g0) from the gradient
  // of its output, dout_all [N, C] of all positions.
  void embedding_backward(float* g0, const float* dout_all, const int32_t* inputs, int B);
  void moe_backward(Slot& slot, int block, const UnitParameters& p, bool weights, float* dinp, const float* dout,
                    float loss_scale, int N);
  // Backward's weight term `t` (gpt_state.h), with the input gradient
  // into `dinp` (nullptr: none) through `weight`: with `weights` both run
  // now and a kUnitReady hands the unit's gradients over; without, the
  // input gradient runs now and the term is kept in the slot, its output
  // gradient copied to `kept` (nullptr: the slot keeps it already).
  void backward_term(Slot& slot, bool weights, const WeightTerm& t, Buffer dinp, ConstBuffer weight, Buffer kept);
  // How many positions loss(slot) averages (0 off the scoring stage).
  int scored_positions(int slot) const;
  void run_term(const Slot& slot, const WeightTerm& t, Buffer dinp, ConstBuffer weight, bool weight_grads);
  // run_term's linear whose input was the MLP's activation (the
  // projection): gradients into the unit's g (null: none) and through the
  // activation into dinp (null: none).
  void linear_backward_through_activation(const WeightTerm& t, Buffer dinp, ConstBuffer weight, float* g);
  // Sequence parallelism: the position shards of all TP ranks into one
  // [N, C] buffer, and the sum of the ranks' [N, C] partials into this
  // rank's shard. Both do nothing without TP, where the callers pass the
  // shard itself for the whole.
  void gather_positions(ConstBuffer shard, Buffer whole, size_t shard_numel);
  void sum_into_positions(const float* partial, float* shard, size_t shard_numel);

  common::ModelConfig config_;
  Backend& backend_;
  ModelStorage& storage_;
  Communicator* tp_;
  int tp_rank_;
  int tp_size_;
  Communicator* cp_;
  Communicator* ep_;
  // The ranks that split a batch (dp x cp), over which MoE's load statistics sum.
  Communicator* batch_group_;
  ContextSplit context_;
  std::vector<int32_t> local_tokens_;  // this rank's positions of a batch (CP)
  int max_batch_;
  std::vector<Slot> slots_;
  bool split_backward_;
  std::unique_ptr<Scratch> scratch_;
  float aux_loss_ = 0.0f;
  ActivationHook activation_hook_;
};

}  // namespace keel::trainer
