// One rank's model state under ZeRO stage 0-3 over its data-parallel ranks
// (docs/architecture.md "Parallel layout and communication"), behind the ModelStorage interface the model runs on.
// Each tensor belongs to a reduce group (ReduceGroups): the dp x cp ranks,
// or for an expert under expert parallelism the expert-DP ranks that hold
// the same expert. Everything below happens per group: a unit's tensors
// form one run per group (two in a MoE block under EP, one otherwise),
// and each run is summed, sharded and gathered over its own group.
//
//   stage 0  parameters and gradients whole; in the step's last microbatch
//            each unit's gradients are all-reduced (in 16 MiB buckets) as
//            soon as backward hands the unit over.
//   stage 1  as 0, but each rank updates only its dim-0 shard of every
//            tensor (the optimizer holds state for that shard only) and the
//            updated shards are all-gathered, one unit at a time.
//   stage 2  as 1, but gradients are reduce-scattered one unit at a time as
//            soon as backward has finished the unit: a rank keeps only its
//            shard of the summed gradient, plus two units' worth of
//            gradient in flight.
//   stage 3  as 2, and parameters too: a rank keeps its shard and gathers a
//            unit's parameters before forward or backward uses them, into
//            one buffer for unit 0 and one shared by the blocks; the next
//            block's gather runs while the model computes this one
//            (prefetch_parameters).
//
// Overlap (docs/architecture.md "Streams"): with `overlap` the gradient
// sums and the prefetched gathers run on their group's communicator thread while
// backward and forward go on; without it each is waited for where it is
// issued. Both issue the same collectives in the same order, so they give
// the same bits.
//
// Where the GEMMs multiply bf16 (Backend::gemm_inputs()), the storage keeps
// a bf16 copy of the parameters beside the float32 masters: of the whole
// flat buffer below stage 3, of the gathered unit 0 and block at stage 3. A
// unit's copy is rounded when the unit is acquired after its parameters
// may have changed: any call that hands out writable parameters (params(),
// owned_parameters()), init() and publish_parameters() make every copy
// stale. So the weights are rounded once a step (at stage 3 once a gather),
// not at each of the GEMMs that read them, and no writer can leave the
// GEMMs an old copy (docs/architecture.md "GPU step"), provided it writes
// before the next acquire_parameters: a pointer kept across steps and
// written later would escape the mark. Readers (saves, digests) take the
// *_for_io accessors, which leave the copy as it is. At stage 0 the
// optimizer writes the copy itself as it updates (owned_gemm_copy), and
// says so to publish_parameters, so nothing is rounded apart.
//
// Shards are ShardLayout's (dim 0, FSDP2 style); every packed shard buffer
// lays the tensors out in table order, so a unit's shard is a contiguous
// run of it. Without a dp x cp group of two ranks or more every stage is stage 0;
// a run whose group is the rank alone (expert-DP of one rank) keeps its
// tensors whole and talks to no one.
#pragma once

#include "trainer/comm/communicator.h"
#include "trainer/kernels/backend.h"
#include "trainer/kernels/arena.h"
#include "trainer/params/model_storage.h"
#include "trainer/parallel/process_groups.h"
#include "trainer/parallel/shard_layout.h"

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

namespace keel::trainer {

// The groups gradients are summed in (docs/architecture.md "Expert
// parallelism"): an expert's over expert_dp, every other tensor's over
// dp x cp. nullptr: the rank alone. Without EP the two are one group.
struct ReduceGroups {
  Communicator* dense = nullptr;
  Communicator* experts = nullptr;

  static ReduceGroups of(const ProcessGroups& groups) { return {groups.get(Axis::kDpCp), groups.get(Axis::kExpertDp)}; }
  Communicator* of(const ParamSpec& spec) const { return spec.expert ? experts : dense; }
  // The rank's position in, and the size of, tensor `spec`'s group.
  int rank(const ParamSpec& spec) const { return of(spec) != nullptr ? of(spec)->rank() : 0; }
  int size(const ParamSpec& spec) const { return of(spec) != nullptr ? of(spec)->size() : 1; }
};

class ZeroStorage final : public ModelStorage {
 public:
  // Plans the buffers; lay_out() places them (in the run's one Arena), and
  // nothing below but the shard arithmetic may run before it has.
  ZeroStorage(Backend& backend, const ParameterTable& table, int stage = 0, ReduceGroups groups = {},
              bool overlap = true);
  // Aborts the reduce groups when a collective is still in flight (the rank
  // is failing mid-step): it would write into buffers freed here.
  ~ZeroStorage() override;
  ZeroStorage(const ZeroStorage&) = delete;
  ZeroStorage& operator=(const ZeroStorage&) = delete;

  const ParameterTable& table() const override { return table_; }
  int stage() const { return stage_; }
  void lay_out(Arena& arena);

  // This rank's part of the initial model (see init_parameters). At
  // stage 3 it draws the whole TP-local model once, then keeps its shard.
  void init(uint64_t seed);

  // The whole flat buffers; only while the stage keeps them whole
  // (parameters below stage 3, gradients below stage 2). Throw otherwise.
  // params() makes the GEMM copy stale, as owned_parameters() does.
  float* params();
  // The same memory as params() and owned_parameters(t), leaving the GEMM
  // copy as it is: for readers (checkpoint and snapshot saves, the replica
  // digest) and for a loader that calls publish_parameters() once it has
  // written, which makes the copy stale then.
  float* params_for_io();
  float* owned_parameters_for_io(size_t t);
  float* grads();

  // Starts a step's gradient accumulation from zero.
  void zero_gradients();
  // Before each backward: whether it is the step's last for its units,
  // which stages 0 and 1 then sum over their reduce groups as they come.
  void begin_microbatch(bool last);
  // After the last microbatch's backward: completes the sums over the
  // reduce groups, so that owned_gradients() holds the gradient of the
  // whole batch (as far as they go: sums over other groups are the caller's).
  void reduce_gradients();

  const ReduceGroups& groups() const { return groups_; }
  // The part of tensor t this rank updates: all of it at stage 0, its dim-0
  // shard over its reduce group otherwise, as local rows [begin, begin +
  // count) of the tensor.
  int64_t owned_row_begin(size_t t) const;
  int64_t owned_rows(size_t t) const;
  size_t owned_numel(size_t t) const;
  float* owned_parameters(size_t t);
  float* owned_gradients(size_t t);

  // Where the optimizer may write owned_parameters(t) rounded to bf16 as it
  // updates them: the GEMM copy, where this rank owns tensor t whole and
  // the copy is of the flat buffer (stage 0); null otherwise.
  bf16* owned_gemm_copy(size_t t);
  // After the optimizer has updated the owned parameters: stages 1 and 2
  // all-gather them so every rank holds the whole model again; stage 3
  // marks its gathered copies stale. `gemm_copy_written`: the update wrote
  // every tensor's owned_gemm_copy too, so the copies are current.
  void publish_parameters(bool gemm_copy_written = false);

  // Bytes held for the whole run (the quantities of the ZeRO formulas)
  // and the working buffers that carry units to and from the collectives.
  size_t parameter_bytes() const { return params_.bytes(); }
  // The GEMMs' bf16 copy of the parameters (0 where they take float32).
  size_t gemm_copy_bytes() const { return gemm_params_.bytes() + unit0_gemm_.bytes() + block_gemm_.bytes(); }
  size_t gradient_bytes() const { return grads_.bytes(); }
  size_t working_bytes() const;

  // `hook` (nullptr: none) sees each unit's local gradient, this rank's
  // own contribution before anything is summed over DP or TP, when
  // backward hands the unit over (once per microbatch; with gradient
  // accumulation below stage 2 it holds the microbatches so far). It may
  // change it: the SDC fingerprints read it there and fault injection
  // flips a bit of it (docs/architecture.md "Health").
  using GradientHook = std::function<void(int unit, float* grads, size_t numel)>;
  void on_local_gradients(GradientHook hook) { gradient_hook_ = std::move(hook); }

  UnitParameters acquire_parameters(int unit) override;
  void prefetch_parameters(int unit) override;
  float* unit_gradients(int unit) override;
  void gradients_ready(int unit) override;

 private:
  // A unit's tensors [first, last) of one reduce group `comm`, which this
  // rank is rank `rank` of. Its packed shard starts packed_at floats into
  // the unit's, and every rank's packed shards exchange_at floats into the
  // exchange buffers.
  struct Run {
    size_t first = 0, last = 0;
    Communicator* comm = nullptr;
    int rank = 0;
    size_t packed_at = 0, exchange_at = 0;
    int size() const { return comm != nullptr ? comm->size() : 1; }
  };
  // The reduce-scatters of one unit's gradients in flight, from exchange
  // slot `slot` into packed_unit_[slot].
  struct PendingScatter {
    std::vector<CommWork> works;
    int unit = -1;
  };

  size_t unit_packed_numel(int unit) const;
  size_t packed_numel(const Run& run) const { return shards_->packed_numel(run.first, run.last); }
  // The run's floats in the flat buffer.
  size_t run_begin(int unit, const Run& run) const;
  size_t run_end(int unit, const Run& run) const;
  int rank_of(size_t t) const { return groups_.rank(table_.specs()[t]); }
  // Stages 0 and 1: sums the unit's gradients over each run's group, bucket by bucket.
  void sum_unit_gradients(int unit);
  // Stages 2 and 3: waits for the reduce-scatter in `slot`, if any, and
  // adds this rank's shard of it to the gradients.
  void finish_scatter(size_t slot);
  // Starts the all-gather of the parameters of `unit` into gather_exchange_,
  // once the gather before it is done.
  void start_gather(int unit);
  // Waits for the gather in flight and unpacks it into `dst` (its unit's
  // layout), or gathers `unit` now when none is in flight for it; then
  // rounds it into `gemm`, the GEMM copy, when there is one.
  void finish_gather(int unit, float* dst, bf16* gemm);
  // Every unit's GEMM copy is to be rounded again before it is handed out.
  void gemm_copy_stale() { gemm_fresh_.assign(gemm_fresh_.size(), false); }

  Backend& backend_;
  const ParameterTable& table_;
  ReduceGroups groups_;
  int stage_;
  bool overlap_;
  std::vector<std::vector<Run>> runs_;  // per unit
  std::optional<ShardLayout> shards_;
  std::vector<size_t> packed_offset_;  // tensor t's shard in the packed buffers
  size_t max_unit_ = 0;                // the largest unit's packed shard (stages 1-3)
  size_t max_exchange_ = 0;            // the largest unit's packed shards of every rank
  size_t max_block_ = 0;               // the largest block's numel
  ArenaArray<float> params_;           // flat (stages 0-2) or packed shard (3)
  ArenaArray<float> grads_;            // flat (stages 0-1) or packed shard (2, 3)
  // Working buffers: two slots of every rank's packed shard of one unit
  // (reduce-scatter input) and of this rank's packed shard (its output or
  // an all-gather's input), so one unit's sum runs while backward fills the
  // next; what the parameter gathers receive; the gathered parameters and
  // pending gradients of unit 0 and of one block.
  ArenaArray<float> exchange_[2], packed_unit_[2], gather_exchange_;
  ArenaArray<float> unit0_params_, block_params_, unit0_grads_, block_grads_;
  // The GEMM copies: of params_ (stages 0-2), of the gathered unit 0 and
  // block (stage 3); empty where the GEMMs take float32.
  ArenaArray<bf16> gemm_params_, unit0_gemm_, block_gemm_;
  bool unit0_params_valid_ = false;
  int block_params_unit_ = -1;  // the unit block_params_ holds, -1: none
  std::vector<bool> grads_open_;
  std::vector<bool> gemm_fresh_;  // per unit, stages 0-2: its copy holds its parameters rounded
  GradientHook gradient_hook_;
  bool last_microbatch_ = true;
  std::vector<CommWork> pending_sums_;  // stages 0 and 1
  PendingScatter scatters_[2];          // stages 2 and 3
  size_t next_slot_ = 0;
  std::vector<CommWork> gather_;  // stage 3: the gathers in flight, one per run
  int gather_unit_ = -1;   // the unit it gathers, -1: none
};

}  // namespace keel::trainer
