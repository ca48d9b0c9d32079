// Gpt's MoE blocks (docs/architecture.md "Model", "Expert parallelism"):
// dropless top-k routing, one GEMM per expert over its tokens, and under
// expert parallelism the all-to-all that carries tokens to their experts'
// ranks and back.
#include "trainer/model/gpt.h"
#include "trainer/model/gpt_state.h"

#include <algorithm>
#include <numeric>
#include <vector>

namespace keel::trainer {

void Gpt::plan_dispatch(MoeLayer& moe, const std::vector<int>& count) {
  const ParameterTable& table = storage_.table();
  const int E = sizes().E, El = static_cast<int>(table.local_experts());
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
void Gpt::moe_forward(Slot& s, int block, const UnitParameters& p, const float* inp, float* out, int N) {
  MoeLayer& moe = *s.blocks[static_cast<size_t>(block)].moe;
  const BlockOffsets& o = scratch_->offsets[static_cast<size_t>(stage().chunk_begin(s.chunk) + block)];
  Backend& k = backend_;
  const Sizes z = sizes();
  const int C = z.C, E = z.E, K = z.K, M = N * K, Fl = z.Fl, Fin = z.Fin;
  if (inp == nullptr) {
    throw common::Error(common::ErrorCode::kInternal, "an MoE block's norm output is not float32 (Gpt::lay_out)");
  }

  k.matmul_forward(moe.router_logits.data(), inp, p.weight(o.router_w), nullptr, N, C, E);
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
    k.matmul_forward(moe.he.data() + r * Fin, moe.xe.data() + r * C, p.weight(o.expert_fc_w[e]),
                     p.at(o.expert_fc_b[e]), seg.rows, C, Fin);
    activation_forward(moe.ge.data() + r * Fl, moe.he.data() + r * Fin, seg.rows);
    // The row-parallel bias once over the TP group, on its rank 0.
    k.matmul_forward(expert_out + r * C, moe.ge.data() + r * Fl, p.weight(o.expert_proj_w[e]),
                     tp_rank_ == 0 ? p.at(o.expert_proj_b[e]) : nullptr, seg.rows, Fl, C);
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

void Gpt::moe_backward(Slot& s, int block, const UnitParameters& p, bool weights, float* dinp, const float* dout,
                       float loss_scale, int N) {
  Scratch& x = *scratch_;
  MoeLayer& moe = *s.blocks[static_cast<size_t>(block)].moe;
  const BlockOffsets& o = x.offsets[static_cast<size_t>(stage().chunk_begin(s.chunk) + block)];
  Backend& k = backend_;
  const Sizes z = sizes();
  const int C = z.C, E = z.E, K = z.K, M = N * K, Fl = z.Fl, Fin = z.Fin;
  using Kind = WeightTerm::Kind;
  const int unit = static_cast<int>(stage().chunk_begin(s.chunk)) + block + 1;
  // Where a split backward keeps an output gradient (a fused one keeps none).
  auto kept = [&](ArenaArray<float>& in, size_t at) { return weights ? nullptr : in.data() + at; };

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
    backward_term(s, weights,
                  {Kind::kLinear, unit, o.expert_proj_w[e], o.expert_proj_b[e], dy + r * C, moe.ge.data() + r * Fl,
                   nullptr, nullptr, seg.rows, Fl, C},
                  x.dge.data() + r * Fl, p.weight(o.expert_proj_w[e]), kept(moe.dy, r * C));
    activation_backward(x.dhe.data() + r * Fin, moe.he.data() + r * Fin, x.dge.data() + r * Fl, seg.rows);
    backward_term(s, weights,
                  {Kind::kLinear, unit, o.expert_fc_w[e], o.expert_fc_b[e], x.dhe.data() + r * Fin,
                   moe.xe.data() + r * C, nullptr, nullptr, seg.rows, C, Fin},
                  x.dxe.data() + r * C, p.weight(o.expert_fc_w[e]), kept(moe.dhe, r * Fin));
  }
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
  backward_term(s, weights,
                {Kind::kLinear, unit, o.router_w, WeightTerm::kNone, x.drouter.data(),
                 s.blocks[static_cast<size_t>(block)].ln2_all(), nullptr, nullptr, N, C, E},
                tp_rank_ == 0 ? dinp : nullptr, p.weight(o.router_w), kept(moe.drouter, 0));
}

}  // namespace keel::trainer
