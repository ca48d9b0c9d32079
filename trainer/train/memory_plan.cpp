#include "trainer/train/memory_plan.h"

#include "common/error.h"
#include "common/human_format.h"
#include "common/layout_check.h"
#include "trainer/kernels/cpu_backend.h"
#include "trainer/parallel/mesh.h"
#include "trainer/train/rank_parts.h"

#include <fmt/format.h>

#include <map>
#include <memory>
#include <tuple>

namespace keel::trainer {
namespace {

// A rank's place in one group of the plan: its rank and size, and the
// dtypes the run's transport would carry (join_group, devices.h: Gloo for
// host memory carries float32; NCCL for a GPU's, float32 and bf16), which
// decide what the model keeps in bf16. It moves no data: a plan runs no
// collective, and one that tried would be a bug, so each says so.
class PlannedGroup final : public Communicator {
 public:
  PlannedGroup(const Group& group, bool carries_bf16)
      : Communicator(group.name, group.index_in_group, static_cast<int>(group.ranks.size()), nullptr),
        carries_bf16_(carries_bf16) {}
  bool carries(DType dtype) const override { return dtype == DType::kF32 || (carries_bf16_ && dtype == DType::kBF16); }
  void abort() override {}

 protected:
  void do_all_reduce(Buffer, size_t) override { refuse(); }
  void do_reduce_scatter(ConstBuffer, Buffer, size_t) override { refuse(); }
  void do_all_gather(ConstBuffer, Buffer, size_t) override { refuse(); }
  void do_broadcast(Buffer, size_t, int) override { refuse(); }
  void do_exchange(const std::vector<Send>&, const std::vector<Recv>&) override { refuse(); }
  void do_all_to_all(ConstBuffer, const std::vector<size_t>&, Buffer, const std::vector<size_t>&) override {
    refuse();
  }
  void do_barrier() override { refuse(); }

 private:
  [[noreturn]] void refuse() const {
    throw common::Error(common::ErrorCode::kInternal, "a memory plan's group " + name() + " was asked to move data");
  }
  bool carries_bf16_;
};

RankPlan plan_rank(const common::Config& config, int rank, Backend& backend) {
  const Mesh mesh(Layout::from(config.parallel), rank);
  const bool on_gpu = config.train.device == "cuda";
  const ProcessGroups groups(mesh, [&](const Group& group) { return std::make_unique<PlannedGroup>(group, on_gpu); });
  const ModelStage stage = stage_of(config, groups);
  const std::vector<Action> schedule = schedule_of(config, stage);
  const ParameterTable table = table_of(config, stage, groups);
  ZeroStorage storage(backend, table, static_cast<int>(config.parallel.zero), ReduceGroups::of(groups),
                      config.parallel.overlap_comm);
  AdamW optimizer(backend, table, config.train, owned_numels(storage));
  Gpt model(config.model, backend, sequences_per_microbatch(config), storage, groups,
            slots_for(schedule, static_cast<int>(config.parallel.micro_batches)), splits_backward(schedule));
  Step::Buffers buffers;
  const size_t total = Arena::plan(
      backend, [&](Arena& arena) { buffers = lay_out_rank(arena, storage, optimizer, model, groups); });
  RankPlan plan;
  plan.rank = rank;
  plan.stage = groups.rank(Axis::kPp);
  plan.memory = MemoryUse{storage.parameter_bytes(), storage.gemm_copy_bytes(), storage.gradient_bytes(),
                          optimizer.state_bytes(), storage.working_bytes() + buffers.bytes(), total, 0};
  return plan;
}

}  // namespace

RunPlan plan_run(const common::Config& config) {
  const int world = static_cast<int>(Layout::from(config.parallel).world_size());
  common::validate_layout(config, world);
  // The arithmetic of the run's own dtypes: bf16 GEMM inputs keep some
  // activations and the GEMMs' weight copy in bf16.
  CpuBackend backend(1, config.train.gemm_precision() == "bf16" ? DType::kBF16 : DType::kF32);
  RunPlan plan;
  const ParameterTable whole(config.model);
  plan.parameters = static_cast<int64_t>(whole.parameter_count());
  const common::ModelConfig& m = config.model;
  const double attention = static_cast<double>(m.n_layer) * static_cast<double>(m.n_head * m.head_dim()) *
                           static_cast<double>(m.seq_len);
  plan.flops_per_token = 6.0 * static_cast<double>(plan.parameters) + 12.0 * attention;
  plan.flops_per_token_causal = 6.0 * static_cast<double>(plan.parameters) + 6.0 * attention;
  plan.tokens_per_step = config.train.batch_size * m.seq_len;
  for (int rank = 0; rank < world; ++rank) plan.ranks.push_back(plan_rank(config, rank, backend));
  return plan;
}

nlohmann::json to_json(const RunPlan& plan) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const RankPlan& r : plan.ranks) {
    ranks.push_back({{"rank", r.rank},
                     {"stage", r.stage},
                     {"params_bytes", r.memory.params},
                     {"gemm_copy_bytes", r.memory.gemm_copy},
                     {"grads_bytes", r.memory.grads},
                     {"optimizer_bytes", r.memory.optimizer},
                     {"working_bytes", r.memory.working},
                     {"activations_bytes", r.activations()},
                     {"total_bytes", r.memory.total}});
  }
  return {{"parameters", plan.parameters},
          {"flops_per_token", plan.flops_per_token},
          {"flops_per_token_causal", plan.flops_per_token_causal},
          {"tokens_per_step", plan.tokens_per_step},
          {"ranks", ranks}};
}

std::string to_text(const RunPlan& plan, const common::Config& config) {
  using common::format_bytes;
  const auto& p = config.parallel;
  std::string text = fmt::format(
      "{}: {} parameters ({} {} layers, width {}, {} heads, {} key/value heads, vocabulary {})\n"
      "  {:.3g} FLOPs a token to train ({:.3g} counting attention as causal, llm.c's count), {} tokens a step\n"
      "  layout dp {} tp {} pp {} cp {} ep {}, ZeRO-{}, {} microbatches, {} on {}\n",
      config.job.name, plan.parameters, config.model.arch, config.model.n_layer, config.model.n_embd,
      config.model.n_head, config.model.kv_heads(), config.model.vocab_size, plan.flops_per_token,
      plan.flops_per_token_causal, plan.tokens_per_step, p.dp, p.tp, p.pp, p.cp, p.ep, p.zero, p.micro_batches,
      config.train.gemm_precision(), config.train.device);
  // Ranks of one footprint (the DP and TP replicas of a stage) share a line.
  std::map<std::tuple<int, size_t, size_t, size_t, size_t, size_t>, std::vector<int>> lines;
  for (const RankPlan& r : plan.ranks) {
    lines[{r.stage, r.memory.params + r.memory.gemm_copy, r.memory.grads, r.memory.optimizer, r.activations(),
           r.memory.total}]
        .push_back(r.rank);
  }
  for (const auto& [key, ranks] : lines) {
    const auto& [stage, weights, grads, optimizer, activations, total] = key;
    text += fmt::format(
        "  stage {} ({} rank{}): weights {}, gradients {}, optimizer {}, activations {}, total {} a rank\n", stage,
        ranks.size(), ranks.size() == 1 ? "" : "s", format_bytes(weights), format_bytes(grads),
        format_bytes(optimizer), format_bytes(activations), format_bytes(total));
  }
  text += "  (the backend's own working buffers, such as a GEMM library's workspace, come on top at run time)\n";
  return text;
}

}  // namespace keel::trainer
