// Gpt's private state (docs/architecture.md "Model"), shared by the files
// that implement it: gpt.cpp (the embedding, the blocks' dense path, the
// head, the pipeline's slots), gpt_ring_attention.cpp (attention, and
// context parallelism's ring) and gpt_moe.cpp (the MoE blocks, expert
// parallelism's dispatch). Only those files include it.
#pragma once

#include "trainer/kernels/arena.h"
#include "trainer/kernels/backend_array.h"
#include "trainer/model/gpt.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace keel::trainer {

// Where one block's tensors sit within its unit's buffers (kNoTensor: a
// part the model does not have, such as Llama's biases). qkv_w is the
// first of the query, key and value rows one GEMM multiplies, fc_w of the
// MLP's input rows (SwiGLU's gate and up): ParamSpec::packed.
struct BlockOffsets {
  size_t ln1_w = kNoTensor, ln1_b = kNoTensor, qkv_w = kNoTensor, qkv_b = kNoTensor, attproj_w = kNoTensor,
         attproj_b = kNoTensor, ln2_w = kNoTensor, ln2_b = kNoTensor;
  size_t fc_w = kNoTensor, fc_b = kNoTensor, proj_w = kNoTensor, proj_b = kNoTensor;  // dense MLP
  size_t router_w = kNoTensor;                                                        // MoE
  // Of this rank's experts, by local index (table.expert_begin() + index).
  std::vector<size_t> expert_fc_w, expert_fc_b, expert_proj_w, expert_proj_b;
};

// The block of unit `unit` (1 + its index in this stage's table).
BlockOffsets block_offsets(const ParameterTable& t, int unit);

// Unit 0: the embeddings (first stage) and the final norm and the LM head
// (last stage). The token embedding serves as the head where it is tied,
// both where one stage is both.
struct OuterOffsets {
  size_t wte = kNoTensor, wpe = kNoTensor, lnf_w = kNoTensor, lnf_b = kNoTensor, head = kNoTensor;
};

// Where unit 0's tensors sit within its buffer.
OuterOffsets outer_offsets(const ParameterTable& t);

// One weight-gradient term of backward: a linear's weight and bias
// gradients from its output gradient and input, a norm's, the
// embedding's, or the mark that a unit's gradients are complete. A split
// backward (zero-bubble schedules) records its terms in order, each output
// gradient copied to where the slot keeps it, and Gpt::weight_gradients
// runs them in that order: each gradient sums its terms as a fused backward
// does, bit for bit, with no order written twice.
struct Gpt::WeightTerm {
  enum class Kind { kLinear, kNorm, kEmbedding, kUnitReady };
  static constexpr size_t kNone = kNoTensor;  // an offset of no tensor (a linear without bias)
  Kind kind = Kind::kUnitReady;
  int unit = 0;
  size_t weight = kNone, bias = kNone;  // offsets in the unit's gradients (a norm: its weight and bias)
  ConstBuffer dout = nullptr;           // [rows, out]: the output gradient (bf16 where its GEMMs take bf16)
  ConstBuffer inp = nullptr;            // [rows, in]: the forward's input (a norm's: float32)
  const float* mean = nullptr;          // a norm: the forward's row statistics
  const float* rstd = nullptr;
  int rows = 0, in = 0, out = 0;
  // How a linear's input gradient is put into the dinp its run gets:
  // written over where the linear is its only source (nothing then zeroes
  // the array first), else added to. A LayerNorm's is always added to.
  Into dinp_into = Into::kAdd;
  // A linear whose input was the MLP's activation of activation_of (the
  // MLP's projection): its input gradient is taken on through the
  // activation's derivative, the gradient of activation_of overwriting dinp
  // (GELU: Backend::matmul_backward_through_gelu; SwiGLU: matmul_backward
  // into float32 scratch, then swiglu_backward); its input is not kept but
  // recomputed into scratch when the weight gradient needs it, bit for bit
  // what the forward fed the GEMM on the CPU (llm.c's GELU recompute: N x
  // 4C floats a block less memory).
  ConstBuffer activation_of = nullptr;
  // A norm's input gradient (the residual stream's) also put here
  // rounded, where a dense linear takes it next (Scratch::dresidual_gemm).
  bf16* dinp_bf16 = nullptr;
};

// One backward pass, the same for each of its blocks (Gpt::backward).
struct Gpt::BackwardPass {
  Slot& slot;
  bool weights;  // weight gradients now, or kept for weight_gradients()
  float loss_scale;
  // The gradient of a sequence-parallel boundary, both ways: the shards of
  // an output gradient gathered (all-gather's backward is a reduce-scatter
  // and vice versa), and an input gradient to be summed into the shards, of
  // din_numel floats. Without TP, the shards themselves.
  float* dout_all;
  float* din_all;
  size_t din_numel;
  // The scratch dresidual_gemm where the dense linears take bf16 (null
  // otherwise), and the output gradient those linears read: it, or dout_all.
  bf16* rounded;
  ConstBuffer dout_gemm;
};

// The shapes of this rank's part of the model (docs/architecture.md
// "Parallel layout and communication"), derived in one place, Gpt::sizes().
struct Gpt::Sizes {
  int tp;       // TP ranks
  int T;        // positions of a sequence on this CP rank
  int C;        // channels of the residual stream
  int Cl;       // query channels of this TP rank: NHl * hd (C / tp)
  int NHl;      // query heads of this TP rank
  int KVHl;     // key/value heads of this TP rank (NHl without grouped-query attention)
  int hd;       // channels of a head
  int KVl;      // key (and value) channels of this TP rank: KVHl * hd
  int W;        // a row of qkv: Cl + 2 KVl (3Cl without grouped-query attention)
  int Fl;       // MLP hidden channels of this TP rank: mlp_width / tp
  int Fin;      // the MLP input linear's outputs: Fl (GELU) or 2 Fl (SwiGLU's gate and up)
  int V;        // the real vocabulary
  int Vl;       // padded vocabulary rows of this TP rank
  int v_begin;  // the first of them
  int E, K;     // experts, and experts per token (MoE)
  int N(int B) const { return B * T; }         // positions of B sequences on this rank
  int Ns(int B) const { return B * T / tp; }   // this TP rank's shard of them
};

// The routing of one MoE block for the last forward: which token went to
// which expert with what gate, grouped by expert so each expert runs one
// GEMM over its tokens.
//
// With expert parallelism (docs/architecture.md "Expert parallelism") the
// N*k slots of this rank's tokens, grouped by expert, are grouped by EP
// rank too; all_to_all_v sends each EP rank its run of them, and this
// rank's experts run on the R rows it receives ("expert side": every EP
// rank's slots for them, source rank by source rank), whose outputs go
// back the same way to the "token side". Without EP the two sides are one.
struct Gpt::MoeLayer {
  // Rows [begin, begin + rows) of the expert side are one run of local
  // expert `expert`'s slots (one source rank's, under EP).
  struct Segment {
    int expert = 0;
    int begin = 0;
    int rows = 0;
  };
  ArenaArray<float> router_logits, probs;  // [N, E]
  ArenaArray<int32_t> rows;                // [N*k]: token of each dispatched slot, grouped by expert
  ArenaArray<float> gates;                 // [N*k]: its renormalised gate
  // Expert side: input [R, C], fc [R, Fin], the activation [R, Fl]; token side:
  // output [N*k, C]. R is N*k without EP and at most ep*N*k with it.
  ArenaArray<float> xe, he, ge, ye;
  std::vector<Segment> segments;             // the expert side's runs
  std::vector<size_t> sent, received;        // under EP: slots to and from each EP rank
  std::vector<int> expert_start;             // E + 1 slot offsets
  std::vector<float> probs_host;             // [N, E]
  std::vector<int32_t> slot;                 // [N, k]: slot of the token's j-th choice
  std::vector<int32_t> choice;               // [N, k]: expert of the token's j-th choice
  std::vector<float> gates_host;             // [N*k] by slot
  std::vector<double> load;                  // [E]: f_e, the fraction of slots routed to e
  std::vector<double> tokens;                // [E]: the slots routed to e on all dp x cp ranks
  // With a split backward, what the weight pass reads: the experts'
  // output gradients [R, C] and fc output gradients [R, Fin] (expert
  // side), and the router logits' gradient [N, E].
  ArenaArray<float> dy, dhe, drouter;
  // Rows of the expert side the last forward used.
  size_t expert_rows() const {
    size_t rows = 0;
    for (const Segment& seg : segments) rows = std::max(rows, static_cast<size_t>(seg.begin + seg.rows));
    return rows;
  }
};

// Shapes: N = B*T positions, Ns = N / tp of them in this rank's position
// shard, and per rank the channels of Gpt::Sizes (Cl query channels, W of
// a qkv row, Fl MLP channels, Vl = Vp / tp vocabulary rows). "whole" buffers hold all N
// positions and exist only with TP; without it they alias their shards.
//
// A Slot is one pass in flight (a microbatch through one of the stage's
// chunks): everything its backward reads. The Scratch serves one pass at
// a time, whichever slot it runs.
struct Gpt::Slot {
  struct Block {
    // The norm outputs, read only by GEMMs, are in the GEMMs' input
    // type (ln2 float32 where an MoE block may run, whose dispatch copies
    // its rows; all float32 where the TP communicator carries only float32).
    ArenaBuffer ln1, ln1_whole, ln2, ln2_whole;
    ArenaArray<float> ln1_mean, ln1_rstd, attn_lse, residual2;
    ArenaBuffer qkv, atty;  // in the GEMMs' input type without CP (Gpt::attend)
    ArenaArray<float> ln2_mean, ln2_rstd, residual3;
    // The MLP's pre-activation (dense blocks), kept for GELU's backward, in
    // the GEMMs' input type as torch's autocast keeps it: bf16 halves the
    // largest array a block keeps.
    ArenaBuffer fch;
    std::unique_ptr<MoeLayer> moe;
    // With a split backward: the output gradients of the MLP projection,
    // fc (dense blocks), attention projection and qkv linears ([N, ...],
    // all positions) and of the two norms ([Ns, C]), which the weight
    // pass reads; an MoE block keeps its experts' in its MoeLayer. dproj,
    // dattproj, dfch and dqkv are in the types their GEMMs take them in
    // (Scratch).
    ArenaArray<float> dln2, dln1;
    ArenaBuffer dproj, dattproj, dfch, dqkv;
    ConstBuffer ln1_all() const { return ln1_whole.size() > 0 ? ln1_whole.buffer() : ln1.buffer(); }
    ConstBuffer ln2_all() const { return ln2_whole.size() > 0 ? ln2_whole.buffer() : ln2.buffer(); }
  };
  int batch = 0;                        // B of its forward
  int chunk = 0;                        // the stage's model chunk it runs
  ArenaArray<int32_t> inputs, targets;  // [B, T]
  // [Ns, C]: the chunk's input (the embedding's output on the first
  // virtual stage, the previous one's output otherwise) and, before the
  // last virtual stage, the gradient of the chunk's output.
  ArenaArray<float> input, output_grad;
  std::vector<Block> blocks;
  // Last stage. ln_f's output and the logits are in the GEMMs' input type;
  // the backward writes the logits' gradient over them, or the forward
  // did, scaled by `logits_gradient_scale` (Gpt::forward's backward_scale).
  ArenaBuffer lnf, lnf_whole, logits;
  ArenaArray<float> lnf_mean, lnf_rstd, losses, lse;
  std::optional<float> logits_gradient_scale;
  // With a split backward: the final norm's output gradient and the
  // embedding's ([N, C], all positions).
  ArenaArray<float> dlnf, dembed;
  // A split backward's weight terms, for weight_gradients().
  std::vector<WeightTerm> weight_terms;
};

struct Gpt::Scratch {
  std::vector<BlockOffsets> offsets;  // of the stage's blocks
  OuterOffsets outer;
  ArenaArray<float> xent_stats, xent_all;  // [N, 3] of this rank, [tp, N, 3] of all
  // [N, C] with TP: the partial sums of a row-parallel linear or of the
  // embedding (forward), a gathered output gradient and an input gradient
  // to be summed (backward).
  ArenaArray<float> partial, dwhole_out, dwhole_in;
  // Gradient scratch, reused by every block. dresidual ends a backward as
  // the gradient of the stage's input.
  // dfch, the MLP's pre-activation gradient that only fc's GEMMs read, is
  // in their input type; so is dqkv without CP, which attention's backward
  // overwrites instead of adding to (Backend::AttentionGrads).
  ArenaArray<float> dresidual, dln, datty;
  ArenaBuffer dfch, dqkv;
  // dresidual as the dense linears' GEMMs take it, where they take bf16
  // and no TP gathers dresidual first: the norm backward that adds
  // into dresidual puts the sum here rounded as well, so the projections'
  // GEMMs below it read half the bytes and round nothing (24 rounding
  // launches a step at 124M before). Empty otherwise.
  ArenaBuffer dresidual_gemm;
  // The activation (GELU, SwiGLU) of fch of the block running now: made by
  // the forward for the MLP's projection, remade by the backward for its
  // weight gradient. Only those GEMMs read it, so it is kept in their input
  // type: bf16 on the GPU's speed path, written so by the activation
  // instead of rounded by each GEMM.
  ArenaBuffer fch_gelu;
  // SwiGLU: the gradient of its output [N, Fl], float32, from the
  // projection's GEMM, before swiglu_backward takes it to dfch.
  ArenaArray<float> dact;
  // Rotary positions: the angles' cosines and sines for every position of
  // a sequence (RotaryTable), in backend memory, made once.
  BackendArray<float> rotary_cos, rotary_sin;
  // MoE gradient scratch: the gated output gradient [N*k, C] (token
  // side), the experts' [R, ...] gradients (expert side) and the router's.
  ArenaArray<float> dye, dge, dhe, dxe, dgates, dprobs, drouter;
  // Under EP: a token-side [N*k, C] buffer (the rows to dispatch, the
  // input gradients that came back) and an expert-side [R, C] one (the
  // outputs to return, the output gradients that arrived).
  ArenaArray<float> token_rows, expert_rows;
  // CP's ring: the k and v [N, 2KVl] another rank sent, two so one is
  // read while the next arrives, and the gradients of its k and v that
  // travel with them; one chunk's partial output and log-sum-exp.
  ArenaArray<float> ring[2], ring_grads[2], part_out, part_lse;
};

}  // namespace keel::trainer
