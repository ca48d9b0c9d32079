#include "trainer/model/gpt.h"

#include "common/error.h"

#include <algorithm>
#include <numeric>
#include <string>

namespace keel::trainer {
namespace {

// Where one block's tensors sit in the flat buffers.
struct BlockOffsets {
  size_t ln1_w = 0, ln1_b = 0, qkv_w = 0, qkv_b = 0, attproj_w = 0, attproj_b = 0, ln2_w = 0, ln2_b = 0;
  size_t fc_w = 0, fc_b = 0, proj_w = 0, proj_b = 0;  // dense MLP
  size_t router_w = 0;                                // MoE
  std::vector<size_t> expert_fc_w, expert_fc_b, expert_proj_w, expert_proj_b;
};

BlockOffsets block_offsets(const ParameterTable& t, const common::ModelConfig& m, int64_t i) {
  const std::string h = "h." + std::to_string(i);
  auto at = [&](const std::string& name) { return t.find(h + name).offset; };
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

}  // namespace

// The routing of one MoE block for the last forward: which token went to
// which expert with what gate, grouped by expert so each expert runs one
// GEMM over its tokens.
struct Gpt::MoeLayer {
  BackendArray<float> router_logits, probs;  // [N, E]
  BackendArray<int32_t> rows;                // [N*k]: token of each dispatched slot, grouped by expert
  BackendArray<float> gates;                 // [N*k]: its renormalised gate
  BackendArray<float> xe, he, ge, ye;        // expert input [N*k, C], fc [N*k, 4C], gelu [N*k, 4C], output [N*k, C]
  std::vector<int> expert_start;             // E + 1 slot offsets
  std::vector<float> probs_host;             // [N, E]
  std::vector<int32_t> slot;                 // [N, k]: slot of the token's j-th choice
  std::vector<int32_t> choice;               // [N, k]: expert of the token's j-th choice
  std::vector<float> gates_host;             // [N*k] by slot
  std::vector<double> load;                  // [E]: f_e, the fraction of slots routed to e
};

struct Gpt::Activations {
  struct Block {
    BackendArray<float> ln1, ln1_mean, ln1_rstd, qkv, att, atty, residual2;
    BackendArray<float> ln2, ln2_mean, ln2_rstd, fch, fch_gelu, residual3;
    std::unique_ptr<MoeLayer> moe;
  };
  BackendArray<int32_t> inputs, targets;  // [B, T]
  BackendArray<float> encoded;            // [B, T, C]
  std::vector<Block> blocks;
  std::vector<BlockOffsets> offsets;
  BackendArray<float> lnf, lnf_mean, lnf_rstd, logits, losses;
  // Gradient scratch, reused by every block.
  BackendArray<float> dresidual, dln, datty, dqkv, dfch, dfch_gelu, dattention;
  // MoE gradient scratch.
  BackendArray<float> dye, dge, dhe, dxe, dgates, dprobs, drouter;
};

Gpt::Gpt(const common::ModelConfig& config, Backend& backend, int max_batch)
    : config_(config),
      backend_(backend),
      table_(config),
      max_batch_(max_batch),
      params_(backend, table_.total()),
      grads_(backend, table_.total()),
      acts_(std::make_unique<Activations>()) {
  const size_t B = static_cast<size_t>(max_batch), T = static_cast<size_t>(config.seq_len);
  const size_t C = static_cast<size_t>(config.n_embd), NH = static_cast<size_t>(config.n_head);
  const size_t Vp = static_cast<size_t>(config.padded_vocab()), N = B * T;
  const size_t E = static_cast<size_t>(config.n_expert), K = static_cast<size_t>(config.top_k);
  Activations& a = *acts_;
  a.inputs = BackendArray<int32_t>(backend, N);
  a.targets = BackendArray<int32_t>(backend, N);
  a.encoded = BackendArray<float>(backend, N * C);
  bool any_moe = false;
  for (int64_t i = 0; i < config.n_layer; ++i) {
    a.offsets.push_back(block_offsets(table_, config, i));
    Activations::Block blk;
    blk.ln1 = BackendArray<float>(backend, N * C);
    blk.ln1_mean = BackendArray<float>(backend, N);
    blk.ln1_rstd = BackendArray<float>(backend, N);
    blk.qkv = BackendArray<float>(backend, N * 3 * C);
    blk.att = BackendArray<float>(backend, B * NH * T * T);
    blk.atty = BackendArray<float>(backend, N * C);
    blk.residual2 = BackendArray<float>(backend, N * C);
    blk.ln2 = BackendArray<float>(backend, N * C);
    blk.ln2_mean = BackendArray<float>(backend, N);
    blk.ln2_rstd = BackendArray<float>(backend, N);
    blk.residual3 = BackendArray<float>(backend, N * C);
    if (config.is_moe_layer(i)) {
      any_moe = true;
      auto moe = std::make_unique<MoeLayer>();
      moe->router_logits = BackendArray<float>(backend, N * E);
      moe->probs = BackendArray<float>(backend, N * E);
      moe->rows = BackendArray<int32_t>(backend, N * K);
      moe->gates = BackendArray<float>(backend, N * K);
      moe->xe = BackendArray<float>(backend, N * K * C);
      moe->he = BackendArray<float>(backend, N * K * 4 * C);
      moe->ge = BackendArray<float>(backend, N * K * 4 * C);
      moe->ye = BackendArray<float>(backend, N * K * C);
      blk.moe = std::move(moe);
    } else {
      blk.fch = BackendArray<float>(backend, N * 4 * C);
      blk.fch_gelu = BackendArray<float>(backend, N * 4 * C);
    }
    a.blocks.push_back(std::move(blk));
  }
  a.lnf = BackendArray<float>(backend, N * C);
  a.lnf_mean = BackendArray<float>(backend, N);
  a.lnf_rstd = BackendArray<float>(backend, N);
  a.logits = BackendArray<float>(backend, N * Vp);
  a.losses = BackendArray<float>(backend, N);
  a.dresidual = BackendArray<float>(backend, N * C);
  a.dln = BackendArray<float>(backend, N * C);
  a.datty = BackendArray<float>(backend, N * C);
  a.dqkv = BackendArray<float>(backend, N * 3 * C);
  a.dfch = BackendArray<float>(backend, N * 4 * C);
  a.dfch_gelu = BackendArray<float>(backend, N * 4 * C);
  a.dattention = BackendArray<float>(backend, B * NH * T * T);
  if (any_moe) {
    a.dye = BackendArray<float>(backend, N * K * C);
    a.dge = BackendArray<float>(backend, N * K * 4 * C);
    a.dhe = BackendArray<float>(backend, N * K * 4 * C);
    a.dxe = BackendArray<float>(backend, N * K * C);
    a.dgates = BackendArray<float>(backend, N * K);
    a.dprobs = BackendArray<float>(backend, N * E);
    a.drouter = BackendArray<float>(backend, N * E);
  }
}

Gpt::~Gpt() = default;

void Gpt::init(uint64_t seed) {
  std::vector<float> host(table_.total());
  init_parameters(table_, seed, host.data());
  backend_.copy_from_host(params_.data(), host.data(), host.size() * sizeof(float));
}

const float* Gpt::logits() const { return acts_->logits.data(); }

float Gpt::forward(const int32_t* inputs, const int32_t* targets, int B) {
  if (B < 1 || B > max_batch_) {
    throw common::Error(common::ErrorCode::kInternal,
                        "forward batch " + std::to_string(B) + " outside [1, " + std::to_string(max_batch_) + "]");
  }
  batch_ = B;
  const int T = static_cast<int>(config_.seq_len), C = static_cast<int>(config_.n_embd);
  const int NH = static_cast<int>(config_.n_head), N = B * T;
  const int V = static_cast<int>(config_.vocab_size), Vp = static_cast<int>(config_.padded_vocab());
  Activations& a = *acts_;
  Backend& k = backend_;
  const float* p = params_.data();
  const ParameterTable& t = table_;

  k.copy_from_host(a.inputs.data(), inputs, static_cast<size_t>(N) * sizeof(int32_t));
  k.copy_from_host(a.targets.data(), targets, static_cast<size_t>(N) * sizeof(int32_t));
  k.embedding_forward(a.encoded.data(), a.inputs.data(), p + t.find("wte").offset, p + t.find("wpe").offset, B, T, C);

  aux_loss_ = 0.0f;
  const float* residual = a.encoded.data();
  for (size_t i = 0; i < a.blocks.size(); ++i) {
    Activations::Block& blk = a.blocks[i];
    const BlockOffsets& o = a.offsets[i];
    // Attention branch.
    k.layernorm_forward(blk.ln1.data(), blk.ln1_mean.data(), blk.ln1_rstd.data(), residual, p + o.ln1_w, p + o.ln1_b, N, C);
    k.matmul_forward(blk.qkv.data(), blk.ln1.data(), p + o.qkv_w, p + o.qkv_b, N, C, 3 * C);
    k.attention_forward(blk.atty.data(), blk.att.data(), blk.qkv.data(), B, T, C, NH);
    k.matmul_forward(blk.residual2.data(), blk.atty.data(), p + o.attproj_w, p + o.attproj_b, N, C, C);
    k.accumulate(blk.residual2.data(), residual, static_cast<size_t>(N) * C);
    // MLP (or MoE) branch.
    k.layernorm_forward(blk.ln2.data(), blk.ln2_mean.data(), blk.ln2_rstd.data(), blk.residual2.data(), p + o.ln2_w,
                        p + o.ln2_b, N, C);
    if (blk.moe) {
      moe_forward(static_cast<int>(i), blk.ln2.data(), blk.residual3.data(), N);
    } else {
      k.matmul_forward(blk.fch.data(), blk.ln2.data(), p + o.fc_w, p + o.fc_b, N, C, 4 * C);
      k.gelu_forward(blk.fch_gelu.data(), blk.fch.data(), static_cast<size_t>(N) * 4 * C);
      k.matmul_forward(blk.residual3.data(), blk.fch_gelu.data(), p + o.proj_w, p + o.proj_b, N, 4 * C, C);
    }
    k.accumulate(blk.residual3.data(), blk.residual2.data(), static_cast<size_t>(N) * C);
    residual = blk.residual3.data();
  }
  k.layernorm_forward(a.lnf.data(), a.lnf_mean.data(), a.lnf_rstd.data(), residual, p + t.find("ln_f.weight").offset,
                      p + t.find("ln_f.bias").offset, N, C);
  // The LM head is tied to the token embedding.
  k.matmul_forward(a.logits.data(), a.lnf.data(), p + t.find("wte").offset, nullptr, N, C, Vp);
  k.crossentropy_forward_backward(a.losses.data(), nullptr, a.logits.data(), a.targets.data(), 0.0f, N, V, Vp);
  return static_cast<float>(k.sum(a.losses.data(), static_cast<size_t>(N)) / N);
}

void Gpt::backward(float loss_scale) {
  const int B = batch_, T = static_cast<int>(config_.seq_len), C = static_cast<int>(config_.n_embd);
  const int NH = static_cast<int>(config_.n_head), N = B * T;
  const int V = static_cast<int>(config_.vocab_size), Vp = static_cast<int>(config_.padded_vocab());
  const size_t NC = static_cast<size_t>(N) * C;
  Activations& a = *acts_;
  Backend& k = backend_;
  const float* p = params_.data();
  float* g = grads_.data();
  const ParameterTable& t = table_;
  const size_t wte = t.find("wte").offset;

  // Softmax cross-entropy gradient, written over the logits in place.
  k.crossentropy_forward_backward(a.losses.data(), a.logits.data(), a.logits.data(), a.targets.data(),
                                  loss_scale / static_cast<float>(N), N, V, Vp);
  a.dln.zero();
  k.matmul_backward(a.dln.data(), g + wte, nullptr, a.logits.data(), a.lnf.data(), p + wte, N, C, Vp);
  const float* last_residual = a.blocks.back().residual3.data();
  a.dresidual.zero();
  k.layernorm_backward(a.dresidual.data(), g + t.find("ln_f.weight").offset, g + t.find("ln_f.bias").offset,
                       a.dln.data(), last_residual, p + t.find("ln_f.weight").offset, a.lnf_mean.data(),
                       a.lnf_rstd.data(), N, C);

  // dresidual holds the gradient of the residual stream; each branch adds
  // its input's gradient into it on the way down.
  for (size_t i = a.blocks.size(); i-- > 0;) {
    Activations::Block& blk = a.blocks[i];
    const BlockOffsets& o = a.offsets[i];
    const float* residual = i == 0 ? a.encoded.data() : a.blocks[i - 1].residual3.data();

    a.dln.zero();
    if (blk.moe) {
      moe_backward(static_cast<int>(i), a.dln.data(), a.dresidual.data(), loss_scale, N);
    } else {
      a.dfch_gelu.zero();
      k.matmul_backward(a.dfch_gelu.data(), g + o.proj_w, g + o.proj_b, a.dresidual.data(), blk.fch_gelu.data(),
                        p + o.proj_w, N, 4 * C, C);
      a.dfch.zero();
      k.gelu_backward(a.dfch.data(), blk.fch.data(), a.dfch_gelu.data(), NC * 4);
      k.matmul_backward(a.dln.data(), g + o.fc_w, g + o.fc_b, a.dfch.data(), blk.ln2.data(), p + o.fc_w, N, C, 4 * C);
    }
    k.layernorm_backward(a.dresidual.data(), g + o.ln2_w, g + o.ln2_b, a.dln.data(), blk.residual2.data(),
                         p + o.ln2_w, blk.ln2_mean.data(), blk.ln2_rstd.data(), N, C);

    a.datty.zero();
    k.matmul_backward(a.datty.data(), g + o.attproj_w, g + o.attproj_b, a.dresidual.data(), blk.atty.data(),
                      p + o.attproj_w, N, C, C);
    a.dqkv.zero();
    k.attention_backward(a.dqkv.data(), a.dattention.data(), a.datty.data(), blk.qkv.data(), blk.att.data(), B, T, C, NH);
    a.dln.zero();
    k.matmul_backward(a.dln.data(), g + o.qkv_w, g + o.qkv_b, a.dqkv.data(), blk.ln1.data(), p + o.qkv_w, N, C, 3 * C);
    k.layernorm_backward(a.dresidual.data(), g + o.ln1_w, g + o.ln1_b, a.dln.data(), residual, p + o.ln1_w,
                         blk.ln1_mean.data(), blk.ln1_rstd.data(), N, C);
  }
  k.embedding_backward(g + wte, g + t.find("wpe").offset, a.dresidual.data(), a.inputs.data(), B, T, C);
}

// Dropless top-k routing: every token reaches all k of its experts, each
// expert runs one GEMM over the tokens routed to it, and the outputs are
// combined with the renormalised gates.
void Gpt::moe_forward(int layer, const float* inp, float* out, int N) {
  Activations& a = *acts_;
  MoeLayer& moe = *a.blocks[layer].moe;
  const BlockOffsets& o = a.offsets[layer];
  Backend& k = backend_;
  const float* p = params_.data();
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

void Gpt::moe_backward(int layer, float* dinp, const float* dout, float loss_scale, int N) {
  Activations& a = *acts_;
  MoeLayer& moe = *a.blocks[layer].moe;
  const BlockOffsets& o = a.offsets[layer];
  Backend& k = backend_;
  const float* p = params_.data();
  float* g = grads_.data();
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
