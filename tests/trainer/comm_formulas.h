// The closed-form payload bytes and calls one rank hands to each collective
// in one training step (a dense model, one microbatch, no validation), per
// group and operation, in the shape of the "comm" field of metrics.jsonl. Written from
// the algorithms of docs/architecture.md "Parallel layout and communication", not from the code that runs them: the
// layout parity test and keel-bench-parallel hold the measured counters
// against it.
#pragma once

#include "common/config.h"
#include "trainer/params/parameters.h"
#include "trainer/parallel/schedule.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace keel::test {

inline nlohmann::json step_comm_formula(const common::Config& config, int dp, int tp, int zero) {
  const int L = static_cast<int>(config.model.n_layer);
  const uint64_t C = static_cast<uint64_t>(config.model.n_embd);
  // Shapes of TP rank 0's slice; every TP rank's slice has the same.
  const trainer::ParameterTable table(config.model, 0, tp);
  auto unit_of = [](const std::string& name) { return name.rfind("h.", 0) == 0 ? 1 + std::stoi(name.substr(2)) : 0; };
  // One rank's packed shard of a unit: each tensor's dim 0 padded to
  // ceil(rows / dp) rows.
  auto packed_unit = [&](int unit) {
    uint64_t floats = 0;
    for (const auto& spec : table.specs()) {
      if (unit_of(spec.name) != unit) continue;
      const uint64_t rows = static_cast<uint64_t>(spec.shape[0]);
      floats += (rows + dp - 1) / dp * (spec.numel / rows);
    }
    return floats;
  };
  uint64_t packed_all = 0, flat = 0, buckets = 0;
  for (int u = 0; u <= L; ++u) packed_all += packed_unit(u);
  // The flat gradient buffer: every tensor padded to 16 floats, summed unit
  // by unit as backward finishes it, in one all-reduce per 16 MiB bucket of
  // the unit.
  for (int u = 0; u <= L; ++u) {
    uint64_t unit = 0;
    for (const auto& spec : table.specs()) {
      if (unit_of(spec.name) == u) unit += (spec.numel + 15) / 16 * 16;
    }
    flat += unit;
    buckets += (unit + (uint64_t{4} << 20) - 1) / (uint64_t{4} << 20);
  }
  auto op = [](uint64_t floats, uint64_t calls) { return nlohmann::json{{"bytes", 4 * floats}, {"calls", calls}}; };

  nlohmann::json comm = nlohmann::json::object();
  if (dp > 1) {
    nlohmann::json& g = comm["dp"];
    // all_reduce: the flat gradients (stages 0 and 1); loss, aux loss,
    // activation squares and, in sharded stages, the squared gradient norm
    // in one; the stop, save, known-answer test, snapshot and copy-step
    // votes.
    const uint64_t grads = zero <= 1 ? flat : 0, norm = zero >= 1 ? 1 : 0;
    g["all_reduce"] = op(grads + 3 + norm + 5, (zero <= 1 ? buckets : 0) + 1 + 1);
    // Stages 1 and 2 gather the updated shards back one unit at a time.
    if (zero == 1 || zero == 2) g["all_gather"] = op(packed_all, static_cast<uint64_t>(L) + 1);
    // Stage 3 gathers unit 0 once per step, every block for forward and,
    // for backward, every block but the top one, which is still there.
    if (zero == 3) {
      g["all_gather"] = op(packed_unit(0) + static_cast<uint64_t>(2 * L - 1) * packed_unit(1), 2 * L);
    }
    // Stages 2 and 3 reduce-scatter every unit's gradients; the payload is
    // the whole input, dp packed blocks.
    if (zero >= 2) g["reduce_scatter"] = op(static_cast<uint64_t>(dp) * packed_all, static_cast<uint64_t>(L) + 1);
  }
  if (tp > 1) {
    nlohmann::json& g = comm["tp"];
    const uint64_t N = static_cast<uint64_t>(config.model.seq_len * config.train.batch_size / dp);
    const uint64_t shard = N / tp * C;  // one rank's positions of the residual stream
    // Forward reduce-scatters the embedding and each block's two
    // row-parallel outputs into the position shards; backward reduce-
    // scatters the matching input gradients. Payload: all N positions.
    g["reduce_scatter"] = op(2 * (2 * L + 1) * N * C, 2 * (2 * L + 1));
    // Forward gathers each block's two norm outputs, the final norm's and
    // the cross-entropy's three floats per position; backward gathers the
    // output gradient of each block's two branches and of the embedding.
    g["all_gather"] = op((4 * L + 2) * shard + 3 * N, (2 * L + 2) + (2 * L + 1));
    // all_reduce: the norms' gradients (this rank's DP shard of each), the
    // squared gradient norm with the activation squares, the stop, save,
    // known-answer test, snapshot and copy-step votes.
    const uint64_t norms = (2 * L + 1) * 2 * (zero >= 1 && dp > 1 ? (C + dp - 1) / dp : C);
    g["all_reduce"] = op(norms + 2 + 5, 3);
  }
  return comm;
}

// The exchanges one rank of a PP x CP layout (dp = tp = 1, ZeRO-0, no
// validation) hands its groups in a training step of m microbatches, from
// docs/architecture.md "Pipeline parallelism" and "Context parallelism",
// in the shape of the "comm" field: for the pipeline's last stage (the
// rank that writes metrics.jsonl) under "pp", and its ring under "cp".
//   pp: 1F1B on the last stage posts [recv act 0], then [send grad i,
//       recv act i + 1] for each i < m - 1, then [send grad m - 1]: m + 1
//       exchanges sending m gradients of one rank's [B/m * T/cp, C]; plus
//       the tied embedding's gradient, [Vp, C], with the first stage.
//       Interleaved over v chunks, the last stage sends per microbatch the
//       input gradient of each of its v chunks and the output of all but
//       its last (back round to stage 0), in as many exchanges as its
//       schedule groups them.
//   cp: per block and microbatch, the forward ring's cp - 1 steps each send
//       one rank's k and v ([B/m * T/cp, 2C]); the backward's cp - 1 steps
//       send them too, from its second step with their gradient
//       accumulator (at the first it is zero, and starts where it
//       arrives), and a last step sends the accumulator home: 3cp - 3.
inline nlohmann::json pipeline_comm_formula(const common::Config& config, int pp, int cp, int m, int v = 1) {
  const uint64_t C = static_cast<uint64_t>(config.model.n_embd);
  const uint64_t positions = static_cast<uint64_t>(config.train.batch_size / m * config.model.seq_len / cp);
  const uint64_t last_stage_blocks = static_cast<uint64_t>(config.model.n_layer / pp);  // an even split
  auto op = [](uint64_t floats, uint64_t calls) { return nlohmann::json{{"bytes", 4 * floats}, {"calls", calls}}; };
  nlohmann::json comm = nlohmann::json::object();
  if (pp > 1) {
    const uint64_t tied = static_cast<uint64_t>(config.model.padded_vocab()) * C;
    uint64_t exchanges = 0;
    bool in_exchange = false;
    for (const auto& action : trainer::one_f_one_b(pp, pp - 1, m, v)) {
      exchanges += action.transfer() && !in_exchange ? 1 : 0;
      in_exchange = action.transfer();
    }
    const uint64_t sent = static_cast<uint64_t>(m) * static_cast<uint64_t>(2 * v - 1);
    comm["pp"] = op(sent * positions * C + tied, exchanges + 1);
  }
  if (cp > 1) {
    const uint64_t kv = positions * 2 * C, per_block = static_cast<uint64_t>(3 * cp - 3) * kv;
    comm["cp"] = op(last_stage_blocks * static_cast<uint64_t>(m) * per_block,
                    last_stage_blocks * static_cast<uint64_t>(m) * static_cast<uint64_t>(2 * cp - 1));
  }
  return comm;
}

// What one EP rank moves over its EP group in a step of m microbatches
// (docs/architecture.md "Expert parallelism"): per MoE block and
// microbatch, an all_gather of the E slot counts, then four all_to_all_v:
// the forward's dispatch of its N·k routed rows of C floats (N its
// positions) and combine of the R rows its experts ran, and the backward's
// same two. R depends on the routing, from 0 to every EP rank's N·k, so the
// bytes are a range.
struct ExpertComm {
  uint64_t all_to_all_calls = 0;
  uint64_t all_to_all_min_bytes = 0;
  uint64_t all_to_all_max_bytes = 0;
};
inline ExpertComm expert_comm_formula(const common::Config& config, int dp_cp, int ep, int m) {
  uint64_t moe_blocks = 0;
  for (int64_t i = 0; i < config.model.n_layer; ++i) moe_blocks += config.model.is_moe_layer(i) ? 1 : 0;
  const uint64_t routed =
      static_cast<uint64_t>(config.train.batch_size / dp_cp / m * config.model.seq_len * config.model.top_k) *
      static_cast<uint64_t>(config.model.n_embd);
  const uint64_t passes = moe_blocks * static_cast<uint64_t>(m);
  return ExpertComm{4 * passes, passes * 2 * 4 * routed,
                    passes * (2 * 4 * routed + 2 * 4 * routed * static_cast<uint64_t>(ep))};
}

}  // namespace keel::test
