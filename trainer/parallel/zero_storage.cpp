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

int effective_stage(int stage, const Communicator* dp) { return dp != nullptr && dp->size() > 1 ? stage : 0; }

}  // namespace

ZeroStorage::ZeroStorage(Backend& backend, const ParameterTable& table, int stage, Communicator* dp, bool overlap)
    : backend_(backend),
      table_(table),
      dp_(dp != nullptr && dp->size() > 1 ? dp : nullptr),
      stage_(effective_stage(stage, dp)),
      overlap_(overlap),
      grads_open_(static_cast<size_t>(table.unit_count()), false) {
  if (stage < 0 || stage > 3) {
    throw common::Error(common::ErrorCode::kInternal, "ZeRO stage " + std::to_string(stage) + " outside 0-3");
  }
  if (stage_ >= 1) {
    const size_t tensors = table.specs().size();
    dp_rank_ = dp_->rank();
    shards_.emplace(table, dp_->size());
    size_t offset = 0;
    for (size_t t = 0; t < tensors; ++t) {
      packed_offset_.push_back(offset);
      offset += shards_->packed_numel(t, t + 1);
    }
    for (int u = 0; u < table.unit_count(); ++u) {
      max_unit_ = std::max(max_unit_, unit_packed_numel(u));
      if (u > 0) max_block_ = std::max(max_block_, table.unit_end(u) - table.unit_begin(u));
    }
  }
}

void ZeroStorage::lay_out(Arena& arena) {
  if (stage_ == 0) {
    params_ = arena.take<float>(table_.total());
    grads_ = arena.take<float>(table_.total());
    return;
  }
  const size_t shard = shards_->packed_numel(0, table_.specs().size());
  params_ = arena.take<float>(stage_ == 3 ? shard : table_.total());
  grads_ = arena.take<float>(stage_ >= 2 ? shard : table_.total());
  // Stage 1 uses one slot, for its gathers; stages 2 and 3 alternate two
  // for the gradients' reduce-scatters.
  const size_t every_rank = max_unit_ * static_cast<size_t>(dp_->size());
  for (size_t slot = 0; slot < (stage_ >= 2 ? 2u : 1u); ++slot) {
    exchange_[slot] = arena.take<float>(every_rank);
    packed_unit_[slot] = arena.take<float>(max_unit_);
  }
  const size_t unit0 = table_.unit_end(0) - table_.unit_begin(0);
  if (stage_ >= 2) {
    unit0_grads_ = arena.take<float>(unit0);
    block_grads_ = arena.take<float>(max_block_);
  }
  if (stage_ == 3) {
    gather_exchange_ = arena.take<float>(every_rank);
    unit0_params_ = arena.take<float>(unit0);
    block_params_ = arena.take<float>(max_block_);
  }
}

ZeroStorage::~ZeroStorage() {
  std::vector<CommWork*> works;
  for (CommWork& work : pending_sums_) works.push_back(&work);
  for (PendingScatter& scatter : scatters_) works.push_back(&scatter.work);
  works.push_back(&gather_);
  if (std::none_of(works.begin(), works.end(), [](const CommWork* w) { return w->pending(); })) return;
  dp_->abort();
  for (CommWork* work : works) {
    try {
      work->wait();
    } catch (const std::exception&) {
      // Aborted on purpose: the failure that ended the step is reported elsewhere.
    }
  }
}

void ZeroStorage::init(uint64_t seed) {
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
                            host.data() + table_.specs()[t].offset + shards_->shard_begin(t, dp_rank_),
                            shards_->shard_numel(t, dp_rank_) * sizeof(float));
  }
  unit0_params_valid_ = false;
  block_params_unit_ = -1;
}

float* ZeroStorage::params() {
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

void ZeroStorage::sum_unit_gradients(int unit) {
  float* grads = grads_.data();
  const size_t end = table_.unit_end(unit);
  for (size_t offset = table_.unit_begin(unit); offset < end; offset += kAllReduceBucketFloats) {
    CommWork work = dp_->start_all_reduce(grads + offset, std::min(kAllReduceBucketFloats, end - offset));
    if (overlap_) {
      pending_sums_.push_back(std::move(work));
    } else {
      work.wait();
    }
  }
}

int64_t ZeroStorage::owned_row_begin(size_t t) const {
  if (stage_ == 0) return 0;
  return static_cast<int64_t>(shards_->shard_begin(t, dp_rank_)) / table_.specs()[t].row_numel();
}

int64_t ZeroStorage::owned_rows(size_t t) const {
  return static_cast<int64_t>(owned_numel(t)) / table_.specs()[t].row_numel();
}

size_t ZeroStorage::owned_numel(size_t t) const {
  return stage_ == 0 ? table_.specs()[t].numel : shards_->shard_numel(t, dp_rank_);
}

float* ZeroStorage::owned_parameters(size_t t) {
  if (stage_ == 3) return params_.data() + packed_offset_[t];
  const size_t begin = stage_ == 0 ? 0 : shards_->shard_begin(t, dp_rank_);
  return params_.data() + table_.specs()[t].offset + begin;
}

float* ZeroStorage::owned_gradients(size_t t) {
  if (stage_ >= 2) return grads_.data() + packed_offset_[t];
  const size_t begin = stage_ == 0 ? 0 : shards_->shard_begin(t, dp_rank_);
  return grads_.data() + table_.specs()[t].offset + begin;
}

void ZeroStorage::publish_parameters() {
  if (stage_ == 3) {
    // A gather still in flight would read shards the optimizer just changed.
    gather_.wait();
    gather_unit_ = -1;
    unit0_params_valid_ = false;
    block_params_unit_ = -1;
    return;
  }
  if (stage_ == 0) return;
  for (int u = 0; u < table_.unit_count(); ++u) {
    const size_t first = table_.unit_first_tensor(u), last = table_.unit_end_tensor(u);
    shards_->pack(backend_, params_.data(), dp_rank_, first, last, packed_unit_[0].data());
    dp_->all_gather(packed_unit_[0].data(), exchange_[0].data(), unit_packed_numel(u));
    shards_->unpack(backend_, exchange_[0].data(), first, last, params_.data());
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
  gather_.wait();
  gather_unit_ = unit;
  gather_ = dp_->start_all_gather(params_.data() + packed_offset_[table_.unit_first_tensor(unit)],
                                  gather_exchange_.data(), unit_packed_numel(unit));
  if (!overlap_) gather_.wait();
}

void ZeroStorage::finish_gather(int unit, float* dst) {
  // A prefetch of another unit (a caller that changed its mind) is wasted.
  if (gather_unit_ != unit) start_gather(unit);
  gather_.wait();
  gather_unit_ = -1;
  shards_->unpack(backend_, gather_exchange_.data(), table_.unit_first_tensor(unit), table_.unit_end_tensor(unit),
                  dst, table_.unit_begin(unit));
}

const float* ZeroStorage::acquire_parameters(int unit) {
  if (stage_ < 3) return params_.data() + table_.unit_begin(unit);
  if (unit == 0) {
    if (!unit0_params_valid_) finish_gather(0, unit0_params_.data());
    unit0_params_valid_ = true;
    return unit0_params_.data();
  }
  // The blocks share one buffer; the block backward starts with is still
  // there from the end of forward, so it is not gathered twice.
  if (block_params_unit_ != unit) finish_gather(unit, block_params_.data());
  block_params_unit_ = unit;
  return block_params_.data();
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
  float* unit_grads = stage_ < 2 ? grads_.data() + table_.unit_begin(unit)
                                 : (unit == 0 ? unit0_grads_.data() : block_grads_.data());
  if (gradient_hook_) gradient_hook_(unit, unit_grads, table_.unit_end(unit) - table_.unit_begin(unit));
  if (dp_ == nullptr) return;
  if (stage_ < 2) {
    if (last_microbatch_) sum_unit_gradients(unit);
    return;
  }
  // Packing copies the unit's gradients out, so backward may reuse the
  // unit's buffer while the reduce-scatter runs.
  const size_t slot = next_slot_;
  next_slot_ = 1 - next_slot_;
  finish_scatter(slot);
  const size_t first = table_.unit_first_tensor(unit), last = table_.unit_end_tensor(unit);
  const size_t count = unit_packed_numel(unit);
  for (int r = 0; r < shards_->size(); ++r) {
    shards_->pack(backend_, unit_grads, r, first, last, exchange_[slot].data() + static_cast<size_t>(r) * count,
                  table_.unit_begin(unit));
  }
  scatters_[slot] = {dp_->start_reduce_scatter(exchange_[slot].data(), packed_unit_[slot].data(), count), unit};
  grads_open_[unit] = false;
  if (!overlap_) finish_scatter(slot);
}

void ZeroStorage::finish_scatter(size_t slot) {
  PendingScatter& pending = scatters_[slot];
  if (pending.unit < 0) return;
  pending.work.wait();
  backend_.accumulate(grads_.data() + packed_offset_[table_.unit_first_tensor(pending.unit)],
                      packed_unit_[slot].data(), unit_packed_numel(pending.unit));
  pending.unit = -1;
}

}  // namespace keel::trainer
