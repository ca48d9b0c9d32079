// keel-trainer --plan: what a run needs before anything is allocated
// (docs/architecture.md "Memory"). For every rank of the layout it builds
// the rank's parts as TrainLoop does (rank_parts.h) over groups that carry
// no data and lays them out in a planning arena, so each figure is the
// trainer's own arithmetic: a test holds the plan to the memory a run
// reports.
#pragma once

#include "common/config.h"
#include "trainer/train/train_loop.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace keel::trainer {

struct RankPlan {
  int rank = 0;
  int stage = 0;  // its pipeline stage
  // As a run reports it (MemoryUse); backend_scratch is what the backend's
  // kernels grow at run time beside it (GEMM copies, reductions), unknown
  // here, so 0.
  MemoryUse memory;
  // The activations, every slot of the schedule: the rest of the arena.
  size_t activations() const {
    return memory.total - memory.params - memory.gemm_copy - memory.grads - memory.optimizer - memory.working;
  }
};

struct RunPlan {
  int64_t parameters = 0;  // of the whole model, once each (a tied head counted once)
  // Training FLOPs per token: 6 N for the linears (forward and backward)
  // plus attention's score and value products, 12 L C T over the full
  // square, and llm.c's count of them, 6 L C T, which halves it for the
  // causal mask (C: the query channels, n_head x head_dim).
  double flops_per_token = 0;
  double flops_per_token_causal = 0;
  int64_t tokens_per_step = 0;
  std::vector<RankPlan> ranks;  // every rank of the layout, by rank
};

// Throws Error(kBadConfig) for a layout the trainer would refuse.
RunPlan plan_run(const common::Config& config);

nlohmann::json to_json(const RunPlan& plan);
// The plan for a person: totals, then one line per distinct rank footprint.
std::string to_text(const RunPlan& plan, const common::Config& config);

}  // namespace keel::trainer
