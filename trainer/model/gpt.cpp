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
  std::vector<size_t> expert_fc_w, expert_fc_b, expert_proj_w, expert_proj_b;
};

BlockOffsets block_offsets(const ParameterTable& t, const common::ModelConfig& m, int64_t i) {
  const std::string h = "h." + std::to_string(i);
  const size_t origin = t.unit_begin(static_cast<int>(i) + 1);
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
    for (int64_t e = 0; e < m.n_expert; ++e) {
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

// Unit 0: the embeddings and the final norm.
struct OuterOffsets {
  size_t wte = 0, wpe = 0, lnf_w = 0, lnf_b = 0;
};

OuterOffsets outer_offsets(const ParameterTable& t) {
  auto at = [&](const std::string& name) { return t.find(name).offset - t.unit_begin(0); };
  return OuterOffsets{at("wte"), at("wpe"), at("ln_f.weight"), at("ln_f.bias")};
}

}  // namespace

// The routing of one MoE block for the last forward: which token went to
// which expert with what gate, grouped by expert so each expert runs one
// GEMM over its tokens.
struct Gpt::MoeLayer {
  ArenaArray<float> router_logits, probs;  // [N, E]
  ArenaArray<int32_t> rows;                // [N*k]: token of each dispatched slot, grouped by expert
  ArenaArray<float> gates;                 // [N*k]: its renormalised gate
  ArenaArray<float> xe, he, ge, ye;        // expert input [N*k, C], fc [N*k, 4C], gelu [N*k, 4C], output [N*k, C]
  std::vector<int> expert_start;             // E + 1 slot offsets
  std::vector<float> probs_host;             // [N, E]
  std::vector<int32_t> slot;                 // [N, k]: slot of the token's j-th choice
  std::vector<int32_t> choice;               // [N, k]: expert of the token's j-th choice
  std::vector<float> gates_host;             // [N*k] by slot
  std::vector<double> load;                  // [E]: f_e, the fraction of slots routed to e
};

// Shapes: N = B*T positions, Ns = N / tp of them in this rank's position
// shard, and per rank Cl = C / tp attention channels, Fl = 4C / tp MLP
// channels and Vl = Vp / tp vocabulary rows. "whole" buffers hold all N
// positions and exist only with TP; without it they alias their shards.
struct Gpt::Activations {
  struct Block {
    ArenaArray<float> ln1, ln1_mean, ln1_rstd, ln1_whole, qkv, attn_lse, atty, residual2;
    ArenaArray<float> ln2, ln2_mean, ln2_rstd, ln2_whole, fch, fch_gelu, residual3;
    std::unique_ptr<MoeLayer> moe;
    const float* ln1_all() const { return ln1_whole.size() > 0 ? ln1_whole.data() : ln1.data(); }
    const float* ln2_all() const { return ln2_whole.size() > 0 ? ln2_whole.data() : ln2.data(); }
  };
  ArenaArray<int32_t> inputs, targets;  // [B, T]
  ArenaArray<float> encoded;            // [Ns, C]
  std::vector<Block> blocks;
  std::vector<BlockOffsets> offsets;
  OuterOffsets outer;
  ArenaArray<float> lnf, lnf_mean, lnf_rstd, lnf_whole, logits, losses, lse;
  ArenaArray<float> xent_stats, xent_all;  // [N, 3] of this rank, [tp, N, 3] of all
  // [N, C] with TP: the partial sums of a row-parallel linear or of the
  // embedding (forward), a gathered output gradient and an input gradient
  // to be summed (backward).
  ArenaArray<float> partial, dwhole_out, dwhole_in;
  // Gradient scratch, reused by every block.
  ArenaArray<float> dresidual, dln, datty, dqkv, dfch, dfch_gelu;
  // MoE gradient scratch.
  ArenaArray<float> dye, dge, dhe, dxe, dgates, dprobs, drouter;
};

Gpt::Gpt(const common::ModelConfig& config, Backend& backend, int max_batch, ModelStorage& storage, Communicator* tp)
    : config_(config),
      backend_(backend),
      storage_(storage),
      tp_(tp != nullptr && tp->size() > 1 ? tp : nullptr),
      tp_rank_(tp_ != nullptr ? tp_->rank() : 0),
      tp_size_(tp_ != nullptr ? tp_->size() : 1),
      max_batch_(max_batch),
      acts_(std::make_unique<Activations>()) {
  const size_t N = static_cast<size_t>(max_batch) * static_cast<size_t>(config.seq_len);
  if (N % static_cast<size_t>(tp_size_) != 0 || (tp_ != nullptr && config.n_expert > 0)) {
    throw common::Error(common::ErrorCode::kInternal, "TP layout not validated: B*T % tp != 0 or MoE with TP");
  }
  Activations& a = *acts_;
  a.outer = outer_offsets(storage.table());
  for (int64_t i = 0; i < config.n_layer; ++i) a.offsets.push_back(block_offsets(storage.table(), config, i));
}

void Gpt::lay_out(Arena& arena) {
  const common::ModelConfig& config = config_;
  const size_t B = static_cast<size_t>(max_batch_), T = static_cast<size_t>(config.seq_len);
  const size_t C = static_cast<size_t>(config.n_embd), tp_size = static_cast<size_t>(tp_size_);
  const size_t NHl = static_cast<size_t>(config.n_head) / tp_size, Cl = C / tp_size, Fl = 4 * C / tp_size;
  const size_t Vl = static_cast<size_t>(config.padded_vocab()) / tp_size, N = B * T, Ns = N / tp_size;
  const size_t E = static_cast<size_t>(config.n_expert), K = static_cast<size_t>(config.top_k);
  Activations& a = *acts_;
  auto take = [&arena](size_t count) { return arena.take<float>(count); };
  // With TP a buffer of all N positions; without, an empty one (the shard serves).
  auto whole = [&](size_t width) { return take(tp_ != nullptr ? N * width : 0); };
  a.blocks.clear();
  a.inputs = arena.take<int32_t>(N);
  a.targets = arena.take<int32_t>(N);
  a.encoded = take(Ns * C);
  bool any_moe = false;
  for (int64_t i = 0; i < config.n_layer; ++i) {
    Activations::Block blk;
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
    if (config.is_moe_layer(i)) {
      any_moe = true;
      auto moe = std::make_unique<MoeLayer>();
      moe->router_logits = take(N * E);
      moe->probs = take(N * E);
      moe->rows = arena.take<int32_t>(N * K);
      moe->gates = take(N * K);
      moe->xe = take(N * K * C);
      moe->he = take(N * K * 4 * C);
      moe->ge = take(N * K * 4 * C);
      moe->ye = take(N * K * C);
      blk.moe = std::move(moe);
    } else {
      blk.fch = take(N * Fl);
      blk.fch_gelu = take(N * Fl);
    }
    a.blocks.push_back(std::move(blk));
  }
  a.lnf = take(Ns * C);
  a.lnf_mean = take(Ns);
  a.lnf_rstd = take(Ns);
  a.lnf_whole = whole(C);
  a.logits = take(N * Vl);
  a.losses = take(N);
  a.lse = take(N);
  a.xent_stats = take(N * 3);
  a.xent_all = take(tp_ != nullptr ? tp_size * N * 3 : 0);
  a.partial = whole(C);
  a.dwhole_out = whole(C);
  a.dwhole_in = whole(C);
  a.dresidual = take(Ns * C);
  a.dln = take(Ns * C);
  a.datty = take(N * Cl);
  a.dqkv = take(N * 3 * Cl);
  a.dfch = take(N * Fl);
  a.dfch_gelu = take(N * Fl);
  if (any_moe) {
    a.dye = take(N * K * C);
    a.dge = take(N * K * 4 * C);
    a.dhe = take(N * K * 4 * C);
    a.dxe = take(N * K * C);
    a.dgates = take(N * K);
    a.dprobs = take(N * E);
    a.drouter = take(N * E);
  }
}

Gpt::~Gpt() = default;

const float* Gpt::logits() const { return acts_->logits.data(); }

void Gpt::gather_positions(const float* shard, float* whole, size_t shard_numel) {
  if (tp_ != nullptr) tp_->all_gather(shard, whole, shard_numel);
}

void Gpt::sum_into_positions(const float* partial, float* shard, size_t shard_numel) {
  if (tp_ != nullptr) tp_->reduce_scatter(partial, shard, shard_numel);
}

float Gpt::forward(const int32_t* inputs, const int32_t* targets, int B) {
  if (acts_->inputs.data() == nullptr) {
    throw common::Error(common::ErrorCode::kInternal, "Gpt::forward before lay_out() placed the activations");
  }
  if (B < 1 || B > max_batch_ || B * config_.seq_len % tp_size_ != 0) {
    throw common::Error(common::ErrorCode::kInternal,
                        "forward batch " + std::to_string(B) + " outside [1, " + std::to_string(max_batch_) +
                            "] or not splittable over " + std::to_string(tp_size_) + " TP ranks");
  }
  batch_ = B;
  const int T = static_cast<int>(config_.seq_len), C = static_cast<int>(config_.n_embd);
  const int N = B * T, Ns = N / tp_size_, Cl = C / tp_size_, Fl = 4 * C / tp_size_;
  const int NHl = static_cast<int>(config_.n_head) / tp_size_;
  const int V = static_cast<int>(config_.vocab_size), Vl = static_cast<int>(config_.padded_vocab()) / tp_size_;
  const int v_begin = tp_rank_ * Vl;
  const size_t NsC = static_cast<size_t>(Ns) * C;
  const bool first_tp_rank = tp_rank_ == 0;
  Activations& a = *acts_;
  Backend& k = backend_;
  const OuterOffsets& outer = a.outer;
  const float* p0 = storage_.acquire_parameters(0);
  const int blocks = static_cast<int>(a.blocks.size());
  if (blocks > 0) storage_.prefetch_parameters(1);
  // A row-parallel linear's output: partial sums to be reduce-scattered
  // with TP, the shard itself without.
  auto partial_or = [&](const ArenaArray<float>& shard) { return tp_ != nullptr ? a.partial.data() : shard.data(); };

  k.copy_from_host(a.inputs.data(), inputs, static_cast<size_t>(N) * sizeof(int32_t));
  k.copy_from_host(a.targets.data(), targets, static_cast<size_t>(N) * sizeof(int32_t));
  // The vocabulary shards each embed their own tokens; the position rows
  // and the row-parallel biases are added by TP rank 0 alone, so that the
  // sum over the group counts them once.
  k.embedding_forward(partial_or(a.encoded), a.inputs.data(), p0 + outer.wte, v_begin, Vl,
                      first_tp_rank ? p0 + outer.wpe : nullptr, B, T, C);
  sum_into_positions(a.partial.data(), a.encoded.data(), NsC);

  aux_loss_ = 0.0f;
  const float* residual = a.encoded.data();
  for (size_t i = 0; i < a.blocks.size(); ++i) {
    Activations::Block& blk = a.blocks[i];
    const BlockOffsets& o = a.offsets[i];
    const int unit = static_cast<int>(i) + 1;
    const float* p = storage_.acquire_parameters(unit);
    if (unit < blocks) storage_.prefetch_parameters(unit + 1);
    // Attention branch.
    k.layernorm_forward(blk.ln1.data(), blk.ln1_mean.data(), blk.ln1_rstd.data(), residual, p + o.ln1_w,
                        p + o.ln1_b, Ns, C);
    gather_positions(blk.ln1.data(), blk.ln1_whole.data(), NsC);
    k.matmul_forward(blk.qkv.data(), blk.ln1_all(), p + o.qkv_w, p + o.qkv_b, N, C, 3 * Cl);
    k.attention_forward(blk.atty.data(), blk.attn_lse.data(), Backend::self_attention(blk.qkv.data(), B, T, Cl, NHl));
    k.matmul_forward(partial_or(blk.residual2), blk.atty.data(), p + o.attproj_w,
                     first_tp_rank ? p + o.attproj_b : nullptr, N, Cl, C);
    sum_into_positions(a.partial.data(), blk.residual2.data(), NsC);
    // MLP (or MoE) branch, its LayerNorm fused with the attention branch's
    // residual add. (The block's output add stays apart: the activation
    // hook must see it before the next block reads it.)
    k.add_layernorm_forward(blk.residual2.data(), residual, blk.ln2.data(), blk.ln2_mean.data(),
                            blk.ln2_rstd.data(), p + o.ln2_w, p + o.ln2_b, Ns, C);
    if (blk.moe) {
      moe_forward(static_cast<int>(i), p, blk.ln2.data(), blk.residual3.data(), N);
    } else {
      gather_positions(blk.ln2.data(), blk.ln2_whole.data(), NsC);
      k.matmul_forward(blk.fch.data(), blk.ln2_all(), p + o.fc_w, p + o.fc_b, N, C, Fl);
      k.gelu_forward(blk.fch_gelu.data(), blk.fch.data(), static_cast<size_t>(N) * Fl);
      k.matmul_forward(partial_or(blk.residual3), blk.fch_gelu.data(), p + o.proj_w,
                       first_tp_rank ? p + o.proj_b : nullptr, N, Fl, C);
      sum_into_positions(a.partial.data(), blk.residual3.data(), NsC);
    }
    k.accumulate(blk.residual3.data(), blk.residual2.data(), NsC);
    if (activation_hook_) activation_hook_(static_cast<int>(i), blk.residual3.data(), NsC);
    residual = blk.residual3.data();
  }
  k.layernorm_forward(a.lnf.data(), a.lnf_mean.data(), a.lnf_rstd.data(), residual, p0 + outer.lnf_w,
                      p0 + outer.lnf_b, Ns, C);
  gather_positions(a.lnf.data(), a.lnf_whole.data(), NsC);
  // The LM head is tied to the token embedding: each rank scores its own
  // vocabulary rows, and the ranks exchange three floats per position.
  const float* lnf_all = tp_ != nullptr ? a.lnf_whole.data() : a.lnf.data();
  k.matmul_forward(a.logits.data(), lnf_all, p0 + outer.wte, nullptr, N, C, Vl);
  if (activation_hook_) {
    activation_hook_(static_cast<int>(a.blocks.size()), a.logits.data(), static_cast<size_t>(N) * Vl);
  }
  k.crossentropy_stats(a.xent_stats.data(), a.logits.data(), a.targets.data(), N, v_begin, Vl, V);
  if (tp_ != nullptr) tp_->all_gather(a.xent_stats.data(), a.xent_all.data(), static_cast<size_t>(N) * 3);
  k.crossentropy_combine(a.losses.data(), a.lse.data(), tp_ != nullptr ? a.xent_all.data() : a.xent_stats.data(),
                         tp_size_, N);
  return static_cast<float>(k.sum(a.losses.data(), static_cast<size_t>(N)) / N);
}

void Gpt::backward(float loss_scale) {
  const int B = batch_, T = static_cast<int>(config_.seq_len), C = static_cast<int>(config_.n_embd);
  const int N = B * T, Ns = N / tp_size_, Cl = C / tp_size_, Fl = 4 * C / tp_size_;
  const int NHl = static_cast<int>(config_.n_head) / tp_size_;
  const int V = static_cast<int>(config_.vocab_size), Vl = static_cast<int>(config_.padded_vocab()) / tp_size_;
  const int v_begin = tp_rank_ * Vl;
  const size_t NsC = static_cast<size_t>(Ns) * C;
  Activations& a = *acts_;
  Backend& k = backend_;
  const OuterOffsets& outer = a.outer;
  const float* p0 = storage_.acquire_parameters(0);
  float* g0 = storage_.unit_gradients(0);
  // The gradient of a sequence-parallel boundary, both ways: the shards of
  // an output gradient gathered (all-gather's backward is a reduce-scatter
  // and vice versa), and an input gradient summed into the shards.
  float* dout_all = tp_ != nullptr ? a.dwhole_out.data() : a.dresidual.data();
  float* din_all = tp_ != nullptr ? a.dwhole_in.data() : a.dln.data();
  const size_t din_numel = tp_ != nullptr ? static_cast<size_t>(N) * C : NsC;

  // Softmax cross-entropy gradient, written over the logits in place.
  k.crossentropy_backward(a.logits.data(), a.logits.data(), a.lse.data(), a.targets.data(),
                          loss_scale / static_cast<float>(N), N, v_begin, Vl, V);
  k.zero(din_all, din_numel * sizeof(float));
  const float* lnf_all = tp_ != nullptr ? a.lnf_whole.data() : a.lnf.data();
  k.matmul_backward(din_all, g0 + outer.wte, nullptr, a.logits.data(), lnf_all, p0 + outer.wte, N, C, Vl);
  sum_into_positions(din_all, a.dln.data(), NsC);
  const float* last_residual = a.blocks.back().residual3.data();
  a.dresidual.zero();
  k.layernorm_backward(a.dresidual.data(), g0 + outer.lnf_w, g0 + outer.lnf_b, a.dln.data(), last_residual,
                       p0 + outer.lnf_w, a.lnf_mean.data(), a.lnf_rstd.data(), Ns, C);

  // dresidual holds the gradient of this rank's shard of the residual
  // stream; each branch adds its input's gradient into it on the way down.
  for (size_t i = a.blocks.size(); i-- > 0;) {
    Activations::Block& blk = a.blocks[i];
    const BlockOffsets& o = a.offsets[i];
    const int unit = static_cast<int>(i) + 1;
    const float* p = storage_.acquire_parameters(unit);
    if (unit > 1) storage_.prefetch_parameters(unit - 1);
    float* g = storage_.unit_gradients(unit);
    const float* residual = i == 0 ? a.encoded.data() : a.blocks[i - 1].residual3.data();

    k.zero(din_all, din_numel * sizeof(float));
    if (blk.moe) {
      moe_backward(static_cast<int>(i), p, g, a.dln.data(), a.dresidual.data(), loss_scale, N);
    } else {
      gather_positions(a.dresidual.data(), dout_all, NsC);
      a.dfch_gelu.zero();
      k.matmul_backward(a.dfch_gelu.data(), g + o.proj_w, g + o.proj_b, dout_all, blk.fch_gelu.data(),
                        p + o.proj_w, N, Fl, C);
      a.dfch.zero();
      k.gelu_backward(a.dfch.data(), blk.fch.data(), a.dfch_gelu.data(), static_cast<size_t>(N) * Fl);
      k.matmul_backward(din_all, g + o.fc_w, g + o.fc_b, a.dfch.data(), blk.ln2_all(), p + o.fc_w, N, C, Fl);
      sum_into_positions(din_all, a.dln.data(), NsC);
    }
    k.layernorm_backward(a.dresidual.data(), g + o.ln2_w, g + o.ln2_b, a.dln.data(), blk.residual2.data(),
                         p + o.ln2_w, blk.ln2_mean.data(), blk.ln2_rstd.data(), Ns, C);

    gather_positions(a.dresidual.data(), dout_all, NsC);
    a.datty.zero();
    k.matmul_backward(a.datty.data(), g + o.attproj_w, g + o.attproj_b, dout_all, blk.atty.data(),
                      p + o.attproj_w, N, Cl, C);
    a.dqkv.zero();
    k.attention_backward(Backend::self_attention_grads(a.dqkv.data(), Cl), a.datty.data(), blk.atty.data(),
                         blk.attn_lse.data(), Backend::self_attention(blk.qkv.data(), B, T, Cl, NHl));
    k.zero(din_all, din_numel * sizeof(float));
    k.matmul_backward(din_all, g + o.qkv_w, g + o.qkv_b, a.dqkv.data(), blk.ln1_all(), p + o.qkv_w, N, C, 3 * Cl);
    sum_into_positions(din_all, a.dln.data(), NsC);
    k.layernorm_backward(a.dresidual.data(), g + o.ln1_w, g + o.ln1_b, a.dln.data(), residual, p + o.ln1_w,
                         blk.ln1_mean.data(), blk.ln1_rstd.data(), Ns, C);
    storage_.gradients_ready(unit);
  }
  gather_positions(a.dresidual.data(), dout_all, NsC);
  k.embedding_backward(g0 + outer.wte, g0 + outer.wpe, dout_all, a.inputs.data(), v_begin, Vl, B, T, C);
  storage_.gradients_ready(0);
}

// Dropless top-k routing: every token reaches all k of its experts, each
// expert runs one GEMM over the tokens routed to it, and the outputs are
// combined with the renormalised gates.
void Gpt::moe_forward(int layer, const float* p, const float* inp, float* out, int N) {
  Activations& a = *acts_;
  MoeLayer& moe = *a.blocks[layer].moe;
  const BlockOffsets& o = a.offsets[layer];
  Backend& k = backend_;
  const int C = static_cast<int>(config_.n_embd), E = static_cast<int>(config_.n_expert);
  const int K = static_cast<int>(config_.top_k), M = N * K;

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

  k.gather_rows(moe.xe.data(), inp, moe.rows.data(), nullptr, M, C);
  for (int e = 0; e < E; ++e) {
    const int start = moe.expert_start[e], n_e = moe.expert_start[e + 1] - start;
    if (n_e == 0) continue;
    const size_t r = static_cast<size_t>(start);
    k.matmul_forward(moe.he.data() + r * 4 * C, moe.xe.data() + r * C, p + o.expert_fc_w[e], p + o.expert_fc_b[e],
                     n_e, C, 4 * C);
    k.gelu_forward(moe.ge.data() + r * 4 * C, moe.he.data() + r * 4 * C, static_cast<size_t>(n_e) * 4 * C);
    k.matmul_forward(moe.ye.data() + r * C, moe.ge.data() + r * 4 * C, p + o.expert_proj_w[e],
                     p + o.expert_proj_b[e], n_e, 4 * C, C);
  }
  k.zero(out, static_cast<size_t>(N) * C * sizeof(float));
  k.scatter_add_rows(out, moe.ye.data(), moe.rows.data(), moe.gates.data(), M, C);

  // Switch load-balancing loss: coef * E * sum_e f_e * P_e, with f_e the
  // fraction of slots routed to e (no gradient) and P_e its mean probability.
  moe.load.assign(static_cast<size_t>(E), 0.0);
  double aux = 0.0;
  for (int e = 0; e < E; ++e) {
    moe.load[e] = static_cast<double>(count[e]) / M;
    double mean_prob = 0.0;
    for (int n = 0; n < N; ++n) mean_prob += moe.probs_host[static_cast<size_t>(n) * E + e];
    aux += moe.load[e] * mean_prob / N;
  }
  aux_loss_ += static_cast<float>(config_.aux_loss_coef * E * aux);
}

void Gpt::moe_backward(int layer, const float* p, float* g, float* dinp, const float* dout, float loss_scale,
                       int N) {
  Activations& a = *acts_;
  MoeLayer& moe = *a.blocks[layer].moe;
  const BlockOffsets& o = a.offsets[layer];
  Backend& k = backend_;
  const int C = static_cast<int>(config_.n_embd), E = static_cast<int>(config_.n_expert);
  const int K = static_cast<int>(config_.top_k), M = N * K;

  // Combine: out[n] = sum_j gate * y. Gate gradients first, then each
  // expert's output gradient is the gated dout of its token.
  k.gathered_row_dot(a.dgates.data(), dout, moe.rows.data(), moe.ye.data(), M, C);
  k.gather_rows(a.dye.data(), dout, moe.rows.data(), moe.gates.data(), M, C);
  a.dxe.zero();
  a.dge.zero();
  a.dhe.zero();
  for (int e = 0; e < E; ++e) {
    const int start = moe.expert_start[e], n_e = moe.expert_start[e + 1] - start;
    if (n_e == 0) continue;
    const size_t r = static_cast<size_t>(start);
    k.matmul_backward(a.dge.data() + r * 4 * C, g + o.expert_proj_w[e], g + o.expert_proj_b[e], a.dye.data() + r * C,
                      moe.ge.data() + r * 4 * C, p + o.expert_proj_w[e], n_e, 4 * C, C);
    k.gelu_backward(a.dhe.data() + r * 4 * C, moe.he.data() + r * 4 * C, a.dge.data() + r * 4 * C,
                    static_cast<size_t>(n_e) * 4 * C);
    k.matmul_backward(a.dxe.data() + r * C, g + o.expert_fc_w[e], g + o.expert_fc_b[e], a.dhe.data() + r * 4 * C,
                      moe.xe.data() + r * C, p + o.expert_fc_w[e], n_e, C, 4 * C);
  }
  k.scatter_add_rows(dinp, a.dxe.data(), moe.rows.data(), nullptr, M, C);

  // Router: through the gate renormalisation w_j = p_j / sum_i p_i, plus the
  // aux loss's d/dp[n, e] = coef * E * f_e / N.
  std::vector<float> dgates(static_cast<size_t>(M));
  k.copy_to_host(dgates.data(), a.dgates.data(), dgates.size() * sizeof(float));
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
  k.copy_from_host(a.dprobs.data(), dprobs.data(), dprobs.size() * sizeof(float));
  a.drouter.zero();
  k.softmax_backward(a.drouter.data(), a.dprobs.data(), moe.probs.data(), N, E);
  k.matmul_backward(dinp, g + o.router_w, nullptr, a.drouter.data(), a.blocks[layer].ln2.data(), p + o.router_w, N, C, E);
}

}  // namespace keel::trainer
