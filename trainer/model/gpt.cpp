#include "trainer/model/gpt.h"

#include "common/error.h"
#include "trainer/kernels/arena.h"
#include "trainer/model/gpt_state.h"
#include "trainer/model/rotary_table.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>

namespace keel::trainer {

namespace {

// Calls visit(spec, its offset within the unit's buffer) for each tensor of `unit`.
template <class Visit> void for_each_in_unit(const ParameterTable& t, int unit, Visit visit) {
  for (size_t i = t.unit_first_tensor(unit); i < t.unit_end_tensor(unit); ++i) {
    visit(t.specs()[i], t.specs()[i].offset - t.unit_begin(unit));
  }
}

}  // namespace

BlockOffsets block_offsets(const ParameterTable& t, int unit) {
  using Role = ModelParts::Role;
  BlockOffsets o;
  for_each_in_unit(t, unit, [&o](const ParamSpec& spec, size_t at) {
    const bool expert = spec.expert;
    switch (spec.role) {
      case Role::kNorm1: o.ln1_w = at; break;
      case Role::kNorm1Bias: o.ln1_b = at; break;
      case Role::kQkv: o.qkv_w = at; break;
      case Role::kQkvBias: o.qkv_b = at; break;
      case Role::kAttentionOut: o.attproj_w = at; break;
      case Role::kAttentionOutBias: o.attproj_b = at; break;
      case Role::kNorm2: o.ln2_w = at; break;
      case Role::kNorm2Bias: o.ln2_b = at; break;
      case Role::kRouter: o.router_w = at; break;
      // An expert's tensors come expert by expert, in local order.
      case Role::kMlpIn: (expert ? o.expert_fc_w.emplace_back() : o.fc_w) = at; break;
      case Role::kMlpInBias: (expert ? o.expert_fc_b.emplace_back() : o.fc_b) = at; break;
      case Role::kMlpOut: (expert ? o.expert_proj_w.emplace_back() : o.proj_w) = at; break;
      case Role::kMlpOutBias: (expert ? o.expert_proj_b.emplace_back() : o.proj_b) = at; break;
      default: break;  // packed after kQkv or kMlpIn, or not a block's
    }
  });
  // Experts without biases keep none; the MoE code reads them by index.
  o.expert_fc_b.resize(o.expert_fc_w.size(), kNoTensor);
  o.expert_proj_b.resize(o.expert_proj_w.size(), kNoTensor);
  return o;
}

OuterOffsets outer_offsets(const ParameterTable& t) {
  using Role = ModelParts::Role;
  OuterOffsets o;
  for_each_in_unit(t, 0, [&o](const ParamSpec& spec, size_t at) {
    switch (spec.role) {
      case Role::kTokenEmbedding: o.wte = at; break;
      case Role::kPositionEmbedding: o.wpe = at; break;
      case Role::kFinalNorm: o.lnf_w = at; break;
      case Role::kFinalNormBias: o.lnf_b = at; break;
      case Role::kHead: o.head = at; break;
      default: break;
    }
  });
  if (t.parts().tied_head) o.head = o.wte;
  return o;
}

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
  if (parts().positions == ModelParts::Positions::kRotary) {
    const RotaryTable table = rotary_table(config);
    x.rotary_cos = BackendArray<float>(backend, table.cos.size());
    x.rotary_sin = BackendArray<float>(backend, table.sin.size());
    backend.copy_from_host(x.rotary_cos.data(), table.cos.data(), x.rotary_cos.bytes());
    backend.copy_from_host(x.rotary_sin.data(), table.sin.data(), x.rotary_sin.bytes());
  }
  x.outer = outer_offsets(storage.table());
  for (int64_t b = 0; b < stage().layers(); ++b) {
    x.offsets.push_back(block_offsets(storage.table(), static_cast<int>(b) + 1));
  }
}

void Gpt::lay_out(Arena& arena) {
  const common::ModelConfig& config = config_;
  const Sizes z = sizes();
  auto count = [](int n) { return static_cast<size_t>(n); };
  const size_t C = count(z.C), NHl = count(z.NHl), Cl = count(z.Cl), W = count(z.W), KVl = count(z.KVl),
               Fl = count(z.Fl), Fin = count(z.Fin), Vl = count(z.Vl);
  const size_t B = count(max_batch_), T = count(z.T);
  const size_t N = count(z.N(max_batch_)), Ns = count(z.Ns(max_batch_)), E = count(z.E), K = count(z.K);
  // Dropless: under EP every EP rank may route all its slots to this rank's experts.
  const size_t ep = ep_ != nullptr ? static_cast<size_t>(ep_->size()) : 1, R = ep * N * K;
  const bool first = stage().first(), last = stage().last();
  auto take = [&arena](size_t count) { return arena.take<float>(count); };
  // With TP a buffer of all N positions; without, an empty one (the shard serves).
  auto whole = [&](size_t width) { return take(tp_ != nullptr ? N * width : 0); };
  // The norm outputs only GEMMs read, in the GEMMs' input type where
  // sequence parallelism's all-gather can carry it.
  const DType gemm_in = backend_.gemm_inputs();
  const DType ln_type = tp_ == nullptr || tp_->carries(gemm_in) ? gemm_in : DType::kF32;
  auto ln_out = [&](DType type, size_t rows) { return arena.take_buffer(type, rows * C); };
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
  // qkv (read by attention only), attention's output (read by the
  // projection's GEMMs and attention's backward) and dqkv (read by the qkv
  // linear's GEMMs only) in the GEMMs' input type where no ring passes keys
  // around and merges outputs (the ring carries, merges and sums float32).
  const DType attention_type = cp_ == nullptr ? gemm_in : DType::kF32;
  // The residual stream's gradient as the dense linears take it
  // (Scratch::dresidual_gemm): bf16 where the GEMMs take bf16 and no TP
  // gathers it first.
  const bool rounds_residual = gemm_in == DType::kBF16 && tp_ == nullptr;
  const DType residual_gemm = rounds_residual ? gemm_in : DType::kF32;
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
      blk.ln1 = ln_out(ln_type, Ns);
      blk.ln1_mean = take(Ns);
      blk.ln1_rstd = take(Ns);
      blk.ln1_whole = ln_out(ln_type, tp_ != nullptr ? N : 0);
      blk.qkv = arena.take_buffer(attention_type, N * W);
      blk.attn_lse = take(static_cast<size_t>(B) * NHl * T);
      blk.atty = arena.take_buffer(attention_type, N * Cl);
      blk.residual2 = take(Ns * C);
      // An MoE block's dispatch copies rows of ln2 (float32 only).
      const DType ln2_type = moe_at[i] ? DType::kF32 : ln_type;
      blk.ln2 = ln_out(ln2_type, Ns);
      blk.ln2_mean = take(Ns);
      blk.ln2_rstd = take(Ns);
      blk.ln2_whole = ln_out(ln2_type, tp_ != nullptr ? N : 0);
      blk.residual3 = take(Ns * C);
      if (moe_at[i]) {
        any_moe = true;
        auto moe = std::make_unique<MoeLayer>();
        moe->router_logits = take(N * E);
        moe->probs = take(N * E);
        moe->rows = arena.take<int32_t>(N * K);
        moe->gates = take(N * K);
        moe->xe = take(R * C);
        moe->he = take(R * Fin);
        moe->ge = take(R * Fl);
        moe->ye = take(N * K * C);
        if (split_backward_) {
          moe->dy = take(R * C);
          moe->dhe = take(R * Fin);
          moe->drouter = take(N * E);
        }
        blk.moe = std::move(moe);
      }
      if (dense_at[i]) {
        blk.fch = arena.take_buffer(gemm_in, N * Fin);
      }
      if (split_backward_) {
        blk.dproj = arena.take_buffer(residual_gemm, dense_at[i] ? N * C : 0);
        blk.dfch = arena.take_buffer(gemm_in, dense_at[i] ? N * Fin : 0);
        blk.dattproj = arena.take_buffer(residual_gemm, N * C);
        blk.dqkv = arena.take_buffer(attention_type, N * W);
        blk.dln2 = take(Ns * C);
        blk.dln1 = take(Ns * C);
      }
      s.blocks.push_back(std::move(blk));
    }
    if (last) {
      s.lnf = ln_out(ln_type, Ns);
      s.lnf_mean = take(Ns);
      s.lnf_rstd = take(Ns);
      s.lnf_whole = ln_out(ln_type, tp_ != nullptr ? N : 0);
      s.logits = arena.take_buffer(gemm_in, N * Vl);
      s.losses = take(N);
      s.lse = take(N);
      s.dlnf = take(split_backward_ ? Ns * C : 0);
    }
    s.dembed = take(split_backward_ && first ? N * C : 0);
  }
  Scratch& x = *scratch_;
  x.xent_stats = take(last ? N * 3 : 0);
  x.xent_all = take(last && tp_ != nullptr ? count(z.tp) * N * 3 : 0);
  x.partial = whole(C);
  x.dwhole_out = whole(C);
  x.dwhole_in = whole(C);
  x.dresidual = take(Ns * C);
  x.dresidual_gemm = arena.take_buffer(gemm_in, rounds_residual ? Ns * C : 0);
  x.dln = take(Ns * C);
  x.datty = take(N * Cl);
  x.dqkv = arena.take_buffer(attention_type, N * W);
  x.dfch = arena.take_buffer(gemm_in, N * Fin);
  x.fch_gelu = arena.take_buffer(backend_.gemm_inputs(),
                                 std::find(dense_at.begin(), dense_at.end(), true) != dense_at.end() ? N * Fl : 0);
  if (any_moe) {
    x.dye = take(N * K * C);
    x.dge = take(R * Fl);
    x.dhe = take(R * Fin);
    x.dxe = take(R * C);
    x.token_rows = take(ep_ != nullptr ? N * K * C : 0);
    x.expert_rows = take(ep_ != nullptr ? R * C : 0);
    x.dgates = take(N * K);
    x.dprobs = take(N * E);
    x.drouter = take(N * E);
  }
  const bool any_dense = std::find(dense_at.begin(), dense_at.end(), true) != dense_at.end();
  x.dact = take(parts().mlp == ModelParts::Mlp::kSwiGlu && any_dense ? N * Fl : 0);
  const size_t ring = cp_ != nullptr ? N * 2 * KVl : 0, chunk = cp_ != nullptr ? B * context_.chunk_len() : 0;
  for (size_t i = 0; i < 2; ++i) {
    x.ring[i] = take(ring);
    x.ring_grads[i] = take(ring);
  }
  x.part_out = take(chunk * Cl);
  x.part_lse = take(chunk * NHl);
}

Gpt::~Gpt() = default;

const ModelParts& Gpt::parts() const { return storage_.table().parts(); }

RowNorm Gpt::row_norm() const {
  return {parts().norm == ModelParts::Norm::kRmsNorm ? RowNorm::Kind::kRmsNorm : RowNorm::Kind::kLayerNorm,
          static_cast<float>(parts().norm_eps)};
}

void Gpt::activation_forward(Buffer out, ConstBuffer pre, int rows) {
  const int Fl = sizes().Fl;
  if (parts().mlp == ModelParts::Mlp::kSwiGlu) {
    backend_.swiglu_forward(out, pre, rows, Fl);
  } else {
    backend_.gelu_forward(out, pre, static_cast<size_t>(rows) * Fl);
  }
}

void Gpt::activation_backward(float* dpre, ConstBuffer pre, const float* dact, int rows) {
  const int Fl = sizes().Fl;
  if (parts().mlp == ModelParts::Mlp::kSwiGlu) {
    backend_.swiglu_backward(dpre, pre, dact, rows, Fl);
  } else {
    backend_.gelu_backward(dpre, pre, dact, static_cast<size_t>(rows) * Fl);
  }
}

void Gpt::rotate_queries_and_keys(Buffer qkv, int B, bool backward) {
  if (parts().positions != ModelParts::Positions::kRotary) return;
  const Sizes z = sizes();
  const Scratch& x = *scratch_;
  // This rank's positions are its context chunks, each B rows of Tc
  // positions from the chunk's global start (ContextSplit), so a CP shard
  // turns its rows by their true positions.
  const int Tc = context_.chunk_len();
  const size_t chunk_bytes = static_cast<size_t>(B) * Tc * z.W * dtype_bytes(qkv.dtype);
  for (int c = 0; c < context_.chunks(); ++c) {
    const Buffer rows(static_cast<std::byte*>(qkv.data) + c * chunk_bytes, qkv.dtype);
    const int position = context_.start(c, context_.rank);
    const int heads = z.NHl + z.KVHl;  // the queries' and the keys', side by side
    if (backward) {
      backend_.rotary_backward(rows, z.W, x.rotary_cos.data(), x.rotary_sin.data(), B, Tc, position, heads, z.hd);
    } else {
      backend_.rotary_forward(rows, z.W, x.rotary_cos.data(), x.rotary_sin.data(), B, Tc, position, heads, z.hd);
    }
  }
}

Gpt::Sizes Gpt::sizes() const {
  const ModelParts& m = parts();
  const int C = static_cast<int>(config_.n_embd), Vl = static_cast<int>(config_.padded_vocab()) / tp_size_;
  const int hd = static_cast<int>(m.head_dim), NHl = static_cast<int>(m.heads) / tp_size_;
  const int KVHl = static_cast<int>(m.kv_heads) / tp_size_, Fl = static_cast<int>(m.mlp_width) / tp_size_;
  return {tp_size_,
          context_.local_len(),
          C,
          NHl * hd,
          NHl,
          KVHl,
          hd,
          KVHl * hd,
          (NHl + 2 * KVHl) * hd,
          Fl,
          m.mlp == ModelParts::Mlp::kSwiGlu ? 2 * Fl : Fl,
          static_cast<int>(config_.vocab_size),
          Vl,
          tp_rank_ * Vl,
          static_cast<int>(config_.n_expert),
          static_cast<int>(config_.top_k)};
}

int Gpt::slots() const { return static_cast<int>(slots_.size()); }

ConstBuffer Gpt::logits(int slot) const { return slots_[static_cast<size_t>(slot)].logits.buffer(); }

size_t Gpt::boundary_numel(int B) const {
  const Sizes z = sizes();
  return static_cast<size_t>(z.Ns(B)) * static_cast<size_t>(z.C);
}
float* Gpt::stage_input(int slot) { return slots_[static_cast<size_t>(slot)].input.data(); }
const float* Gpt::stage_output(int slot) const {
  const Slot& s = slots_[static_cast<size_t>(slot)];
  return s.blocks[static_cast<size_t>(stage().chunk_blocks(s.chunk)) - 1].residual3.data();
}
float* Gpt::output_gradient(int slot) { return slots_[static_cast<size_t>(slot)].output_grad.data(); }
const float* Gpt::input_gradient() const { return scratch_->dresidual.data(); }

void Gpt::gather_positions(ConstBuffer shard, Buffer whole, size_t shard_numel) {
  if (tp_ != nullptr) tp_->all_gather(shard, whole, shard_numel);
}

void Gpt::sum_into_positions(const float* partial, float* shard, size_t shard_numel) {
  if (tp_ != nullptr) tp_->reduce_scatter(partial, shard, shard_numel);
}

float* Gpt::partial_or(ArenaArray<float>& shard) { return tp_ != nullptr ? scratch_->partial.data() : shard.data(); }

bool Gpt::is_moe(int block) const { return config_.is_moe_layer(stage().layer(block)); }

void Gpt::forward(const int32_t* inputs, const int32_t* targets, int B, int slot, int chunk,
                  std::optional<float> backward_scale) {
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
  s.logits_gradient_scale.reset();
  const Sizes z = sizes();
  const int C = z.C, N = z.N(B), Ns = z.Ns(B), V = z.V, Vl = z.Vl, v_begin = z.v_begin;
  const size_t NsC = static_cast<size_t>(Ns) * C;
  const bool first_tp_rank = tp_rank_ == 0;
  Scratch& x = *scratch_;
  Backend& k = backend_;
  const OuterOffsets& outer = x.outer;
  const bool embeds = stage().embeds(chunk), scores = stage().scores(chunk);
  const UnitParameters p0 = embeds || scores ? storage_.acquire_parameters(0) : UnitParameters{};
  const int blocks = static_cast<int>(stage().chunk_blocks(chunk));
  const int first = static_cast<int>(stage().chunk_begin(chunk));
  storage_.prefetch_parameters(first + 1);
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
    // (learned positions) and the row-parallel biases are added by TP rank 0
    // alone, so that the sum over the group counts them once. Each chunk of
    // positions takes its own rows of wpe.
    const int Tc = context_.chunk_len();
    const size_t chunk_rows = static_cast<size_t>(B) * Tc;
    const bool adds_positions = first_tp_rank && outer.wpe != kNoTensor;
    for (int c = 0; c < context_.chunks(); ++c) {
      k.embedding_forward(
          partial_or(s.input) + c * chunk_rows * C, s.inputs.data() + c * chunk_rows, p0.at(outer.wte), v_begin, Vl,
          adds_positions ? p0.at(outer.wpe) + static_cast<size_t>(context_.start(c, context_.rank)) * C : nullptr, B,
          Tc, C);
    }
    sum_into_positions(x.partial.data(), s.input.data(), NsC);
  }

  aux_loss_ = 0.0f;
  const float* residual = s.input.data();
  for (int i = 0; i < blocks; ++i) residual = block_forward(s, first + i, residual);
  if (!scores) return;

  upload(targets, s.targets);
  k.norm_forward(s.lnf.buffer(), s.lnf_mean.data(), s.lnf_rstd.data(), residual, p0.at(outer.lnf_w),
                 p0.at(outer.lnf_b), Ns, C, row_norm());
  gather_positions(s.lnf.buffer(), s.lnf_whole.buffer(), NsC);
  // The LM head (the token embedding where tied): each rank scores its own
  // vocabulary rows, and the ranks exchange three floats per position.
  const ConstBuffer lnf_all = tp_ != nullptr ? s.lnf_whole.buffer() : s.lnf.buffer();
  k.matmul_forward(s.logits.buffer(), lnf_all, p0.weight(outer.head), nullptr, N, C, Vl);
  if (activation_hook_) {
    activation_hook_(static_cast<int>(config_.n_layer), s.logits.buffer(), static_cast<size_t>(N) * Vl);
  }
  if (tp_ == nullptr && backward_scale) {
    k.crossentropy_and_gradient(s.logits.buffer(), s.losses.data(), s.lse.data(), s.logits.buffer(), s.targets.data(),
                                *backward_scale / static_cast<float>(N), N, Vl, V);
    s.logits_gradient_scale = backward_scale;
  } else {
    k.crossentropy_stats(x.xent_stats.data(), s.logits.buffer(), s.targets.data(), N, v_begin, Vl, V);
    if (tp_ != nullptr) tp_->all_gather(x.xent_stats.data(), x.xent_all.data(), static_cast<size_t>(N) * 3);
    k.crossentropy_combine(s.losses.data(), s.lse.data(), tp_ != nullptr ? x.xent_all.data() : x.xent_stats.data(),
                           tp_size_, N);
  }
}

const float* Gpt::block_forward(Slot& s, int block, const float* residual) {
  const Sizes z = sizes();
  const int C = z.C, N = z.N(s.batch), Ns = z.Ns(s.batch), Cl = z.Cl, W = z.W, Fl = z.Fl, Fin = z.Fin;
  const size_t NsC = static_cast<size_t>(Ns) * C;
  const bool first_tp_rank = tp_rank_ == 0;
  Scratch& x = *scratch_;
  Backend& k = backend_;
  const int i = block - static_cast<int>(stage().chunk_begin(s.chunk));
  Slot::Block& blk = s.blocks[static_cast<size_t>(i)];
  const BlockOffsets& o = x.offsets[static_cast<size_t>(block)];
  const int unit = block + 1;
  const UnitParameters p = storage_.acquire_parameters(unit);
  if (i + 1 < stage().chunk_blocks(s.chunk)) storage_.prefetch_parameters(unit + 1);

  // Attention branch.
  k.norm_forward(blk.ln1.buffer(), blk.ln1_mean.data(), blk.ln1_rstd.data(), residual, p.at(o.ln1_w),
                 p.at(o.ln1_b), Ns, C, row_norm());
  gather_positions(blk.ln1.buffer(), blk.ln1_whole.buffer(), NsC);
  k.matmul_forward(blk.qkv.buffer(), blk.ln1_all(), p.weight(o.qkv_w), p.bias(o.qkv_b, blk.qkv.buffer()), N, C, W);
  rotate_queries_and_keys(blk.qkv.buffer(), s.batch, false);
  attend(blk.qkv.buffer(), blk.atty.buffer(), blk.attn_lse.data(), s.batch);
  k.matmul_forward(partial_or(blk.residual2), blk.atty.buffer(), p.weight(o.attproj_w),
                   first_tp_rank ? p.at(o.attproj_b) : nullptr, N, Cl, C);
  sum_into_positions(x.partial.data(), blk.residual2.data(), NsC);

  // MLP (or MoE) branch, its norm fused with the attention branch's
  // residual add. (The block's output add stays apart: the activation
  // hook must see it before the next block reads it.)
  k.add_norm_forward(blk.residual2.data(), residual, blk.ln2.buffer(), blk.ln2_mean.data(), blk.ln2_rstd.data(),
                     p.at(o.ln2_w), p.at(o.ln2_b), Ns, C, row_norm());
  gather_positions(blk.ln2.buffer(), blk.ln2_whole.buffer(), NsC);
  if (is_moe(block)) {
    // Every TP rank routes all N tokens alike and runs its slice of each
    // expert, like the dense MLP; the row-parallel partials sum into the shards.
    moe_forward(s, i, p, blk.ln2_all().f32(), partial_or(blk.residual3), N);
  } else {
    // The pre-activation (SwiGLU: gate and up) is kept for the
    // activation's backward; the activation reads it as kept (rounded, when
    // bf16), as the backward will.
    k.matmul_forward(blk.fch.buffer(), blk.ln2_all(), p.weight(o.fc_w), p.bias(o.fc_b, blk.fch.buffer()), N, C, Fin);
    activation_forward(x.fch_gelu.buffer(), blk.fch.buffer(), N);
    k.matmul_forward(partial_or(blk.residual3), x.fch_gelu.buffer(), p.weight(o.proj_w),
                     first_tp_rank ? p.at(o.proj_b) : nullptr, N, Fl, C);
  }
  sum_into_positions(x.partial.data(), blk.residual3.data(), NsC);
  k.accumulate(blk.residual3.data(), blk.residual2.data(), NsC);
  if (activation_hook_) activation_hook_(static_cast<int>(stage().layer(block)), blk.residual3.data(), NsC);
  return blk.residual3.data();
}

int Gpt::scored_positions(int slot) const {
  const Slot& s = slots_[static_cast<size_t>(slot)];
  if (s.batch == 0) throw common::Error(common::ErrorCode::kInternal, "the loss of a slot with no forward");
  return stage().scores(s.chunk) ? sizes().N(s.batch) : 0;
}

int Gpt::queue_loss(int slot) {
  const int N = scored_positions(slot);
  if (N > 0) backend_.queue_sum(slots_[static_cast<size_t>(slot)].losses.data(), static_cast<size_t>(N));
  return N;
}

float Gpt::loss(int slot) {
  const int N = scored_positions(slot);
  if (N == 0) return 0.0f;
  return static_cast<float>(backend_.sum(slots_[static_cast<size_t>(slot)].losses.data(), static_cast<size_t>(N)) / N);
}

void Gpt::backward(float loss_scale, int slot, bool weights) {
  Slot& s = slots_[static_cast<size_t>(slot)];
  const int B = s.batch;
  if (B == 0) throw common::Error(common::ErrorCode::kInternal, "Gpt::backward of a slot with no forward");
  if (!weights && !split_backward_) {
    throw common::Error(common::ErrorCode::kInternal, "Gpt::backward without weights on a model not split");
  }
  const Sizes z = sizes();
  const int C = z.C, N = z.N(B), Ns = z.Ns(B), V = z.V, Vl = z.Vl, v_begin = z.v_begin;
  const size_t NsC = static_cast<size_t>(Ns) * C;
  Scratch& x = *scratch_;
  Backend& k = backend_;
  const OuterOffsets& outer = x.outer;
  const bool embeds = stage().embeds(s.chunk), scores = stage().scores(s.chunk);
  const UnitParameters p0 = embeds || scores ? storage_.acquire_parameters(0) : UnitParameters{};
  s.weight_terms.clear();
  using Kind = WeightTerm::Kind;
  const int first = static_cast<int>(stage().chunk_begin(s.chunk));
  const int last = first + static_cast<int>(stage().chunk_blocks(s.chunk)) - 1;
  // The residual stream's gradient as the dense linears' GEMMs take it
  // (Scratch::dresidual_gemm): each norm backward that adds into
  // dresidual puts the sum there rounded when a dense linear reads it
  // next, the projection of a dense MLP or attention's.
  bf16* const rounded = x.dresidual_gemm.size() > 0 ? static_cast<bf16*>(x.dresidual_gemm.buffer().data) : nullptr;
  float* const dout_all = tp_ != nullptr ? x.dwhole_out.data() : x.dresidual.data();
  const BackwardPass pass{s,
                          weights,
                          loss_scale,
                          dout_all,
                          tp_ != nullptr ? x.dwhole_in.data() : x.dln.data(),
                          tp_ != nullptr ? static_cast<size_t>(N) * C : NsC,
                          rounded,
                          rounded != nullptr ? ConstBuffer(rounded) : ConstBuffer(dout_all)};

  if (scores) {
    // Softmax cross-entropy gradient, written over the logits in place
    // (the slot keeps them, so the weight pass reads them there), unless
    // the forward wrote it.
    if (!s.logits_gradient_scale) {
      k.crossentropy_backward(s.logits.buffer(), s.logits.buffer(), s.lse.data(), s.targets.data(),
                              loss_scale / static_cast<float>(N), N, v_begin, Vl, V);
    } else if (*s.logits_gradient_scale != loss_scale) {
      throw common::Error(common::ErrorCode::kInternal, "Gpt::backward's loss scale " + std::to_string(loss_scale) +
                                                            " is not the " + std::to_string(*s.logits_gradient_scale) +
                                                            " its forward wrote the logits' gradient with");
    }
    const ConstBuffer lnf_all = tp_ != nullptr ? s.lnf_whole.buffer() : s.lnf.buffer();
    backward_term(s, weights,
                  {Kind::kLinear, 0, outer.head, WeightTerm::kNone, s.logits.buffer(), lnf_all, nullptr, nullptr, N, C,
                   Vl, Into::kWrite},
                  pass.din_all, p0.weight(outer.head), nullptr);
    sum_into_positions(pass.din_all, x.dln.data(), NsC);
    x.dresidual.zero();
    backward_term(s, weights,
                  {Kind::kNorm, 0, outer.lnf_w, outer.lnf_b, x.dln.data(),
                   s.blocks[static_cast<size_t>(last - first)].residual3.data(), s.lnf_mean.data(), s.lnf_rstd.data(),
                   Ns, C, C, Into::kAdd, nullptr, rounded_for_mlp(pass, last)},
                  x.dresidual.data(), p0.at(outer.lnf_w), s.dlnf.data());
  } else {
    k.copy(x.dresidual.data(), s.output_grad.data(), NsC * sizeof(float));
    if (bf16* to = rounded_for_mlp(pass, last)) k.round_to_bf16(to, x.dresidual.data(), NsC);
  }

  // dresidual holds the gradient of this rank's shard of the residual
  // stream; each branch adds its input's gradient into it on the way down.
  for (int block = last; block >= first; --block) block_backward(pass, block);
  if (embeds) {
    gather_positions(x.dresidual.data(), pass.dout_all, NsC);
    backward_term(s, weights,
                  {Kind::kEmbedding, 0, WeightTerm::kNone, WeightTerm::kNone, pass.dout_all, nullptr, nullptr, nullptr,
                   N, 0, C},
                  nullptr, nullptr, s.dembed.data());
  }
  if (embeds || scores) backward_term(s, weights, {Kind::kUnitReady, 0}, nullptr, nullptr, nullptr);
  if (weights) s.batch = 0;
}

bf16* Gpt::rounded_for_mlp(const BackwardPass& pass, int block) const {
  return is_moe(block) ? nullptr : pass.rounded;
}

void Gpt::block_backward(const BackwardPass& pass, int block) {
  Slot& s = pass.slot;
  const Sizes z = sizes();
  const int C = z.C, N = z.N(s.batch), Ns = z.Ns(s.batch), Cl = z.Cl, W = z.W, Fl = z.Fl, Fin = z.Fin;
  const size_t NsC = static_cast<size_t>(Ns) * C;
  Scratch& x = *scratch_;
  using Kind = WeightTerm::Kind;
  const int first = static_cast<int>(stage().chunk_begin(s.chunk));
  const size_t i = static_cast<size_t>(block - first);
  Slot::Block& blk = s.blocks[i];
  const BlockOffsets& o = x.offsets[static_cast<size_t>(block)];
  const int unit = block + 1;
  const UnitParameters p = storage_.acquire_parameters(unit);
  if (block > first) storage_.prefetch_parameters(unit - 1);
  const float* residual = i == 0 ? s.input.data() : s.blocks[i - 1].residual3.data();
  auto term = [&](const WeightTerm& t, Buffer dinp, ConstBuffer weight, Buffer kept) {
    backward_term(s, pass.weights, t, dinp, weight, kept);
  };

  // MLP (or MoE) branch.
  gather_positions(x.dresidual.data(), pass.dout_all, NsC);
  if (is_moe(block)) {
    // The experts' and the router's input gradients sum into it.
    backend_.zero(pass.din_all, pass.din_numel * sizeof(float));
    moe_backward(s, static_cast<int>(i), p, pass.weights, pass.din_all, pass.dout_all, pass.loss_scale, N);
  } else {
    // The projection's input gradient through the activation's
    // derivative: dfch, in the GEMMs' input type, as fc's backward GEMMs
    // take it.
    term({Kind::kLinear, unit, o.proj_w, o.proj_b, pass.dout_gemm, nullptr, nullptr, nullptr, N, Fl, C, Into::kWrite,
          blk.fch.buffer()},
         x.dfch.buffer(), p.weight(o.proj_w), blk.dproj.buffer());
    term({Kind::kLinear, unit, o.fc_w, o.fc_b, x.dfch.buffer(), blk.ln2_all(), nullptr, nullptr, N, C, Fin,
          Into::kWrite},
         pass.din_all, p.weight(o.fc_w), blk.dfch.buffer());
  }
  sum_into_positions(pass.din_all, x.dln.data(), NsC);
  term({Kind::kNorm, unit, o.ln2_w, o.ln2_b, x.dln.data(), blk.residual2.data(), blk.ln2_mean.data(),
        blk.ln2_rstd.data(), Ns, C, C, Into::kAdd, nullptr, pass.rounded},
       x.dresidual.data(), p.at(o.ln2_w), blk.dln2.data());

  // Attention branch.
  gather_positions(x.dresidual.data(), pass.dout_all, NsC);
  term({Kind::kLinear, unit, o.attproj_w, o.attproj_b, pass.dout_gemm, blk.atty.buffer(), nullptr, nullptr, N, Cl, C,
        Into::kWrite},
       x.datty.data(), p.weight(o.attproj_w), blk.dattproj.buffer());
  attend_backward(blk.qkv.buffer(), blk.atty.buffer(), blk.attn_lse.data(), s.batch);
  rotate_queries_and_keys(x.dqkv.buffer(), s.batch, true);
  term({Kind::kLinear, unit, o.qkv_w, o.qkv_b, x.dqkv.buffer(), blk.ln1_all(), nullptr, nullptr, N, C, W,
        Into::kWrite},
       pass.din_all, p.weight(o.qkv_w), blk.dqkv.buffer());
  sum_into_positions(pass.din_all, x.dln.data(), NsC);
  term({Kind::kNorm, unit, o.ln1_w, o.ln1_b, x.dln.data(), residual, blk.ln1_mean.data(), blk.ln1_rstd.data(),
        Ns, C, C, Into::kAdd, nullptr, block > first ? rounded_for_mlp(pass, block - 1) : nullptr},
       x.dresidual.data(), p.at(o.ln1_w), blk.dln1.data());
  term({Kind::kUnitReady, unit}, nullptr, nullptr, nullptr);
}

void Gpt::backward_term(Slot& s, bool weights, const WeightTerm& t, Buffer dinp, ConstBuffer weight, Buffer kept) {
  run_term(s, t, dinp, weight, weights);
  if (weights) return;
  WeightTerm later = t;
  if (kept.data != nullptr) {
    if (kept.dtype != t.dout.dtype) {
      throw common::Error(common::ErrorCode::kInternal, fmt::format("a {} output gradient to keep in a {} array",
                                                                    dtype_name(t.dout.dtype), dtype_name(kept.dtype)));
    }
    backend_.copy(kept.data, t.dout.data,
                  static_cast<size_t>(t.rows) * static_cast<size_t>(t.out) * dtype_bytes(kept.dtype));
    later.dout = kept;
  }
  s.weight_terms.push_back(later);
}

void Gpt::run_term(const Slot& s, const WeightTerm& t, Buffer dinp, ConstBuffer weight, bool weight_grads) {
  using Kind = WeightTerm::Kind;
  if (t.kind == Kind::kUnitReady) {
    if (weight_grads) storage_.gradients_ready(t.unit);
    return;
  }
  // Only the activation's backward writes an input gradient in the GEMMs'
  // type (the MLP's dfch); every other input gradient is summed into, in
  // float32.
  if (dinp.dtype != DType::kF32 && t.activation_of.data == nullptr) {
    throw common::Error(common::ErrorCode::kInternal, "a bf16 input gradient for a term that sums into it");
  }
  // Only a linear's GEMM can write its input gradient over dinp; the
  // activation's backward always does.
  if (t.dinp_into == Into::kWrite ? t.kind != Kind::kLinear : t.activation_of.data != nullptr) {
    throw common::Error(common::ErrorCode::kInternal, "an input gradient to be put as its kernel cannot put it");
  }
  float* dinp32 = static_cast<float*>(dinp.data);
  float* g = weight_grads ? storage_.unit_gradients(t.unit) : nullptr;
  auto at = [g](size_t offset) { return g != nullptr && offset != WeightTerm::kNone ? g + offset : nullptr; };
  switch (t.kind) {
    case Kind::kLinear:
      if (t.activation_of.data == nullptr) {
        backend_.matmul_backward(dinp32, t.dinp_into, at(t.weight), at(t.bias), t.dout, t.inp, weight, t.rows, t.in,
                                 t.out);
      } else {
        linear_backward_through_activation(t, dinp, weight, g);
      }
      break;
    case Kind::kNorm:
      backend_.norm_backward(dinp32, dinp32 != nullptr ? t.dinp_bf16 : nullptr, at(t.weight), at(t.bias),
                             t.dout.f32(), t.inp.f32(), weight.f32(), t.mean, t.rstd, t.rows, t.out, row_norm());
      break;
    case Kind::kEmbedding:
      if (g != nullptr) embedding_backward(g, t.dout.f32(), s.inputs.data(), s.batch);
      break;
    case Kind::kUnitReady:
      break;
  }
}

void Gpt::linear_backward_through_activation(const WeightTerm& t, Buffer dinp, ConstBuffer weight, float* g) {
  auto at = [g](size_t offset) { return g != nullptr && offset != WeightTerm::kNone ? g + offset : nullptr; };
  ConstBuffer inp = nullptr;  // the activation of activation_of, remade only for the weight gradient
  if (g != nullptr) {
    activation_forward(scratch_->fch_gelu.buffer(), t.activation_of, t.rows);
    inp = scratch_->fch_gelu.buffer();
  }
  if (parts().mlp == ModelParts::Mlp::kGelu) {
    backend_.matmul_backward_through_gelu(dinp, at(t.weight), at(t.bias), t.dout, inp, weight, t.activation_of,
                                          t.rows, t.in, t.out);
    return;
  }
  float* dact = dinp.data != nullptr ? scratch_->dact.data() : nullptr;
  backend_.matmul_backward(dact, Into::kWrite, at(t.weight), at(t.bias), t.dout, inp, weight, t.rows, t.in, t.out);
  if (dact != nullptr) backend_.swiglu_backward(dinp, t.activation_of, dact, t.rows, t.in);
}

void Gpt::embedding_backward(float* g0, const float* dout_all, const int32_t* inputs, int B) {
  const OuterOffsets& outer = scratch_->outer;
  const Sizes z = sizes();
  const int C = z.C, Vl = z.Vl, Tc = context_.chunk_len();
  const size_t chunk_rows = static_cast<size_t>(B) * Tc;
  for (int c = 0; c < context_.chunks(); ++c) {
    backend_.embedding_backward(g0 + outer.wte,
                                outer.wpe == kNoTensor
                                    ? nullptr
                                    : g0 + outer.wpe + static_cast<size_t>(context_.start(c, context_.rank)) * C,
                                dout_all + c * chunk_rows * C, inputs + c * chunk_rows, tp_rank_ * Vl, Vl, B, Tc, C);
  }
}

void Gpt::weight_gradients(int slot) {
  Slot& s = slots_[static_cast<size_t>(slot)];
  if (s.batch == 0 || !split_backward_) {
    throw common::Error(common::ErrorCode::kInternal, "Gpt::weight_gradients of a slot with no split backward");
  }
  for (const WeightTerm& t : s.weight_terms) run_term(s, t, nullptr, nullptr, true);
  s.weight_terms.clear();
  s.batch = 0;
}

}  // namespace keel::trainer
