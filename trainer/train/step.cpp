#include "trainer/train/step.h"

#include "common/clock.h"
#include "common/error.h"
#include "trainer/data/batches.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>

namespace keel::trainer {
namespace {

using Clock = std::chrono::steady_clock;
using common::seconds_since;

size_t tp_partial_numel(const ZeroStorage& storage) {
  size_t numel = 0;
  for (size_t t = 0; t < storage.table().specs().size(); ++t) {
    if (storage.table().specs()[t].grad_partial_over_tp) numel += storage.owned_numel(t);
  }
  return numel;
}

}  // namespace

Step::Buffers Step::lay_out(Arena& arena, const ZeroStorage& storage, const ProcessGroups& groups) {
  const auto tied = storage.table().tied_embedding();
  Buffers buffers;
  buffers.tp_partial_grads = arena.take<float>(groups.get(Axis::kTp) != nullptr ? tp_partial_numel(storage) : 0);
  buffers.tied_grads = arena.take<float>(tied ? storage.owned_numel(*tied) : 0);
  return buffers;
}

Step::Step(Parts parts, Buffers buffers, int micro_batch)
    : p_(parts),
      table_(parts.storage.table()),
      stage_(table_.stage()),
      buffers_(std::move(buffers)),
      micro_batch_(micro_batch),
      faults_(parts.config, parts.faults, parts.storage, micro_batch) {
  p_.storage.on_local_gradients([this](int unit, float* grads, size_t numel) {
    faults_.on_gradients(p_.backend, unit, grads, numel);
    // Fingerprints belong to an attempt; a backward run outside one (a
    // caller driving the model directly) queues nothing.
    if (attempting_ && p_.sdc.fingerprinting()) queue_fingerprint(Queued::kGradients, grads, numel);
  });
  p_.model.on_activation([this](int site, Buffer data, size_t numel) {
    faults_.on_activation(p_.backend, site, data);
    // The last block's output and the logits of a training forward:
    // StepSignals says why these; validation's are not judged.
    if (judging_activations_ && site >= p_.config.model.n_layer - 1) {
      queue_fingerprint(Queued::kActivations, data, numel);
    }
  });
  const size_t tokens = static_cast<size_t>(micro_batch_) * p_.config.model.seq_len;
  inputs_.resize(tokens);
  targets_.resize(tokens);
}

StepStats Step::run(int64_t step) {
  const auto start = Clock::now();
  StepStats stats;
  stats.step = step;
  stats.lr = learning_rate(p_.config.train, step);
  Gradients g = compute_gradients(step);
  // The parameters are untouched until apply_update, so a suspicious
  // result is computed again from the same inputs before anything uses it.
  const SdcGuard::Assessment assessment = p_.sdc.assess(g.signals);
  stats.anomaly_score = assessment.score;
  if (assessment.rerun) {
    const Gradients first = g;
    g = compute_gradients(step);
    const auto outcome = p_.sdc.judge_rerun(step, assessment, first.signals, g.signals);
    stats.loss_spike = outcome != SdcGuard::RerunOutcome::kTransient;
    stats.skipped = outcome == SdcGuard::RerunOutcome::kSpikeSkipped;
  } else if (!std::isfinite(g.signals.loss) || !std::isfinite(g.signals.grad_norm)) {
    // Every rank holds the same loss and norm (both are summed over the
    // world), so every rank refuses the same step and none waits for another.
    p_.sdc.refuse(step, g.signals);
  }
  p_.sdc.accept(step, g.signals);
  stats.loss = g.signals.loss;
  stats.aux_loss = g.aux_loss;
  stats.grad_norm = static_cast<float>(g.signals.grad_norm);
  if (!stats.skipped) {
    apply_update(static_cast<float>(stats.lr), g.signals.grad_norm, step);
    faults_.after_update(p_.backend, p_.storage, p_.optimizer);
  }
  p_.sdc.after_step(step + 1);
  stats.step_ms = seconds_since(start) * 1e3;
  return stats;
}

Step::Gradients Step::compute_gradients(int64_t step) {
  const int T = static_cast<int>(p_.config.model.seq_len);
  const int64_t micro_batches = p_.config.parallel.micro_batches;
  // Each rank's gradient is its share of the global mean: summing over
  // dp x cp (a CP rank's loss is the mean over its share of the positions)
  // then gives the gradient of the whole batch.
  const double spike = p_.faults.loss_factor(step);
  const float loss_scale = static_cast<float>(spike) / static_cast<float>(micro_batches * p_.groups.size(Axis::kDpCp));
  const int64_t first_sample = static_cast<int64_t>(p_.groups.rank(Axis::kDp)) * micro_batches * micro_batch_;

  const auto start = Clock::now();
  const int64_t wait_before = collective_wait_ns();
  const int64_t cpu_wait_before = common::Clock::steady().thread_times().cpu_wait_ns;
  p_.sdc.begin_attempt();
  attempting_ = true;
  p_.storage.zero_gradients();
  double aux_sum = 0;
  const int64_t experts = p_.config.model.n_expert;
  std::vector<float> expert_tokens(static_cast<size_t>(moe_layers_before(p_.config.model.n_layer) * experts), 0.0f);
  StageWork work;
  work.batch = [this](int) { return micro_batch_; };
  work.forward = [&](int mb, int chunk, int slot) {
    if (stage_.reads_tokens(chunk)) {
      p_.board.set_phase(health::Phase::kData);
      fill_train_batch(p_.train, static_cast<uint64_t>(p_.config.job.seed), step, p_.config.train.batch_size, T,
                       first_sample + mb * micro_batch_, micro_batch_, inputs_.data(), targets_.data());
    }
    p_.board.set_phase(health::Phase::kForward);
    judging_activations_ = p_.sdc.fingerprinting();
    p_.model.forward(inputs_.data(), targets_.data(), micro_batch_, slot, chunk, loss_scale);
    judging_activations_ = false;
    queue_loss(slot);
    aux_sum += p_.model.aux_loss();
    // The chunk's MoE blocks, each microbatch's counts over dp x cp already.
    for (const auto& block : p_.model.expert_tokens(slot)) {
      size_t at = static_cast<size_t>(moe_layers_before(block.layer) * experts);
      for (double count : block.tokens) expert_tokens[at++] += static_cast<float>(count);
    }
  };
  // Gradients are handed over, unit by unit, by the whole backward or by
  // the weight pass split off it.
  const bool split = splits_backward(p_.schedule);
  auto hand_over = [&](int mb, int chunk) {
    // Each chunk's last backward is the last microbatch's (interleaved
    // schedules run the chunks in reverse, the last chunk first).
    const bool last = mb + 1 == micro_batches;
    p_.storage.begin_microbatch(last);
    // Poisoned as backward hands its first unit over: its sum over DP may start then.
    const bool first_of_last = last && chunk + 1 == static_cast<int>(stage_.chunks.size());
    faults_.poison_next_gradients(first_of_last && p_.faults.poisons(step, "gradient"));
  };
  work.backward = [&](int mb, int chunk, int slot) {
    if (!split) hand_over(mb, chunk);
    p_.board.set_phase(health::Phase::kBackward);
    p_.model.backward(loss_scale, slot, /*weights=*/!split);
  };
  work.weight = [&](int mb, int chunk, int slot) {
    hand_over(mb, chunk);
    p_.board.set_phase(health::Phase::kBackward);
    p_.model.weight_gradients(slot);
  };
  schedule_time_ += run_stage(p_.schedule, static_cast<int>(micro_batches), p_.model, p_.groups.get(Axis::kPp), work);
  if (Communicator* pp = p_.groups.get(Axis::kPp); pp != nullptr && !expert_tokens.empty()) {
    pp->all_reduce(expert_tokens.data(), expert_tokens.size());
  }
  expert_tokens_ = nlohmann::json::array();
  for (size_t layer = 0; experts > 0 && layer < expert_tokens.size() / static_cast<size_t>(experts); ++layer) {
    expert_tokens_.push_back(
        std::vector<float>(expert_tokens.begin() + layer * experts, expert_tokens.begin() + (layer + 1) * experts));
  }
  // A slow rank's forward and backward take longer; its peers then wait
  // for it in the gradient sums below. Stretched is the rank's own work, as
  // its board counts compute: neither collective wait nor waiting for a CPU.
  const int64_t not_working_ns =
      collective_wait_ns() - wait_before + common::Clock::steady().thread_times().cpu_wait_ns - cpu_wait_before;
  p_.faults.slow_compute(std::max(0.0, seconds_since(start) - static_cast<double>(not_working_ns) / 1e9));
  p_.storage.reduce_gradients();
  sum_norm_gradients_over_tp();
  sum_tied_gradients();
  if (step == 0 && !gradient_dump_dir_.empty()) write_gradients(step);
  p_.board.set_phase(health::Phase::kOptimizer);
  queue_norm_squares();
  const TakenSums taken = take_queued();
  attempting_ = false;
  double loss_sum = taken.loss * spike;
  if (p_.faults.poisons(step, "loss")) loss_sum = std::nan("");
  p_.sdc.add_local_loss(loss_sum);
  const StepSums sums = sum_step_scalars(loss_sum, aux_sum, taken.squares, taken.expert_squares);
  const double batches = static_cast<double>(micro_batches * p_.groups.size(Axis::kDpCp));
  return Gradients{{static_cast<float>(sums.loss / batches), std::sqrt(sums.grad_squares), sums.activation_squares},
                   static_cast<float>(sums.aux_loss / batches)};
}

void Step::queue_fingerprint(Queued kind, ConstBuffer data, size_t numel) {
  p_.backend.queue_sum_squares(data, numel);
  queued_.push_back({kind});
}

void Step::queue_loss(int slot) {
  if (const int positions = p_.model.queue_loss(slot); positions > 0) queued_.push_back({Queued::kLoss, positions});
}

void Step::queue_norm_squares() {
  // Every owned part once: a tensor replicated over TP counted on TP rank
  // 0 only, the tied embedding on the first stage only. On the GPU one
  // launch for all of them (Backend::queue_sums_of_squares).
  const auto& specs = table_.specs();
  std::vector<FloatSpan> tensors;
  for (size_t t = 0; t < specs.size(); ++t) {
    if ((p_.groups.rank(Axis::kTp) != 0 && specs[t].split == TpSplit::kReplicated) || specs[t].tied_copy) continue;
    tensors.push_back({p_.storage.owned_gradients(t), p_.storage.owned_numel(t)});
    queued_.push_back({specs[t].expert ? Queued::kExpertSquares : Queued::kSquares});
  }
  p_.backend.queue_sums_of_squares(tensors);
}

Step::TakenSums Step::take_queued() {
  const std::vector<double> sums = p_.backend.take_queued_sums();
  if (sums.size() != queued_.size()) {
    throw common::Error(
        common::ErrorCode::kInternal,
        fmt::format("{} sums were queued on the backend where the step queued {}", sums.size(), queued_.size()));
  }
  TakenSums taken;
  for (size_t i = 0; i < sums.size(); ++i) {
    switch (queued_[i].kind) {
      case Queued::kLoss:
        // A float a microbatch, as Gpt::loss gives it, summed in order.
        taken.loss += static_cast<float>(sums[i] / queued_[i].positions);
        break;
      case Queued::kGradients:
        p_.sdc.add_local_gradients(sums[i]);
        break;
      case Queued::kActivations:
        p_.sdc.add_local_activations(sums[i]);
        break;
      case Queued::kSquares:
        taken.squares += sums[i];
        break;
      case Queued::kExpertSquares:
        taken.expert_squares += sums[i];
        break;
    }
  }
  queued_.clear();
  return taken;
}

int64_t Step::collective_wait_ns() const {
  int64_t ns = 0;
  for (const auto& group : p_.groups.communicators()) ns += group.comm->stats().wait_ns;
  return ns;
}

int64_t Step::moe_layers_before(int64_t layer) const {
  int64_t count = 0;
  for (int64_t i = 0; i < layer; ++i) count += p_.config.model.is_moe_layer(i) ? 1 : 0;
  return count;
}

void Step::sum_norm_gradients_over_tp() {
  // Under sequence parallelism each TP rank holds the norms' gradient of
  // its own positions: sum them, every tensor in one all-reduce.
  Communicator* tp = p_.groups.get(Axis::kTp);
  ArenaArray<float>& packed_partials = buffers_.tp_partial_grads;
  if (tp == nullptr || packed_partials.size() == 0) return;
  auto for_each_partial = [&](auto&& visit) {
    size_t at = 0;
    for (size_t t = 0; t < table_.specs().size(); ++t) {
      if (!table_.specs()[t].grad_partial_over_tp) continue;
      const size_t bytes = p_.storage.owned_numel(t) * sizeof(float);
      visit(packed_partials.data() + at, p_.storage.owned_gradients(t), bytes);
      at += p_.storage.owned_numel(t);
    }
  };
  for_each_partial([&](float* packed, float* owned, size_t bytes) { p_.backend.copy(packed, owned, bytes); });
  tp->all_reduce(packed_partials.data(), packed_partials.size());
  for_each_partial([&](float* packed, float* owned, size_t bytes) { p_.backend.copy(owned, packed, bytes); });
}

void Step::sum_tied_gradients() {
  // Megatron's embedding group is the PP group's two ends; each adds the
  // other's gradient to its own, and a + b == b + a bit for bit, so both
  // copies take the same update.
  const auto tied = table_.tied_embedding();
  if (!tied) return;
  float* owned = p_.storage.owned_gradients(*tied);
  const size_t numel = p_.storage.owned_numel(*tied);
  const int peer = stage_.first() ? stage_.count - 1 : 0;
  p_.groups.get(Axis::kPp)->exchange({{owned, numel, peer}}, {{buffers_.tied_grads.data(), numel, peer}});
  p_.backend.accumulate(owned, buffers_.tied_grads.data(), numel);
}

Step::StepSums Step::sum_step_scalars(double loss_sum, double aux_sum, double squares, double expert_squares) {
  // Below ZeRO-1 every dp x cp rank holds the whole of the other tensors
  // but its EP rank's experts only: theirs sum over EP. (Sharded, every
  // shard of either kind lies on one dp x cp rank, summed there below.)
  if (Communicator* ep = p_.groups.get(Axis::kEp); ep != nullptr && p_.storage.stage() == 0) {
    float over_ep = static_cast<float>(expert_squares);
    ep->all_reduce(&over_ep, 1);
    expert_squares = over_ep;
  }
  squares += expert_squares;
  // The scalars share one small all-reduce per group instead of one each.
  // Over TP: the norm's squares and the activation squares, which each TP
  // rank holds for its own positions and vocabulary slice (the TP ranks of
  // a DP rank computed the same losses). Over DP: the losses, the
  // activation squares and, where ZeRO shards the gradients, the norm's
  // squares (below that every DP rank holds the whole sum already).
  StepSums sums{loss_sum, aux_sum, squares, p_.sdc.local_activation_squares()};
  if (Communicator* tp = p_.groups.get(Axis::kTp)) {
    float over_tp[2] = {static_cast<float>(sums.grad_squares), static_cast<float>(sums.activation_squares)};
    tp->all_reduce(over_tp, 2);
    sums.grad_squares = over_tp[0];
    sums.activation_squares = over_tp[1];
  }
  if (Communicator* dp = p_.groups.get(Axis::kDpCp)) {
    const bool sharded = p_.storage.stage() >= 1;
    float over_dp[4] = {static_cast<float>(sums.loss), static_cast<float>(sums.aux_loss),
                        static_cast<float>(sums.activation_squares), static_cast<float>(sums.grad_squares)};
    dp->all_reduce(over_dp, sharded ? 4 : 3);
    sums.loss = over_dp[0];
    sums.aux_loss = over_dp[1];
    sums.activation_squares = over_dp[2];
    if (sharded) sums.grad_squares = over_dp[3];
  }
  // Over PP: each stage has its own tensors and activations, and the last
  // the loss (the others add 0).
  if (Communicator* pp = p_.groups.get(Axis::kPp)) {
    float over_pp[4] = {static_cast<float>(sums.loss), static_cast<float>(sums.aux_loss),
                        static_cast<float>(sums.activation_squares), static_cast<float>(sums.grad_squares)};
    pp->all_reduce(over_pp, 4);
    sums = StepSums{over_pp[0], over_pp[1], over_pp[3], over_pp[2]};
  }
  return sums;
}

void Step::apply_update(float lr, double norm, int64_t step) {
  const float scale = p_.optimizer.clip_scale(norm);
  std::vector<AdamW::Part> parts;
  bool copies = true;  // whether the update writes every tensor's GEMM copy too
  for (size_t t = 0; t < table_.specs().size(); ++t) {
    parts.push_back({t, p_.storage.owned_parameters(t), p_.storage.owned_gradients(t), p_.storage.owned_gemm_copy(t)});
    copies = copies && parts.back().gemm_copy != nullptr;
  }
  p_.optimizer.update(parts, lr, scale, step);
  p_.storage.publish_parameters(copies);
}

void Step::write_gradients(int64_t step) {
  nlohmann::json pieces = nlohmann::json::array();
  for (size_t t = 0; t < table_.specs().size(); ++t) {
    const ParamSpec& spec = table_.specs()[t];
    const int64_t begin = p_.storage.owned_row_begin(t);
    std::vector<float> owned(p_.storage.owned_numel(t));
    p_.backend.copy_to_host(owned.data(), p_.storage.owned_gradients(t), owned.size() * sizeof(float));
    for (const GlobalBlock& block : spec.global_blocks(begin, begin + p_.storage.owned_rows(t))) {
      const auto first = owned.begin() + (block.local_row - begin) * block.cols;
      pieces.push_back({{"name", spec.name},
                        {"global_shape", spec.global_shape},
                        {"row", block.row},
                        {"col", block.col},
                        {"rows", block.rows},
                        {"cols", block.cols},
                        {"values", std::vector<float>(first, first + block.rows * block.cols)}});
    }
  }
  std::filesystem::create_directories(gradient_dump_dir_);
  const auto path = gradient_dump_dir_ / fmt::format("rank-{:05d}.json", gradient_dump_rank_);
  std::ofstream out(path);
  out << nlohmann::json{{"step", step}, {"pieces", pieces}}.dump() << "\n";
  if (!out) throw common::Error(common::ErrorCode::kInternal, "cannot write " + path.string());
}

void Step::dump_first_gradients(std::filesystem::path dir, int rank) {
  gradient_dump_dir_ = std::move(dir);
  gradient_dump_rank_ = rank;
}

}  // namespace keel::trainer
