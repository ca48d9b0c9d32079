#include "trainer/parallel/zero_storage.h"

#include "common/error.h"

#include <algorithm>
#include <exception>

namespace keel::trainer {
namespace {

// Stage 0 and 1 sum gradients in buckets of this many floats (16 MiB): each
// bucket is one all-reduce, which bounds the transport's buffers for any
// model size.
constexpr size_t kAllReduceBucketFloats = size_t{4} << 20;

// Without a dp x cp group of two ranks or more nothing is sharded (and
// there is no expert-DP group either: it lies within dp x cp).
int effective_stage(int stage, const ReduceGroups& groups) { return groups.dense != nullptr ? stage : 0; }

}  // namespace

ZeroStorage::ZeroStorage(Backend& backend, const ParameterTable& table, int stage, ReduceGroups groups, bool overlap)
    : backend_(backend),
      table_(table),
      groups_(groups),
      stage_(effective_stage(stage, groups)),
      overlap_(overlap),
      grads_open_(static_cast<size_t>(table.unit_count()), false),
      gemm_fresh_(static_cast<size_t>(table.unit_count()), false) {
  if (stage < 0 || stage > 3) {
    throw common::Error(common::ErrorCode::kInternal, "ZeRO stage " + std::to_string(stage) + " outside 0-3");
  }
  const auto& specs = table.specs();
  for (int u = 0; u < table.unit_count(); ++u) {
    std::vector<Run> runs;
    for (size_t t = table.unit_first_tensor(u); t < table.unit_end_tensor(u); ++t) {
      Communicator* comm = groups_.of(specs[t]);
      if (runs.empty() || runs.back().comm != comm) runs.push_back(Run{t, t, comm, groups_.rank(specs[t])});
      runs.back().last = t + 1;
    }
    runs_.push_back(std::move(runs));
  }
  if (stage_ >= 1) {
    shards_.emplace(table, [this](const ParamSpec& spec) { return groups_.size(spec); });
    size_t offset = 0;
    for (size_t t = 0; t < specs.size(); ++t) {
      packed_offset_.push_back(offset);
      offset += shards_->packed_numel(t, t + 1);
    }
    for (int u = 0; u < table.unit_count(); ++u) {
      size_t packed = 0, exchange = 0;
      for (Run& run : runs_[static_cast<size_t>(u)]) {
        run.packed_at = packed;
        run.exchange_at = exchange;
        packed += packed_numel(run);
        exchange += packed_numel(run) * static_cast<size_t>(run.size());
      }
      max_unit_ = std::max(max_unit_, packed);
      max_exchange_ = std::max(max_exchange_, exchange);
      if (u > 0) max_block_ = std::max(max_block_, table.unit_end(u) - table.unit_begin(u));
    }
  }
}

void ZeroStorage::lay_out(Arena& arena) {
  const bool gemm_copy = backend_.gemm_inputs() == DType::kBF16;
  if (stage_ == 0) {
    params_ = arena.take<float>(table_.total());
    grads_ = arena.take<float>(table_.total());
    if (gemm_copy) gemm_params_ = arena.take<bf16>(table_.total());
    return;
  }
  const size_t shard = shards_->packed_numel(0, table_.specs().size());
  params_ = arena.take<float>(stage_ == 3 ? shard : table_.total());
  grads_ = arena.take<float>(stage_ >= 2 ? shard : table_.total());
  if (gemm_copy && stage_ < 3) gemm_params_ = arena.take<bf16>(table_.total());
  // Stage 1 uses one slot, for its gathers; stages 2 and 3 alternate two
  // for the gradients' reduce-scatters.
  for (size_t slot = 0; slot < (stage_ >= 2 ? 2u : 1u); ++slot) {
    exchange_[slot] = arena.take<float>(max_exchange_);
    packed_unit_[slot] = arena.take<float>(max_unit_);
  }
  const size_t unit0 = table_.unit_end(0) - table_.unit_begin(0);
  if (stage_ >= 2) {
    unit0_grads_ = arena.take<float>(unit0);
    block_grads_ = arena.take<float>(max_block_);
  }
  if (stage_ == 3) {
    gather_exchange_ = arena.take<float>(max_exchange_);
    unit0_params_ = arena.take<float>(unit0);
    block_params_ = arena.take<float>(max_block_);
    if (gemm_copy) {
      unit0_gemm_ = arena.take<bf16>(unit0);
      block_gemm_ = arena.take<bf16>(max_block_);
    }
  }
}

ZeroStorage::~ZeroStorage() {
  std::vector<CommWork*> works;
  for (CommWork& work : pending_sums_) works.push_back(&work);
  for (PendingScatter& scatter : scatters_) {
    for (CommWork& work : scatter.works) works.push_back(&work);
  }
  for (CommWork& work : gather_) works.push_back(&work);
  if (std::none_of(works.begin(), works.end(), [](const CommWork* w) { return w->pending(); })) return;
  groups_.dense->abort();
  if (groups_.experts != nullptr && groups_.experts != groups_.dense) groups_.experts->abort();
  for (CommWork* work : works) {
    try {
      work->wait();
    } catch (const std::exception&) {
      // Aborted on purpose: the failure that ended the step is reported elsewhere.
    }
  }
}

void ZeroStorage::init(uint64_t seed) {
  gemm_copy_stale();
  std::vector<float> host(table_.total());
  init_parameters(table_, seed, host.data());
  if (stage_ < 3) {
    backend_.copy_from_host(params_.data(), host.data(), host.size() * sizeof(float));
    return;
  }
  // Only the shard travels: the whole model never sits in backend memory.
  // The packed padding stays as the arena zeroed it.
  for (size_t t = 0; t < table_.specs().size(); ++t) {
    backend_.copy_from_host(params_.data() + packed_offset_[t],
                            host.data() + table_.specs()[t].offset + shards_->shard_begin(t, rank_of(t)),
                            shards_->shard_numel(t, rank_of(t)) * sizeof(float));
  }
  unit0_params_valid_ = false;
  block_params_unit_ = -1;
}

float* ZeroStorage::params() {
  gemm_copy_stale();
  return params_for_io();
}

float* ZeroStorage::params_for_io() {
  if (stage_ == 3) throw common::Error(common::ErrorCode::kInternal, "ZeRO-3 holds no whole parameter buffer");
  return params_.data();
}

float* ZeroStorage::grads() {
  if (stage_ >= 2) throw common::Error(common::ErrorCode::kInternal, "ZeRO-2/3 hold no whole gradient buffer");
  return grads_.data();
}

void ZeroStorage::zero_gradients() {
  grads_.zero();
  std::fill(grads_open_.begin(), grads_open_.end(), false);
}

void ZeroStorage::begin_microbatch(bool last) { last_microbatch_ = last; }

void ZeroStorage::reduce_gradients() {
  for (CommWork& work : pending_sums_) work.wait();
  pending_sums_.clear();
  for (size_t slot = 0; slot < 2; ++slot) finish_scatter(slot);
}

size_t ZeroStorage::run_begin(int unit, const Run& run) const {
  return run.first == table_.unit_first_tensor(unit) ? table_.unit_begin(unit) : table_.specs()[run.first].offset;
}

size_t ZeroStorage::run_end(int unit, const Run& run) const {
  return run.last == table_.unit_end_tensor(unit) ? table_.unit_end(unit) : table_.specs()[run.last].offset;
}

void ZeroStorage::sum_unit_gradients(int unit) {
  float* grads = grads_.data();
  for (const Run& run : runs_[static_cast<size_t>(unit)]) {
    if (run.comm == nullptr) continue;
    const size_t end = run_end(unit, run);
    for (size_t offset = run_begin(unit, run); offset < end; offset += kAllReduceBucketFloats) {
      CommWork work = run.comm->start_all_reduce(grads + offset, std::min(kAllReduceBucketFloats, end - offset));
      if (overlap_) {
        pending_sums_.push_back(std::move(work));
      } else {
        work.wait();
      }
    }
  }
}

int64_t ZeroStorage::owned_row_begin(size_t t) const {
  if (stage_ == 0) return 0;
  return static_cast<int64_t>(shards_->shard_begin(t, rank_of(t))) / table_.specs()[t].row_numel();
}

int64_t ZeroStorage::owned_rows(size_t t) const {
  return static_cast<int64_t>(owned_numel(t)) / table_.specs()[t].row_numel();
}

size_t ZeroStorage::owned_numel(size_t t) const {
  return stage_ == 0 ? table_.specs()[t].numel : shards_->shard_numel(t, rank_of(t));
}

float* ZeroStorage::owned_parameters(size_t t) {
  gemm_copy_stale();
  return owned_parameters_for_io(t);
}

float* ZeroStorage::owned_parameters_for_io(size_t t) {
  if (stage_ == 3) return params_.data() + packed_offset_[t];
  const size_t begin = stage_ == 0 ? 0 : shards_->shard_begin(t, rank_of(t));
  return params_.data() + table_.specs()[t].offset + begin;
}

float* ZeroStorage::owned_gradients(size_t t) {
  if (stage_ >= 2) return grads_.data() + packed_offset_[t];
  const size_t begin = stage_ == 0 ? 0 : shards_->shard_begin(t, rank_of(t));
  return grads_.data() + table_.specs()[t].offset + begin;
}

bf16* ZeroStorage::owned_gemm_copy(size_t t) {
  return stage_ == 0 && gemm_params_.size() > 0 ? gemm_params_.data() + table_.specs()[t].offset : nullptr;
}

void ZeroStorage::publish_parameters(bool gemm_copy_written) {
  if (gemm_copy_written && stage_ == 0 && gemm_params_.size() > 0) {
    gemm_fresh_.assign(gemm_fresh_.size(), true);
    return;
  }
  gemm_copy_stale();
  if (stage_ == 3) {
    // A gather still in flight would read shards the optimizer just changed.
    for (CommWork& work : gather_) work.wait();
    gather_unit_ = -1;
    unit0_params_valid_ = false;
    block_params_unit_ = -1;
    return;
  }
  if (stage_ == 0) return;
  for (const auto& runs : runs_) {
    for (const Run& run : runs) {
      // A group of one updated its tensors whole, in place.
      if (run.comm == nullptr) continue;
      shards_->pack(backend_, params_.data(), run.rank, run.first, run.last, packed_unit_[0].data());
      run.comm->all_gather(packed_unit_[0].data(), exchange_[0].data(), packed_numel(run));
      shards_->unpack(backend_, exchange_[0].data(), run.first, run.last, params_.data());
    }
  }
}

size_t ZeroStorage::working_bytes() const {
  return exchange_[0].bytes() + exchange_[1].bytes() + packed_unit_[0].bytes() + packed_unit_[1].bytes() +
         gather_exchange_.bytes() + unit0_params_.bytes() + block_params_.bytes() + unit0_grads_.bytes() +
         block_grads_.bytes();
}

size_t ZeroStorage::unit_packed_numel(int unit) const {
  return shards_->packed_numel(table_.unit_first_tensor(unit), table_.unit_end_tensor(unit));
}

void ZeroStorage::start_gather(int unit) {
  // A gather still in flight owns gather_exchange_ until it is done.
  for (CommWork& work : gather_) work.wait();
  gather_.clear();
  gather_unit_ = unit;
  for (const Run& run : runs_[static_cast<size_t>(unit)]) {
    const float* shard = params_.data() + packed_offset_[run.first];
    float* every_rank = gather_exchange_.data() + run.exchange_at;
    if (run.comm == nullptr) {
      backend_.copy(every_rank, shard, packed_numel(run) * sizeof(float));
      continue;
    }
    gather_.push_back(run.comm->start_all_gather(shard, every_rank, packed_numel(run)));
    if (!overlap_) gather_.back().wait();
  }
}

void ZeroStorage::finish_gather(int unit, float* dst, bf16* gemm) {
  // A prefetch of another unit (a caller that changed its mind) is wasted.
  if (gather_unit_ != unit) start_gather(unit);
  for (CommWork& work : gather_) work.wait();
  gather_unit_ = -1;
  for (const Run& run : runs_[static_cast<size_t>(unit)]) {
    shards_->unpack(backend_, gather_exchange_.data() + run.exchange_at, run.first, run.last, dst,
                    table_.unit_begin(unit));
  }
  if (gemm != nullptr) backend_.round_to_bf16(gemm, dst, table_.unit_end(unit) - table_.unit_begin(unit));
}

UnitParameters ZeroStorage::acquire_parameters(int unit) {
  if (stage_ < 3) {
    const size_t begin = table_.unit_begin(unit);
    if (gemm_params_.size() == 0) return {params_.data() + begin, nullptr};
    if (!gemm_fresh_[static_cast<size_t>(unit)]) {
      backend_.round_to_bf16(gemm_params_.data() + begin, params_.data() + begin, table_.unit_end(unit) - begin);
      gemm_fresh_[static_cast<size_t>(unit)] = true;
    }
    return {params_.data() + begin, gemm_params_.data() + begin};
  }
  if (unit == 0) {
    if (!unit0_params_valid_) finish_gather(0, unit0_params_.data(), unit0_gemm_.data());
    unit0_params_valid_ = true;
    return {unit0_params_.data(), unit0_gemm_.data()};
  }
  // The blocks share one buffer; the block backward starts with is still
  // there from the end of forward, so it is not gathered twice.
  if (block_params_unit_ != unit) finish_gather(unit, block_params_.data(), block_gemm_.data());
  block_params_unit_ = unit;
  return {block_params_.data(), block_gemm_.data()};
}

void ZeroStorage::prefetch_parameters(int unit) {
  if (stage_ < 3 || gather_unit_ == unit) return;
  if (unit == 0 ? unit0_params_valid_ : block_params_unit_ == unit) return;
  start_gather(unit);
}

float* ZeroStorage::unit_gradients(int unit) {
  if (stage_ < 2) return grads_.data() + table_.unit_begin(unit);
  const ArenaArray<float>& buffer = unit == 0 ? unit0_grads_ : block_grads_;
  if (!grads_open_[unit]) {
    backend_.zero(buffer.data(), (table_.unit_end(unit) - table_.unit_begin(unit)) * sizeof(float));
    grads_open_[unit] = true;
  }
  return buffer.data();
}

void ZeroStorage::gradients_ready(int unit) {
  float* unit_grads =
      stage_ < 2 ? grads_.data() + table_.unit_begin(unit) : (unit == 0 ? unit0_grads_.data() : block_grads_.data());
  if (gradient_hook_) gradient_hook_(unit, unit_grads, table_.unit_end(unit) - table_.unit_begin(unit));
  if (groups_.dense == nullptr) return;
  if (stage_ < 2) {
    if (last_microbatch_) sum_unit_gradients(unit);
    return;
  }
  // Packing copies the unit's gradients out, so backward may reuse the
  // unit's buffer while the reduce-scatter runs.
  const size_t slot = next_slot_;
  next_slot_ = 1 - next_slot_;
  finish_scatter(slot);
  scatters_[slot].unit = unit;
  for (const Run& run : runs_[static_cast<size_t>(unit)]) {
    const size_t count = packed_numel(run);
    float* every_rank = exchange_[slot].data() + run.exchange_at;
    float* own = packed_unit_[slot].data() + run.packed_at;
    if (run.comm == nullptr) {
      // A group of one: its shard is the whole sum.
      shards_->pack(backend_, unit_grads, 0, run.first, run.last, own, table_.unit_begin(unit));
      continue;
    }
    for (int r = 0; r < run.size(); ++r) {
      shards_->pack(backend_, unit_grads, r, run.first, run.last, every_rank + static_cast<size_t>(r) * count,
                    table_.unit_begin(unit));
    }
    scatters_[slot].works.push_back(run.comm->start_reduce_scatter(every_rank, own, count));
  }
  grads_open_[unit] = false;
  if (!overlap_) finish_scatter(slot);
}

void ZeroStorage::finish_scatter(size_t slot) {
  PendingScatter& pending = scatters_[slot];
  if (pending.unit < 0) return;
  for (CommWork& work : pending.works) work.wait();
  pending.works.clear();
  backend_.accumulate(grads_.data() + packed_offset_[table_.unit_first_tensor(pending.unit)], packed_unit_[slot].data(),
                      unit_packed_numel(pending.unit));
  pending.unit = -1;
}

}  // namespace keel::trainer
