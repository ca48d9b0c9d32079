#include "trainer/model/gpt.h"

#include "common/error.h"
#include "trainer/kernels/arena.h"

#include <algorithm>
#include <numeric>
#include <string>

namespace keel::trainer {
namespace {

// Where one block's tensors sit within its unit's buffers.
struct BlockOffsets {
  size_t ln1_w = 0, ln1_b = 0, qkv_w = 0, qkv_b = 0, attproj_w = 0, attproj_b = 0, ln2_w = 0, ln2_b = 0;
  size_t fc_w = 0, fc_b = 0, proj_w = 0, proj_b = 0;  // dense MLP
  size_t router_w = 0;                                // MoE
  // Of this rank's experts, by local index (table.expert_begin() + index).
  std::vector<size_t> expert_fc_w, expert_fc_b, expert_proj_w, expert_proj_b;
};

// Block i of the model, unit `unit` of this stage's table.
BlockOffsets block_offsets(const ParameterTable& t, const common::ModelConfig& m, int64_t i, int unit) {
  const std::string h = "h." + std::to_string(i);
  const size_t origin = t.unit_begin(unit);
  auto at = [&](const std::string& name) { return t.find(h + name).offset - origin; };
  BlockOffsets o;
  o.ln1_w = at(".ln_1.weight");
  o.ln1_b = at(".ln_1.bias");
  o.qkv_w = at(".attn.c_attn.weight");
  o.qkv_b = at(".attn.c_attn.bias");
  o.attproj_w = at(".attn.c_proj.weight");
  o.attproj_b = at(".attn.c_proj.bias");
  o.ln2_w = at(".ln_2.weight");
  o.ln2_b = at(".ln_2.bias");
  if (m.is_moe_layer(i)) {
    o.router_w = at(".moe.router.weight");
    for (int64_t e = t.expert_begin(); e < t.expert_begin() + t.local_experts(); ++e) {
      const std::string x = ".moe.experts." + std::to_string(e);
      o.expert_fc_w.push_back(at(x + ".c_fc.weight"));
      o.expert_fc_b.push_back(at(x + ".c_fc.bias"));
      o.expert_proj_w.push_back(at(x + ".c_proj.weight"));
      o.expert_proj_b.push_back(at(x + ".c_proj.bias"));
    }
  } else {
    o.fc_w = at(".mlp.c_fc.weight");
    o.fc_b = at(".mlp.c_fc.bias");
    o.proj_w = at(".mlp.c_proj.weight");
    o.proj_b = at(".mlp.c_proj.bias");
  }
  return o;
}

// Unit 0: the embeddings (first stage) and the final norm and the tied LM
// head (last stage). The token embedding serves both where one stage is both.
struct OuterOffsets {
  size_t wte = 0, wpe = 0, lnf_w = 0, lnf_b = 0;
};

OuterOffsets outer_offsets(const ParameterTable& t) {
  const ModelStage& stage = t.stage();
  auto at = [&](const std::string& name) { return t.find(name).offset - t.unit_begin(0); };
  OuterOffsets o;
  if (stage.first() || stage.last()) o.wte = at("wte");
  if (stage.first()) o.wpe = at("wpe");
  if (stage.last()) {
    o.lnf_w = at("ln_f.weight");
    o.lnf_b = at("ln_f.bias");
  }
  return o;
}

// A split backward (zero-bubble schedules) leaves the weight gradients to
// Gpt::weight_gradients: it passes no unit gradients g, so each weight's
// gradient goes nowhere, and keeps what the weight pass will read.
float* gradient_at(float* g, size_t offset) { return g != nullptr ? g + offset : nullptr; }
void keep_for_weight_pass(Backend& k, bool split, ArenaArray<float>& kept, const float* from, size_t numel) {
  if (split) k.copy(kept.data(), from, numel * sizeof(float));
}

}  // namespace

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
  // Expert side: input [R, C], fc [R, 4C], gelu [R, 4C]; token side:
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
  // output gradients [R, C] and fc output gradients [R, 4C] (expert
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
// shard, and per rank Cl = C / tp attention channels, Fl = 4C / tp MLP
// channels and Vl = Vp / tp vocabulary rows. "whole" buffers hold all N
// positions and exist only with TP; without it they alias their shards.
//
// A Slot is one pass in flight (a microbatch through one of the stage's
// chunks): everything its backward reads. The Scratch serves one pass at
// a time, whichever slot it runs.
struct Gpt::Slot {
  struct Block {
    ArenaArray<float> ln1, ln1_mean, ln1_rstd, ln1_whole, qkv, attn_lse, atty, residual2;
    ArenaArray<float> ln2, ln2_mean, ln2_rstd, ln2_whole, fch, fch_gelu, residual3;
    std::unique_ptr<MoeLayer> moe;
    // With a split backward: the output gradients of the MLP projection,
    // fc (dense blocks), attention projection and qkv linears ([N, ...],
    // all positions) and of the two LayerNorms ([Ns, C]), which the weight
    // pass reads; an MoE block keeps its experts' in its MoeLayer.
    ArenaArray<float> dproj, dfch, dattproj, dqkv, dln2, dln1;
    const float* ln1_all() const { return ln1_whole.size() > 0 ? ln1_whole.data() : ln1.data(); }
    const float* ln2_all() const { return ln2_whole.size() > 0 ? ln2_whole.data() : ln2.data(); }
  };
  int batch = 0;                        // B of its forward
  int chunk = 0;                        // the stage's model chunk it runs
  ArenaArray<int32_t> inputs, targets;  // [B, T]
  // [Ns, C]: the chunk's input (the embedding's output on the first
  // virtual stage, the previous one's output otherwise) and, before the
  // last virtual stage, the gradient of the chunk's output.
  ArenaArray<float> input, output_grad;
  std::vector<Block> blocks;
  ArenaArray<float> lnf, lnf_mean, lnf_rstd, lnf_whole, logits, losses, lse;  // last stage
  // With a split backward: the final LayerNorm's output gradient and the
  // embedding's ([N, C], all positions).
  ArenaArray<float> dlnf, dembed;
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
  ArenaArray<float> dresidual, dln, datty, dqkv, dfch, dfch_gelu;
  // MoE gradient scratch: the gated output gradient [N*k, C] (token
  // side), the experts' [R, ...] gradients (expert side) and the router's.
  ArenaArray<float> dye, dge, dhe, dxe, dgates, dprobs, drouter;
  // Under EP: a token-side [N*k, C] buffer (the rows to dispatch, the
  // input gradients that came back) and an expert-side [R, C] one (the
  // outputs to return, the output gradients that arrived).
  ArenaArray<float> token_rows, expert_rows;
  // CP's ring: the k and v [N, 2Cl] another rank sent, two so one is
  // read while the next arrives, and the gradients of its k and v that
  // travel with them; one chunk's partial output and log-sum-exp.
  ArenaArray<float> ring[2], ring_grads[2], part_out, part_lse;
};

Gpt::Gpt(const common::ModelConfig& config, Backend& backend, int max_batch, ModelStorage& storage,
         const ProcessGroups& groups, int slots, bool split_backward)
    : config_(config),
      backend_(backend),
      storage_(storage),
      tp_(groups.get(Axis::kTp)),
      tp_rank_(groups.rank(Axis::kTp)),
      tp_size_(groups.size(Axis::kTp)),
      cp_(groups.get(Axis::kCp)),
      ep_(groups.get(Axis::kEp)),
      batch_group_(groups.get(Axis::kDpCp)),
      context_{groups.size(Axis::kCp), groups.rank(Axis::kCp), static_cast<int>(config.seq_len)},
      max_batch_(max_batch),
      slots_(static_cast<size_t>(slots)),
      split_backward_(split_backward),
      scratch_(std::make_unique<Scratch>()) {
  const size_t N = static_cast<size_t>(max_batch) * static_cast<size_t>(context_.local_len());
  const auto& chunks = stage().chunks;
  const bool empty_chunk = chunks.empty() || std::any_of(chunks.begin(), chunks.end(), [](const LayerRange& chunk) {
                             return chunk.end <= chunk.begin;
                           });
  if (N % static_cast<size_t>(tp_size_) != 0 || slots < 1 || empty_chunk ||
      context_.chunk_len() * context_.chunks() * context_.cp != config.seq_len) {
    throw common::Error(common::ErrorCode::kInternal,
                        "Gpt layout not validated: B*T % tp != 0, no slot, a stage without blocks or 2*cp not "
                        "dividing seq_len");
  }
  Scratch& x = *scratch_;
  x.outer = outer_offsets(storage.table());
  for (int64_t b = 0; b < stage().layers(); ++b) {
    x.offsets.push_back(block_offsets(storage.table(), config, stage().layer(b), static_cast<int>(b) + 1));
  }
}

void Gpt::lay_out(Arena& arena) {
  const common::ModelConfig& config = config_;
  const size_t B = static_cast<size_t>(max_batch_), T = static_cast<size_t>(context_.local_len());
  const size_t C = static_cast<size_t>(config.n_embd), tp_size = static_cast<size_t>(tp_size_);
  const size_t NHl = static_cast<size_t>(config.n_head) / tp_size, Cl = C / tp_size, Fl = 4 * C / tp_size;
  const size_t Vl = static_cast<size_t>(config.padded_vocab()) / tp_size, N = B * T, Ns = N / tp_size;
  const size_t E = static_cast<size_t>(config.n_expert), K = static_cast<size_t>(config.top_k);
  // Dropless: under EP every EP rank may route all its slots to this rank's experts.
  const size_t ep = ep_ != nullptr ? static_cast<size_t>(ep_->size()) : 1, R = ep * N * K;
  const bool first = stage().first(), last = stage().last();
  auto take = [&arena](size_t count) { return arena.take<float>(count); };
  // With TP a buffer of all N positions; without, an empty one (the shard serves).
  auto whole = [&](size_t width) { return take(tp_ != nullptr ? N * width : 0); };
  // A slot holds one pass through a chunk: its block i is block i of
  // whichever chunk runs in it, so it has room for the longest chunk, and
  // for an MoE block where any chunk's i-th block is one (a dense MLP where
  // any is dense).
  const int chunks = static_cast<int>(stage().chunks.size());
  int64_t slot_blocks = 0;
  for (int j = 0; j < chunks; ++j) slot_blocks = std::max(slot_blocks, stage().chunk_blocks(j));
  std::vector<bool> moe_at(static_cast<size_t>(slot_blocks), false), dense_at(static_cast<size_t>(slot_blocks), false);
  for (int j = 0; j < chunks; ++j) {
    for (int64_t i = 0; i < stage().chunk_blocks(j); ++i) {
      const bool moe = config.is_moe_layer(stage().layer(stage().chunk_begin(j) + i));
      (moe ? moe_at : dense_at)[static_cast<size_t>(i)] = true;
    }
  }
  bool any_moe = false;
  for (Slot& s : slots_) {
    s.blocks.clear();
    s.inputs = arena.take<int32_t>(first ? N : 0);
    s.targets = arena.take<int32_t>(last ? N : 0);
    s.input = take(Ns * C);
    // Every chunk but the one that scores the loss receives its output's gradient.
    s.output_grad = take(last && chunks == 1 ? 0 : Ns * C);
    for (size_t i = 0; i < static_cast<size_t>(slot_blocks); ++i) {
      Slot::Block blk;
      blk.ln1 = take(Ns * C);
      blk.ln1_mean = take(Ns);
      blk.ln1_rstd = take(Ns);
      blk.ln1_whole = whole(C);
      blk.qkv = take(N * 3 * Cl);
      blk.attn_lse = take(static_cast<size_t>(B) * NHl * T);
      blk.atty = take(N * Cl);
      blk.residual2 = take(Ns * C);
      blk.ln2 = take(Ns * C);
      blk.ln2_mean = take(Ns);
      blk.ln2_rstd = take(Ns);
      blk.ln2_whole = whole(C);
      blk.residual3 = take(Ns * C);
      if (moe_at[i]) {
        any_moe = true;
        auto moe = std::make_unique<MoeLayer>();
        moe->router_logits = take(N * E);
        moe->probs = take(N * E);
        moe->rows = arena.take<int32_t>(N * K);
        moe->gates = take(N * K);
        moe->xe = take(R * C);
        moe->he = take(R * Fl);
        moe->ge = take(R * Fl);
        moe->ye = take(N * K * C);
        if (split_backward_) {
          moe->dy = take(R * C);
          moe->dhe = take(R * Fl);
          moe->drouter = take(N * E);
        }
        blk.moe = std::move(moe);
      }
      if (dense_at[i]) {
        blk.fch = take(N * Fl);
        blk.fch_gelu = take(N * Fl);
      }
      if (split_backward_) {
        blk.dproj = take(dense_at[i] ? N * C : 0);
        blk.dfch = take(dense_at[i] ? N * Fl : 0);
        blk.dattproj = take(N * C);
        blk.dqkv = take(N * 3 * Cl);
        blk.dln2 = take(Ns * C);
        blk.dln1 = take(Ns * C);
      }
      s.blocks.push_back(std::move(blk));
    }
    if (last) {
      s.lnf = take(Ns * C);
      s.lnf_mean = take(Ns);
      s.lnf_rstd = take(Ns);
      s.lnf_whole = whole(C);
      s.logits = take(N * Vl);
      s.losses = take(N);
      s.lse = take(N);
      s.dlnf = take(split_backward_ ? Ns * C : 0);
    }
    s.dembed = take(split_backward_ && first ? N * C : 0);
  }
  Scratch& x = *scratch_;
  x.xent_stats = take(last ? N * 3 : 0);
  x.xent_all = take(last && tp_ != nullptr ? tp_size * N * 3 : 0);
  x.partial = whole(C);
  x.dwhole_out = whole(C);
  x.dwhole_in = whole(C);
  x.dresidual = take(Ns * C);
  x.dln = take(Ns * C);
  x.datty = take(N * Cl);
  x.dqkv = take(N * 3 * Cl);
  x.dfch = take(N * Fl);
  x.dfch_gelu = take(N * Fl);
  if (any_moe) {
    x.dye = take(N * K * C);
    x.dge = take(R * Fl);
    x.dhe = take(R * Fl);
    x.dxe = take(R * C);
    x.token_rows = take(ep_ != nullptr ? N * K * C : 0);
    x.expert_rows = take(ep_ != nullptr ? R * C : 0);
    x.dgates = take(N * K);
    x.dprobs = take(N * E);
    x.drouter = take(N * E);
  }
  const size_t ring = cp_ != nullptr ? N * 2 * Cl : 0, chunk = cp_ != nullptr ? B * context_.chunk_len() : 0;
  for (size_t i = 0; i < 2; ++i) {
    x.ring[i] = take(ring);
    x.ring_grads[i] = take(ring);
  }
  x.part_out = take(chunk * Cl);
  x.part_lse = take(chunk * NHl);
}

Gpt::~Gpt() = default;

int Gpt::slots() const { return static_cast<int>(slots_.size()); }

const float* Gpt::logits(int slot) const { return slots_[static_cast<size_t>(slot)].logits.data(); }

size_t Gpt::boundary_numel(int B) const {
  return static_cast<size_t>(B) * static_cast<size_t>(context_.local_len()) / static_cast<size_t>(tp_size_) *
         static_cast<size_t>(config_.n_embd);
}
float* Gpt::stage_input(int slot) { return slots_[static_cast<size_t>(slot)].input.data(); }
const float* Gpt::stage_output(int slot) const {
  const Slot& s = slots_[static_cast<size_t>(slot)];
  return s.blocks[static_cast<size_t>(stage().chunk_blocks(s.chunk)) - 1].residual3.data();
}
float* Gpt::output_gradient(int slot) { return slots_[static_cast<size_t>(slot)].output_grad.data(); }
const float* Gpt::input_gradient() const { return scratch_->dresidual.data(); }

void Gpt::gather_positions(const float* shard, float* whole, size_t shard_numel) {
  if (tp_ != nullptr) tp_->all_gather(shard, whole, shard_numel);
}

void Gpt::sum_into_positions(const float* partial, float* shard, size_t shard_numel) {
  if (tp_ != nullptr) tp_->reduce_scatter(partial, shard, shard_numel);
}

float Gpt::forward(const int32_t* inputs, const int32_t* targets, int B, int slot, int chunk) {
  if (scratch_->dresidual.data() == nullptr) {
    throw common::Error(common::ErrorCode::kInternal, "Gpt::forward before lay_out() placed the activations");
  }
  if (B < 1 || B > max_batch_ || B * config_.seq_len % tp_size_ != 0 || slot < 0 || slot >= slots() || chunk < 0 ||
      chunk >= static_cast<int>(stage().chunks.size()) || (stage().embeds(chunk) && inputs == nullptr) ||
      (stage().scores(chunk) && targets == nullptr)) {
    throw common::Error(common::ErrorCode::kInternal, "forward batch " + std::to_string(B) + " outside [1, " +
                                                          std::to_string(max_batch_) + "], not splittable over " +
                                                          std::to_string(tp_size_) +
                                                          " TP ranks, slot or chunk out of range or tokens missing");
  }
  Slot& s = slots_[static_cast<size_t>(slot)];
  s.batch = B;
  s.chunk = chunk;
  const int T = context_.local_len(), C = static_cast<int>(config_.n_embd);
  const int N = B * T, Ns = N / tp_size_, Cl = C / tp_size_, Fl = 4 * C / tp_size_;
  const int V = static_cast<int>(config_.vocab_size), Vl = static_cast<int>(config_.padded_vocab()) / tp_size_;
  const int v_begin = tp_rank_ * Vl;
  const size_t NsC = static_cast<size_t>(Ns) * C;
  const bool first_tp_rank = tp_rank_ == 0;
  Scratch& x = *scratch_;
  Backend& k = backend_;
  const OuterOffsets& outer = x.outer;
  const bool embeds = stage().embeds(chunk), scores = stage().scores(chunk);
  const float* p0 = embeds || scores ? storage_.acquire_parameters(0) : nullptr;
  const int blocks = static_cast<int>(stage().chunk_blocks(chunk));
  const int first = static_cast<int>(stage().chunk_begin(chunk));
  storage_.prefetch_parameters(first + 1);
  // A row-parallel linear's output: partial sums to be reduce-scattered
  // with TP, the shard itself without.
  auto partial_or = [&](const ArenaArray<float>& shard) { return tp_ != nullptr ? x.partial.data() : shard.data(); };

  // This rank's positions of the batch's tokens, in backend memory.
  auto upload = [&](const int32_t* tokens, ArenaArray<int32_t>& to) {
    if (cp_ != nullptr) {
      local_tokens_.resize(static_cast<size_t>(N));
      context_.take(tokens, B, local_tokens_.data());
      tokens = local_tokens_.data();
    }
    k.copy_from_host(to.data(), tokens, static_cast<size_t>(N) * sizeof(int32_t));
  };
  if (embeds) {
    upload(inputs, s.inputs);
    // The vocabulary shards each embed their own tokens; the position rows
    // and the row-parallel biases are added by TP rank 0 alone, so that the
    // sum over the group counts them once. Each chunk of positions takes
    // its own rows of wpe.
    const int Tc = context_.chunk_len();
    const size_t chunk_rows = static_cast<size_t>(B) * Tc;
    for (int c = 0; c < context_.chunks(); ++c) {
      k.embedding_forward(
          partial_or(s.input) + c * chunk_rows * C, s.inputs.data() + c * chunk_rows, p0 + outer.wte, v_begin, Vl,
          first_tp_rank ? p0 + outer.wpe + static_cast<size_t>(context_.start(c, context_.rank)) * C : nullptr, B, Tc,
          C);
    }
    sum_into_positions(x.partial.data(), s.input.data(), NsC);
  }

  aux_loss_ = 0.0f;
  const float* residual = s.input.data();
  for (int i = 0; i < blocks; ++i) {
    Slot::Block& blk = s.blocks[static_cast<size_t>(i)];
    const BlockOffsets& o = x.offsets[static_cast<size_t>(first + i)];
    const int unit = first + i + 1;
    const float* p = storage_.acquire_parameters(unit);
    if (i + 1 < blocks) storage_.prefetch_parameters(unit + 1);
    // Attention branch.
    k.layernorm_forward(blk.ln1.data(), blk.ln1_mean.data(), blk.ln1_rstd.data(), residual, p + o.ln1_w,
                        p + o.ln1_b, Ns, C);
    gather_positions(blk.ln1.data(), blk.ln1_whole.data(), NsC);
    k.matmul_forward(blk.qkv.data(), blk.ln1_all(), p + o.qkv_w, p + o.qkv_b, N, C, 3 * Cl);
    attend(blk.qkv.data(), blk.atty.data(), blk.attn_lse.data(), B);
    k.matmul_forward(partial_or(blk.residual2), blk.atty.data(), p + o.attproj_w,
                     first_tp_rank ? p + o.attproj_b : nullptr, N, Cl, C);
    sum_into_positions(x.partial.data(), blk.residual2.data(), NsC);
    // MLP (or MoE) branch, its LayerNorm fused with the attention branch's
    // residual add. (The block's output add stays apart: the activation
    // hook must see it before the next block reads it.)
    k.add_layernorm_forward(blk.residual2.data(), residual, blk.ln2.data(), blk.ln2_mean.data(),
                            blk.ln2_rstd.data(), p + o.ln2_w, p + o.ln2_b, Ns, C);
    if (config_.is_moe_layer(stage().layer(first + i))) {
      // Every TP rank routes all N tokens alike and runs its slice of each
      // expert, like the dense MLP; the row-parallel partials sum into the shards.
      gather_positions(blk.ln2.data(), blk.ln2_whole.data(), NsC);
      moe_forward(s, i, p, blk.ln2_all(), partial_or(blk.residual3), N);
      sum_into_positions(x.partial.data(), blk.residual3.data(), NsC);
    } else {
      gather_positions(blk.ln2.data(), blk.ln2_whole.data(), NsC);
      k.matmul_forward(blk.fch.data(), blk.ln2_all(), p + o.fc_w, p + o.fc_b, N, C, Fl);
      k.gelu_forward(blk.fch_gelu.data(), blk.fch.data(), static_cast<size_t>(N) * Fl);
      k.matmul_forward(partial_or(blk.residual3), blk.fch_gelu.data(), p + o.proj_w,
                       first_tp_rank ? p + o.proj_b : nullptr, N, Fl, C);
      sum_into_positions(x.partial.data(), blk.residual3.data(), NsC);
    }
    k.accumulate(blk.residual3.data(), blk.residual2.data(), NsC);
    if (activation_hook_) activation_hook_(static_cast<int>(stage().layer(first + i)), blk.residual3.data(), NsC);
    residual = blk.residual3.data();
  }
  if (!scores) return 0.0f;

  upload(targets, s.targets);
  k.layernorm_forward(s.lnf.data(), s.lnf_mean.data(), s.lnf_rstd.data(), residual, p0 + outer.lnf_w, p0 + outer.lnf_b,
                      Ns, C);
  gather_positions(s.lnf.data(), s.lnf_whole.data(), NsC);
  // The LM head is tied to the token embedding: each rank scores its own
  // vocabulary rows, and the ranks exchange three floats per position.
  const float* lnf_all = tp_ != nullptr ? s.lnf_whole.data() : s.lnf.data();
  k.matmul_forward(s.logits.data(), lnf_all, p0 + outer.wte, nullptr, N, C, Vl);
  if (activation_hook_) {
    activation_hook_(static_cast<int>(config_.n_layer), s.logits.data(), static_cast<size_t>(N) * Vl);
  }
  k.crossentropy_stats(x.xent_stats.data(), s.logits.data(), s.targets.data(), N, v_begin, Vl, V);
  if (tp_ != nullptr) tp_->all_gather(x.xent_stats.data(), x.xent_all.data(), static_cast<size_t>(N) * 3);
  k.crossentropy_combine(s.losses.data(), s.lse.data(), tp_ != nullptr ? x.xent_all.data() : x.xent_stats.data(),
                         tp_size_, N);
  return static_cast<float>(k.sum(s.losses.data(), static_cast<size_t>(N)) / N);
}

void Gpt::backward(float loss_scale, int slot, bool weights) {
  Slot& s = slots_[static_cast<size_t>(slot)];
  const int B = s.batch, T = context_.local_len(), C = static_cast<int>(config_.n_embd);
  if (B == 0) throw common::Error(common::ErrorCode::kInternal, "Gpt::backward of a slot with no forward");
  if (!weights && !split_backward_) {
    throw common::Error(common::ErrorCode::kInternal, "Gpt::backward without weights on a model not split");
  }
  const int N = B * T, Ns = N / tp_size_, Cl = C / tp_size_, Fl = 4 * C / tp_size_;
  const int V = static_cast<int>(config_.vocab_size), Vl = static_cast<int>(config_.padded_vocab()) / tp_size_;
  const int v_begin = tp_rank_ * Vl;
  const size_t NsC = static_cast<size_t>(Ns) * C;
  Scratch& x = *scratch_;
  Backend& k = backend_;
  const OuterOffsets& outer = x.outer;
  const bool embeds = stage().embeds(s.chunk), scores = stage().scores(s.chunk);
  const float* p0 = embeds || scores ? storage_.acquire_parameters(0) : nullptr;
  float* g0 = weights && (embeds || scores) ? storage_.unit_gradients(0) : nullptr;
  auto keep = [&](ArenaArray<float>& kept, const float* from, size_t numel) {
    keep_for_weight_pass(k, !weights, kept, from, numel);
  };
  const size_t blocks = static_cast<size_t>(stage().chunk_blocks(s.chunk));
  const int first = static_cast<int>(stage().chunk_begin(s.chunk));
  // The gradient of a sequence-parallel boundary, both ways: the shards of
  // an output gradient gathered (all-gather's backward is a reduce-scatter
  // and vice versa), and an input gradient summed into the shards.
  float* dout_all = tp_ != nullptr ? x.dwhole_out.data() : x.dresidual.data();
  float* din_all = tp_ != nullptr ? x.dwhole_in.data() : x.dln.data();
  const size_t din_numel = tp_ != nullptr ? static_cast<size_t>(N) * C : NsC;
  const size_t NC = static_cast<size_t>(N) * C;

  if (scores) {
    // Softmax cross-entropy gradient, written over the logits in place.
    k.crossentropy_backward(s.logits.data(), s.logits.data(), s.lse.data(), s.targets.data(),
                            loss_scale / static_cast<float>(N), N, v_begin, Vl, V);
    k.zero(din_all, din_numel * sizeof(float));
    const float* lnf_all = tp_ != nullptr ? s.lnf_whole.data() : s.lnf.data();
    k.matmul_backward(din_all, gradient_at(g0, outer.wte), nullptr, s.logits.data(), lnf_all, p0 + outer.wte, N, C, Vl);
    sum_into_positions(din_all, x.dln.data(), NsC);
    keep(s.dlnf, x.dln.data(), NsC);
    x.dresidual.zero();
    k.layernorm_backward(x.dresidual.data(), gradient_at(g0, outer.lnf_w), gradient_at(g0, outer.lnf_b), x.dln.data(),
                         s.blocks[blocks - 1].residual3.data(), p0 + outer.lnf_w, s.lnf_mean.data(), s.lnf_rstd.data(),
                         Ns, C);
  } else {
    k.copy(x.dresidual.data(), s.output_grad.data(), NsC * sizeof(float));
  }

  // dresidual holds the gradient of this rank's shard of the residual
  // stream; each branch adds its input's gradient into it on the way down.
  for (size_t i = blocks; i-- > 0;) {
    Slot::Block& blk = s.blocks[i];
    const BlockOffsets& o = x.offsets[static_cast<size_t>(first) + i];
    const int unit = first + static_cast<int>(i) + 1;
    const float* p = storage_.acquire_parameters(unit);
    if (i > 0) storage_.prefetch_parameters(unit - 1);
    float* g = weights ? storage_.unit_gradients(unit) : nullptr;
    const float* residual = i == 0 ? s.input.data() : s.blocks[i - 1].residual3.data();

    k.zero(din_all, din_numel * sizeof(float));
    if (config_.is_moe_layer(stage().layer(first + static_cast<int64_t>(i)))) {
      gather_positions(x.dresidual.data(), dout_all, NsC);
      moe_backward(s, static_cast<int>(i), p, g, din_all, dout_all, loss_scale, N);
      sum_into_positions(din_all, x.dln.data(), NsC);
    } else {
      gather_positions(x.dresidual.data(), dout_all, NsC);
      keep(blk.dproj, dout_all, NC);
      x.dfch_gelu.zero();
      k.matmul_backward(x.dfch_gelu.data(), gradient_at(g, o.proj_w), gradient_at(g, o.proj_b), dout_all,
                        blk.fch_gelu.data(), p + o.proj_w, N, Fl, C);
      x.dfch.zero();
      k.gelu_backward(x.dfch.data(), blk.fch.data(), x.dfch_gelu.data(), static_cast<size_t>(N) * Fl);
      keep(blk.dfch, x.dfch.data(), static_cast<size_t>(N) * Fl);
      k.matmul_backward(din_all, gradient_at(g, o.fc_w), gradient_at(g, o.fc_b), x.dfch.data(), blk.ln2_all(),
                        p + o.fc_w, N, C, Fl);
      sum_into_positions(din_all, x.dln.data(), NsC);
    }
    keep(blk.dln2, x.dln.data(), NsC);
    k.layernorm_backward(x.dresidual.data(), gradient_at(g, o.ln2_w), gradient_at(g, o.ln2_b), x.dln.data(),
                         blk.residual2.data(), p + o.ln2_w, blk.ln2_mean.data(), blk.ln2_rstd.data(), Ns, C);

    gather_positions(x.dresidual.data(), dout_all, NsC);
    keep(blk.dattproj, dout_all, NC);
    x.datty.zero();
    k.matmul_backward(x.datty.data(), gradient_at(g, o.attproj_w), gradient_at(g, o.attproj_b), dout_all,
                      blk.atty.data(), p + o.attproj_w, N, Cl, C);
    x.dqkv.zero();
    attend_backward(blk.qkv.data(), blk.atty.data(), blk.attn_lse.data(), B);
    keep(blk.dqkv, x.dqkv.data(), static_cast<size_t>(N) * 3 * Cl);
    k.zero(din_all, din_numel * sizeof(float));
    k.matmul_backward(din_all, gradient_at(g, o.qkv_w), gradient_at(g, o.qkv_b), x.dqkv.data(), blk.ln1_all(),
                      p + o.qkv_w, N, C, 3 * Cl);
    sum_into_positions(din_all, x.dln.data(), NsC);
    keep(blk.dln1, x.dln.data(), NsC);
    k.layernorm_backward(x.dresidual.data(), gradient_at(g, o.ln1_w), gradient_at(g, o.ln1_b), x.dln.data(), residual,
                         p + o.ln1_w, blk.ln1_mean.data(), blk.ln1_rstd.data(), Ns, C);
    if (weights) storage_.gradients_ready(unit);
  }
  if (embeds) {
    gather_positions(x.dresidual.data(), dout_all, NsC);
    keep(s.dembed, dout_all, NC);
    if (weights) embedding_backward(g0, dout_all, s.inputs.data(), B);
  }
  if (!weights) return;
  if (embeds || scores) storage_.gradients_ready(0);
  s.batch = 0;
}

void Gpt::embedding_backward(float* g0, const float* dout_all, const int32_t* inputs, int B) {
  const OuterOffsets& outer = scratch_->outer;
  const int C = static_cast<int>(config_.n_embd), Vl = static_cast<int>(config_.padded_vocab()) / tp_size_;
  const int Tc = context_.chunk_len();
  const size_t chunk_rows = static_cast<size_t>(B) * Tc;
  for (int c = 0; c < context_.chunks(); ++c) {
    backend_.embedding_backward(g0 + outer.wte,
                                g0 + outer.wpe + static_cast<size_t>(context_.start(c, context_.rank)) * C,
                                dout_all + c * chunk_rows * C, inputs + c * chunk_rows, tp_rank_ * Vl, Vl, B, Tc, C);
  }
}

void Gpt::weight_gradients(int slot) {
  Slot& s = slots_[static_cast<size_t>(slot)];
  const int B = s.batch, T = context_.local_len(), C = static_cast<int>(config_.n_embd);
  if (B == 0 || !split_backward_) {
    throw common::Error(common::ErrorCode::kInternal, "Gpt::weight_gradients of a slot with no split backward");
  }
  const int N = B * T, Ns = N / tp_size_, Cl = C / tp_size_, Fl = 4 * C / tp_size_;
  const int Vl = static_cast<int>(config_.padded_vocab()) / tp_size_;
  const Scratch& x = *scratch_;
  Backend& k = backend_;
  const OuterOffsets& outer = x.outer;
  const bool embeds = stage().embeds(s.chunk), scores = stage().scores(s.chunk);
  float* g0 = embeds || scores ? storage_.unit_gradients(0) : nullptr;
  const size_t blocks = static_cast<size_t>(stage().chunk_blocks(s.chunk));
  const int first = static_cast<int>(stage().chunk_begin(s.chunk));
  // The order of backward(), so each gradient sums its terms as there.
  if (scores) {
    const float* lnf_all = tp_ != nullptr ? s.lnf_whole.data() : s.lnf.data();
    k.matmul_backward(nullptr, g0 + outer.wte, nullptr, s.logits.data(), lnf_all, nullptr, N, C, Vl);
    k.layernorm_backward(nullptr, g0 + outer.lnf_w, g0 + outer.lnf_b, s.dlnf.data(),
                         s.blocks[blocks - 1].residual3.data(), nullptr, s.lnf_mean.data(), s.lnf_rstd.data(), Ns, C);
  }
  for (size_t i = blocks; i-- > 0;) {
    const Slot::Block& blk = s.blocks[i];
    const BlockOffsets& o = x.offsets[static_cast<size_t>(first) + i];
    const int unit = first + static_cast<int>(i) + 1;
    float* g = storage_.unit_gradients(unit);
    const float* residual = i == 0 ? s.input.data() : s.blocks[i - 1].residual3.data();
    if (config_.is_moe_layer(stage().layer(first + static_cast<int64_t>(i)))) {
      const MoeLayer& moe = *blk.moe;
      const int E = static_cast<int>(config_.n_expert);
      for (const MoeLayer::Segment& seg : moe.segments) {
        const size_t r = static_cast<size_t>(seg.begin);
        const size_t e = static_cast<size_t>(seg.expert);
        k.matmul_backward(nullptr, g + o.expert_proj_w[e], g + o.expert_proj_b[e], moe.dy.data() + r * C,
                          moe.ge.data() + r * Fl, nullptr, seg.rows, Fl, C);
        k.matmul_backward(nullptr, g + o.expert_fc_w[e], g + o.expert_fc_b[e], moe.dhe.data() + r * Fl,
                          moe.xe.data() + r * C, nullptr, seg.rows, C, Fl);
      }
      k.matmul_backward(nullptr, g + o.router_w, nullptr, moe.drouter.data(), blk.ln2_all(), nullptr, N, C, E);
    } else {
      k.matmul_backward(nullptr, g + o.proj_w, g + o.proj_b, blk.dproj.data(), blk.fch_gelu.data(), nullptr, N, Fl, C);
      k.matmul_backward(nullptr, g + o.fc_w, g + o.fc_b, blk.dfch.data(), blk.ln2_all(), nullptr, N, C, Fl);
    }
    k.layernorm_backward(nullptr, g + o.ln2_w, g + o.ln2_b, blk.dln2.data(), blk.residual2.data(), nullptr,
                         blk.ln2_mean.data(), blk.ln2_rstd.data(), Ns, C);
    k.matmul_backward(nullptr, g + o.attproj_w, g + o.attproj_b, blk.dattproj.data(), blk.atty.data(), nullptr, N, Cl,
                      C);
    k.matmul_backward(nullptr, g + o.qkv_w, g + o.qkv_b, blk.dqkv.data(), blk.ln1_all(), nullptr, N, C, 3 * Cl);
    k.layernorm_backward(nullptr, g + o.ln1_w, g + o.ln1_b, blk.dln1.data(), residual, nullptr, blk.ln1_mean.data(),
                         blk.ln1_rstd.data(), Ns, C);
    storage_.gradients_ready(unit);
  }
  if (embeds) embedding_backward(g0, s.dembed.data(), s.inputs.data(), B);
  if (embeds || scores) storage_.gradients_ready(0);
  s.batch = 0;
}

void Gpt::visible_pairs(const float* qkv, const float* held, bool packed, int owner, int B,
                        const std::function<void(int, int, const Backend::AttentionInputs&)>& visit) {
  const int Cl = static_cast<int>(config_.n_embd) / tp_size_, NHl = static_cast<int>(config_.n_head) / tp_size_;
  const int Tc = context_.chunk_len(), rank = context_.rank;
  const size_t rows = static_cast<size_t>(B) * Tc;
  const int ld_kv = packed ? 2 * Cl : 3 * Cl, k_at = packed ? 0 : Cl;
  for (int qc = 0; qc < 2; ++qc) {
    for (int kc = 0; kc < 2; ++kc) {
      if (causal_mask(context_.global_chunk(qc, rank), context_.global_chunk(kc, owner)) == ChunkMask::kNone) continue;
      const float* keys = held + kc * rows * ld_kv + k_at;
      visit(qc, kc,
            {qkv + qc * rows * 3 * Cl, keys, keys + Cl, 3 * Cl, ld_kv, B, Tc, Tc, Cl, NHl, context_.start(qc, rank),
             context_.start(kc, owner)});
    }
  }
}

const float* Gpt::packed_keys(const float* qkv, int B) {
  const int Cl = static_cast<int>(config_.n_embd) / tp_size_;
  const int rows = B * context_.local_len();
  float* kv = scratch_->ring[0].data();
  backend_.copy_columns(kv, 2 * Cl, qkv + Cl, 3 * Cl, rows, 2 * Cl);
  return kv;
}

void Gpt::attend(const float* qkv, float* out, float* lse, int B) {
  const int Cl = static_cast<int>(config_.n_embd) / tp_size_, NHl = static_cast<int>(config_.n_head) / tp_size_;
  Backend& k = backend_;
  if (cp_ == nullptr) {
    k.attention_forward(out, lse, Backend::self_attention(qkv, B, context_.local_len(), Cl, NHl));
    return;
  }
  // Ring attention: step t holds the k and v of CP rank r - t and passes
  // them on to r + 1. Each local query chunk computes its first chunk of
  // keys in place (its own diagonal, at step 0, from its qkv rows) and
  // merges every later one (online softmax); chunk pairs the causal mask
  // hides are skipped, which is where causal load balancing evens the
  // ranks out. Only k and v travel, packed as [rows, 2Cl].
  Scratch& x = *scratch_;
  const int Tc = context_.chunk_len(), cp = context_.cp, rank = context_.rank;
  const size_t rows = static_cast<size_t>(B) * Tc, numel = 2 * rows * 2 * static_cast<size_t>(Cl);
  bool started[2] = {false, false};
  const float* held = qkv;
  for (int step = 0; step < cp; ++step) {
    if (step > 0) {
      if (step == 1) held = packed_keys(qkv, B);
      float* next = x.ring[step % 2].data();
      cp_->exchange({{held, numel, (rank + 1) % cp}}, {{next, numel, (rank + cp - 1) % cp}});
      held = next;
    }
    visible_pairs(qkv, held, step > 0, (rank + cp - step) % cp, B,
                  [&](int qc, int, const Backend::AttentionInputs& in) {
                    float* chunk_out = out + qc * rows * Cl;
                    float* chunk_lse = lse + qc * rows * NHl;
                    if (!started[qc]) {
                      k.attention_forward(chunk_out, chunk_lse, in);
                      started[qc] = true;
                    } else {
                      k.attention_forward(x.part_out.data(), x.part_lse.data(), in);
                      k.attention_merge(chunk_out, chunk_lse, x.part_out.data(), x.part_lse.data(), B, Tc, Cl, NHl);
                    }
                  });
  }
}

void Gpt::attend_backward(const float* qkv, const float* out, const float* lse, int B) {
  const int Cl = static_cast<int>(config_.n_embd) / tp_size_, NHl = static_cast<int>(config_.n_head) / tp_size_;
  Backend& k = backend_;
  Scratch& x = *scratch_;
  if (cp_ == nullptr) {
    k.attention_backward(Backend::self_attention_grads(x.dqkv.data(), Cl), x.datty.data(), out, lse,
                         Backend::self_attention(qkv, B, context_.local_len(), Cl, NHl));
    return;
  }
  // The ring again. At step 0 this rank's own keys' gradients go straight
  // into dqkv; from step 1 each rank's packed k and v travel with an
  // accumulator of their gradients, which starts at zero where they first
  // arrive, gathers every other rank's share, and comes home in one last
  // step.
  const int Tc = context_.chunk_len(), cp = context_.cp, rank = context_.rank;
  const size_t rows = static_cast<size_t>(B) * Tc, numel = 2 * rows * 2 * static_cast<size_t>(Cl);
  const float* held = qkv;
  float* held_grads = nullptr;
  const int to = (rank + 1) % cp, from = (rank + cp - 1) % cp;
  for (int step = 0; step < cp; ++step) {
    if (step > 0) {
      float* next = x.ring[step % 2].data();
      float* next_grads = x.ring_grads[step % 2].data();
      if (step == 1) {
        cp_->exchange({{packed_keys(qkv, B), numel, to}}, {{next, numel, from}});
        k.zero(next_grads, numel * sizeof(float));
      } else {
        cp_->exchange({{held, numel, to}, {held_grads, numel, to}}, {{next, numel, from}, {next_grads, numel, from}});
      }
      held = next;
      held_grads = next_grads;
    }
    visible_pairs(
        qkv, held, step > 0, (rank + cp - step) % cp, B, [&](int qc, int kc, const Backend::AttentionInputs& in) {
          float* key_grads = step == 0 ? x.dqkv.data() + kc * rows * 3 * Cl + Cl : held_grads + kc * rows * 2 * Cl;
          k.attention_backward({x.dqkv.data() + qc * rows * 3 * Cl, key_grads, key_grads + Cl},
                               x.datty.data() + qc * rows * Cl, out + qc * rows * Cl, lse + qc * rows * NHl, in);
        });
  }
  // Step cp - 1 held rank r + 1's gradients: they go home.
  float* home = x.ring_grads[cp % 2].data();
  cp_->exchange({{held_grads, numel, to}}, {{home, numel, from}});
  k.accumulate_columns(x.dqkv.data() + Cl, 3 * Cl, home, 2 * Cl, static_cast<int>(2 * rows), 2 * Cl);
}

void Gpt::plan_dispatch(MoeLayer& moe, const std::vector<int>& count) {
  const ParameterTable& table = storage_.table();
  const int E = static_cast<int>(config_.n_expert), El = static_cast<int>(table.local_experts());
  const int first = static_cast<int>(table.expert_begin());
  moe.segments.clear();
  if (ep_ == nullptr) {
    for (int e = 0; e < E; ++e) {
      if (count[e] > 0) moe.segments.push_back({e, moe.expert_start[e], count[e]});
    }
    return;
  }
  // Every EP rank's slots per expert, so that each rank knows how many rows
  // of each of its experts every other rank sends. Counts are exact in
  // float32 below 2^24 slots.
  const int ep = ep_->size();
  std::vector<float> mine(count.begin(), count.end()), every_rank(static_cast<size_t>(ep) * E);
  ep_->all_gather(mine.data(), every_rank.data(), static_cast<size_t>(E));
  moe.sent.assign(static_cast<size_t>(ep), 0);
  moe.received.assign(static_cast<size_t>(ep), 0);
  int at = 0;
  for (int q = 0; q < ep; ++q) {
    for (int l = 0; l < El; ++l) {
      moe.sent[q] += static_cast<size_t>(count[q * El + l]);
      const int rows = static_cast<int>(every_rank[static_cast<size_t>(q) * E + first + l]);
      if (rows > 0) moe.segments.push_back({l, at, rows});
      at += rows;
      moe.received[q] += static_cast<size_t>(rows);
    }
  }
}

void Gpt::exchange_rows(const float* in, const std::vector<size_t>& in_rows, float* out,
                        const std::vector<size_t>& out_rows, int width) {
  auto floats = [width](std::vector<size_t> rows) {
    for (size_t& r : rows) r *= static_cast<size_t>(width);
    return rows;
  };
  ep_->all_to_all_v(in, floats(in_rows), out, floats(out_rows));
}

// Dropless top-k routing: every token reaches all k of its experts, each
// expert runs one GEMM over the tokens routed to it, and the outputs are
// combined with the renormalised gates.
void Gpt::moe_forward(Slot& s, int block, const float* p, const float* inp, float* out, int N) {
  MoeLayer& moe = *s.blocks[static_cast<size_t>(block)].moe;
  const BlockOffsets& o = scratch_->offsets[static_cast<size_t>(stage().chunk_begin(s.chunk) + block)];
  Backend& k = backend_;
  const int C = static_cast<int>(config_.n_embd), E = static_cast<int>(config_.n_expert);
  const int K = static_cast<int>(config_.top_k), M = N * K, Fl = 4 * C / tp_size_;

  k.matmul_forward(moe.router_logits.data(), inp, p + o.router_w, nullptr, N, C, E);
  k.softmax_forward(moe.probs.data(), moe.router_logits.data(), N, E);
  moe.probs_host.resize(static_cast<size_t>(N) * E);
  k.copy_to_host(moe.probs_host.data(), moe.probs.data(), moe.probs_host.size() * sizeof(float));

  // Top-k per token; ties go to the lower expert index.
  moe.choice.resize(static_cast<size_t>(M));
  std::vector<float> chosen_gate(static_cast<size_t>(M));
  std::vector<int> order(static_cast<size_t>(E));
  std::vector<int> count(static_cast<size_t>(E), 0);
  for (int n = 0; n < N; ++n) {
    const float* pr = moe.probs_host.data() + static_cast<size_t>(n) * E;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(),
                      [pr](int x, int y) { return pr[x] > pr[y] || (pr[x] == pr[y] && x < y); });
    float total = 0.0f;
    for (int j = 0; j < K; ++j) total += pr[order[j]];
    for (int j = 0; j < K; ++j) {
      moe.choice[static_cast<size_t>(n) * K + j] = order[j];
      chosen_gate[static_cast<size_t>(n) * K + j] = pr[order[j]] / total;
      ++count[order[j]];
    }
  }
  // Group the slots by expert, tokens in increasing order within each.
  moe.expert_start.assign(static_cast<size_t>(E) + 1, 0);
  for (int e = 0; e < E; ++e) moe.expert_start[e + 1] = moe.expert_start[e] + count[e];
  std::vector<int32_t> rows_host(static_cast<size_t>(M));
  moe.gates_host.resize(static_cast<size_t>(M));
  moe.slot.resize(static_cast<size_t>(M));
  std::vector<int> fill(moe.expert_start.begin(), moe.expert_start.end() - 1);
  for (int n = 0; n < N; ++n) {
    for (int j = 0; j < K; ++j) {
      const size_t nj = static_cast<size_t>(n) * K + j;
      const int s = fill[moe.choice[nj]]++;
      rows_host[s] = n;
      moe.gates_host[s] = chosen_gate[nj];
      moe.slot[nj] = s;
    }
  }
  k.copy_from_host(moe.rows.data(), rows_host.data(), rows_host.size() * sizeof(int32_t));
  k.copy_from_host(moe.gates.data(), moe.gates_host.data(), moe.gates_host.size() * sizeof(float));
  plan_dispatch(moe, count);

  Scratch& x = *scratch_;
  float* dispatched = ep_ != nullptr ? x.token_rows.data() : moe.xe.data();
  k.gather_rows(dispatched, inp, moe.rows.data(), nullptr, M, C);
  if (ep_ != nullptr) exchange_rows(dispatched, moe.sent, moe.xe.data(), moe.received, C);
  float* expert_out = ep_ != nullptr ? x.expert_rows.data() : moe.ye.data();
  for (const MoeLayer::Segment& seg : moe.segments) {
    const size_t r = static_cast<size_t>(seg.begin);
    const size_t e = static_cast<size_t>(seg.expert);
    k.matmul_forward(moe.he.data() + r * Fl, moe.xe.data() + r * C, p + o.expert_fc_w[e], p + o.expert_fc_b[e],
                     seg.rows, C, Fl);
    k.gelu_forward(moe.ge.data() + r * Fl, moe.he.data() + r * Fl, static_cast<size_t>(seg.rows) * Fl);
    // The row-parallel bias once over the TP group, on its rank 0.
    k.matmul_forward(expert_out + r * C, moe.ge.data() + r * Fl, p + o.expert_proj_w[e],
                     tp_rank_ == 0 ? p + o.expert_proj_b[e] : nullptr, seg.rows, Fl, C);
  }
  if (ep_ != nullptr) exchange_rows(expert_out, moe.received, moe.ye.data(), moe.sent, C);
  k.zero(out, static_cast<size_t>(N) * C * sizeof(float));
  k.scatter_add_rows(out, moe.ye.data(), moe.rows.data(), moe.gates.data(), M, C);

  // Switch load-balancing loss: coef * E * sum_e f_e * P_e, with f_e the
  // fraction of slots routed to e (no gradient) and P_e its mean
  // probability, both over the microbatch's tokens on every dp x cp rank,
  // so that every layout computes the single rank's loss.
  std::vector<double> totals(2 * static_cast<size_t>(E), 0.0);  // slots, then probabilities, per expert
  for (int e = 0; e < E; ++e) {
    totals[e] = count[e];
    for (int n = 0; n < N; ++n) totals[E + e] += moe.probs_host[static_cast<size_t>(n) * E + e];
  }
  if (batch_group_ != nullptr) {
    std::vector<float> sums(totals.begin(), totals.end());
    batch_group_->all_reduce(sums.data(), sums.size());
    totals.assign(sums.begin(), sums.end());
  }
  const double ranks = batch_group_ != nullptr ? batch_group_->size() : 1;
  moe.load.assign(static_cast<size_t>(E), 0.0);
  moe.tokens.assign(totals.begin(), totals.begin() + E);
  double aux = 0.0;
  for (int e = 0; e < E; ++e) {
    moe.load[e] = totals[e] / (M * ranks);
    aux += moe.load[e] * totals[E + e] / (N * ranks);
  }
  aux_loss_ += static_cast<float>(config_.aux_loss_coef * E * aux);
}

std::vector<Gpt::ExpertTokens> Gpt::expert_tokens(int slot) const {
  const Slot& s = slots_[static_cast<size_t>(slot)];
  std::vector<ExpertTokens> tokens;
  for (int64_t i = 0; i < stage().chunk_blocks(s.chunk); ++i) {
    const int64_t layer = stage().layer(stage().chunk_begin(s.chunk) + i);
    if (config_.is_moe_layer(layer)) tokens.push_back({layer, s.blocks[static_cast<size_t>(i)].moe->tokens});
  }
  return tokens;
}

void Gpt::moe_backward(Slot& s, int block, const float* p, float* g, float* dinp, const float* dout, float loss_scale,
                       int N) {
  Scratch& x = *scratch_;
  MoeLayer& moe = *s.blocks[static_cast<size_t>(block)].moe;
  const BlockOffsets& o = x.offsets[static_cast<size_t>(stage().chunk_begin(s.chunk) + block)];
  Backend& k = backend_;
  const int C = static_cast<int>(config_.n_embd), E = static_cast<int>(config_.n_expert);
  const int K = static_cast<int>(config_.top_k), M = N * K, Fl = 4 * C / tp_size_;
  // Without g, a split backward.
  auto keep = [&](ArenaArray<float>& kept, const float* from, size_t numel) {
    keep_for_weight_pass(k, g == nullptr, kept, from, numel);
  };

  // Combine: out[n] = sum_j gate * y. Gate gradients first (with TP each
  // rank's y is a partial sum, so are they), then each expert's output
  // gradient is the gated dout of its token.
  k.gathered_row_dot(x.dgates.data(), dout, moe.rows.data(), moe.ye.data(), M, C);
  if (tp_ != nullptr) tp_->all_reduce(x.dgates.data(), static_cast<size_t>(M));
  k.gather_rows(x.dye.data(), dout, moe.rows.data(), moe.gates.data(), M, C);
  // Under EP the output gradients travel to the experts the outputs came
  // from, and the input gradients back, as in forward.
  const float* dy = x.dye.data();
  if (ep_ != nullptr) {
    exchange_rows(x.dye.data(), moe.sent, x.expert_rows.data(), moe.received, C);
    dy = x.expert_rows.data();
  }
  x.dxe.zero();
  x.dge.zero();
  x.dhe.zero();
  for (const MoeLayer::Segment& seg : moe.segments) {
    const size_t r = static_cast<size_t>(seg.begin);
    const size_t e = static_cast<size_t>(seg.expert);
    k.matmul_backward(x.dge.data() + r * Fl, gradient_at(g, o.expert_proj_w[e]), gradient_at(g, o.expert_proj_b[e]),
                      dy + r * C, moe.ge.data() + r * Fl, p + o.expert_proj_w[e], seg.rows, Fl, C);
    k.gelu_backward(x.dhe.data() + r * Fl, moe.he.data() + r * Fl, x.dge.data() + r * Fl,
                    static_cast<size_t>(seg.rows) * Fl);
    k.matmul_backward(x.dxe.data() + r * C, gradient_at(g, o.expert_fc_w[e]), gradient_at(g, o.expert_fc_b[e]),
                      x.dhe.data() + r * Fl, moe.xe.data() + r * C, p + o.expert_fc_w[e], seg.rows, C, Fl);
  }
  keep(moe.dy, dy, moe.expert_rows() * C);
  keep(moe.dhe, x.dhe.data(), moe.expert_rows() * Fl);
  const float* dxe = x.dxe.data();
  if (ep_ != nullptr) {
    exchange_rows(x.dxe.data(), moe.received, x.token_rows.data(), moe.sent, C);
    dxe = x.token_rows.data();
  }
  k.scatter_add_rows(dinp, dxe, moe.rows.data(), nullptr, M, C);

  // Router: through the gate renormalisation w_j = p_j / sum_i p_i, plus the
  // aux loss's d/dp[n, e] = coef * E * f_e / N.
  std::vector<float> dgates(static_cast<size_t>(M));
  k.copy_to_host(dgates.data(), x.dgates.data(), dgates.size() * sizeof(float));
  std::vector<float> dprobs(static_cast<size_t>(N) * E);
  for (int n = 0; n < N; ++n) {
    const size_t base = static_cast<size_t>(n) * K;
    const float* pr = moe.probs_host.data() + static_cast<size_t>(n) * E;
    float total = 0.0f, weighted = 0.0f;
    for (int j = 0; j < K; ++j) total += pr[moe.choice[base + j]];
    for (int j = 0; j < K; ++j) {
      const int s = moe.slot[base + j];
      weighted += dgates[s] * moe.gates_host[s];
    }
    float* dp = dprobs.data() + static_cast<size_t>(n) * E;
    for (int e = 0; e < E; ++e) {
      dp[e] = static_cast<float>(loss_scale * config_.aux_loss_coef * E * moe.load[e] / N);
    }
    for (int j = 0; j < K; ++j) dp[moe.choice[base + j]] += (dgates[moe.slot[base + j]] - weighted) / total;
  }
  k.copy_from_host(x.dprobs.data(), dprobs.data(), dprobs.size() * sizeof(float));
  x.drouter.zero();
  k.softmax_backward(x.drouter.data(), x.dprobs.data(), moe.probs.data(), N, E);
  // Every TP rank computed the router alike: its input gradient joins the
  // partial sums on TP rank 0 only, or the sum over the group would count it
  // tp times.
  k.matmul_backward(tp_rank_ == 0 ? dinp : nullptr, gradient_at(g, o.router_w), nullptr, x.drouter.data(),
                    s.blocks[static_cast<size_t>(block)].ln2_all(), p + o.router_w, N, C, E);
  keep(moe.drouter, x.drouter.data(), static_cast<size_t>(N) * E);
}

}  // namespace keel::trainer
