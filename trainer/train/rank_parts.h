// What a rank's part of the run is, from the config and the rank's groups:
// its microbatch, its pipeline stage and schedule, its tensors and how its
// memory is laid out (docs/architecture.md "Memory"). TrainLoop builds and
// trains these; the memory plan (memory_plan.h) builds the same ones and
// lays them out without memory, so the plan is the trainer's arithmetic.
#pragma once

#include "common/config.h"
#include "trainer/kernels/arena.h"
#include "trainer/model/gpt.h"
#include "trainer/optim/adamw.h"
#include "trainer/parallel/process_groups.h"
#include "trainer/parallel/schedule.h"
#include "trainer/parallel/zero_storage.h"
#include "trainer/train/step.h"

#include <cstddef>
#include <vector>

namespace keel::trainer {

// Sequences of one microbatch on one DP rank.
int sequences_per_microbatch(const common::Config& config);
// The pipeline stage of this rank's pp position.
ModelStage stage_of(const common::Config& config, const ProcessGroups& groups);
// The actions of the stage in a training step (docs/architecture.md
// "Pipeline schedules").
std::vector<Action> schedule_of(const common::Config& config, const ModelStage& stage);
// The stage's tensors: its blocks, this TP rank's slice, this EP rank's experts.
ParameterTable table_of(const common::Config& config, const ModelStage& stage, const ProcessGroups& groups);
// How many microbatches the stage's schedule keeps alive, and so how many
// activation slots its model needs (validation's forwards need one).
int slots_for(const std::vector<Action>& schedule, int microbatches);
// The elements of each tensor the storage's owner updates (ZeRO's shard).
std::vector<size_t> owned_numels(const ZeroStorage& storage);
// Every array of the rank in one arena: the storage, the optimizer, the
// model's activations and the step's buffers, which it returns.
Step::Buffers lay_out_rank(Arena& arena, ZeroStorage& storage, AdamW& optimizer, Gpt& model,
                           const ProcessGroups& groups);

}  // namespace keel::trainer
