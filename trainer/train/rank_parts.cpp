#include "trainer/train/rank_parts.h"

#include "common/layout_check.h"

#include <algorithm>

namespace keel::trainer {

int sequences_per_microbatch(const common::Config& c) {
  return static_cast<int>(c.train.batch_size / (c.parallel.dp * c.parallel.micro_batches));
}

ModelStage stage_of(const common::Config& config, const ProcessGroups& groups) {
  return ModelStage::of(common::stage_layers(config), groups.rank(Axis::kPp), groups.size(Axis::kPp));
}

std::vector<Action> schedule_of(const common::Config& config, const ModelStage& stage) {
  const int m = static_cast<int>(config.parallel.micro_batches);
  if (config.parallel.pp_schedule == "zb-h1") return zero_bubble_h1(stage.count, stage.index, m);
  return one_f_one_b(stage.count, stage.index, m, static_cast<int>(config.parallel.pp_virtual));
}

ParameterTable table_of(const common::Config& config, const ModelStage& stage, const ProcessGroups& groups) {
  return ParameterTable(config.model, groups.rank(Axis::kTp), groups.size(Axis::kTp), stage, groups.rank(Axis::kEp),
                        groups.size(Axis::kEp));
}

int slots_for(const std::vector<Action>& schedule, int microbatches) {
  return std::max(1, plan_slots(schedule, microbatches).slots);
}

std::vector<size_t> owned_numels(const ZeroStorage& storage) {
  std::vector<size_t> numels;
  for (size_t t = 0; t < storage.table().specs().size(); ++t) numels.push_back(storage.owned_numel(t));
  return numels;
}

Step::Buffers lay_out_rank(Arena& arena, ZeroStorage& storage, AdamW& optimizer, Gpt& model,
                           const ProcessGroups& groups) {
  storage.lay_out(arena);
  optimizer.lay_out(arena);
  model.lay_out(arena);
  return Step::lay_out(arena, storage, groups);
}

}  // namespace keel::trainer
