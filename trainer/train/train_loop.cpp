#include "trainer/train/train_loop.h"

#include "common/error.h"
#include "common/log.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>

namespace keel::trainer {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(std::llround(seconds));
  if (s >= 3600) return fmt::format("{}h{:02}m", s / 3600, s % 3600 / 60);
  if (s >= 60) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

std::string format_rate(double tokens_per_s) {
  return tokens_per_s >= 1e4 ? fmt::format("{:.1f}k", tokens_per_s / 1e3) : fmt::format("{:.0f}", tokens_per_s);
}

int sequences_per_microbatch(const common::Config& c) {
  return static_cast<int>(c.train.batch_size / (c.parallel.dp * c.parallel.micro_batches));
}

// Gradients are summed over the DP group in buckets of this many floats
// (16 MiB): each bucket is one all-reduce, which bounds the transport's
// buffers for any model size.
constexpr size_t kAllReduceBucketFloats = size_t{4} << 20;

}  // namespace

TrainLoop::TrainLoop(const common::Config& config, Backend& backend, Communicator* dp)
    : config_(config),
      backend_(backend),
      dp_(dp),
      dp_rank_(dp != nullptr ? dp->rank() : 0),
      dp_size_(dp != nullptr ? dp->size() : 1),
      train_(TokenDataset::open(config.data.train, config.model.vocab_size, config.model.seq_len + 1)),
      micro_batch_(sequences_per_microbatch(config)),
      model_(config.model, backend, micro_batch_),
      // A single rank has nothing to shard over: ZeRO only applies with a group.
      shards_(config.parallel.zero >= 1 && dp != nullptr
                  ? std::optional<ShardLayout>(std::in_place, model_.table(), dp_size_)
                  : std::nullopt),
      optimizer_(backend, model_.table(), config.train, shards_ ? &*shards_ : nullptr, dp_rank_) {
  if (shards_) {
    const size_t block = shards_->packed_numel(0, shards_->tensor_count());
    packed_ = BackendArray<float>(backend, block);
    gathered_ = BackendArray<float>(backend, block * static_cast<size_t>(dp_size_));
  }
  if (dp_size_ != config.parallel.dp) {
    throw common::Error(common::ErrorCode::kInternal,
                        fmt::format("the DP group has {} ranks but parallel.dp = {}", dp_size_, config.parallel.dp));
  }
  if (!config.data.val.empty()) {
    val_ = TokenDataset::open(config.data.val, config.model.vocab_size, config.model.seq_len + 1);
  }
  model_.init(static_cast<uint64_t>(config.job.seed));
  const size_t tokens = static_cast<size_t>(micro_batch_) * config.model.seq_len;
  inputs_.resize(tokens);
  targets_.resize(tokens);
}

StepStats TrainLoop::train_step(int64_t step) {
  const auto start = Clock::now();
  const int T = static_cast<int>(config_.model.seq_len);
  const int64_t micro_batches = config_.parallel.micro_batches;
  // Each rank's gradient is its share of the global mean: summing over the
  // DP group then gives the gradient of the whole batch.
  const float loss_scale = 1.0f / static_cast<float>(micro_batches * dp_size_);
  const int64_t first_sample = static_cast<int64_t>(dp_rank_) * micro_batches * micro_batch_;

  StepStats stats;
  stats.step = step;
  model_.zero_grads();
  double loss_sum = 0, aux_sum = 0;
  for (int64_t m = 0; m < micro_batches; ++m) {
    fill_train_batch(train_, static_cast<uint64_t>(config_.job.seed), step, config_.train.batch_size, T,
                     first_sample + m * micro_batch_, micro_batch_, inputs_.data(), targets_.data());
    loss_sum += model_.forward(inputs_.data(), targets_.data(), micro_batch_);
    aux_sum += model_.aux_loss();
    model_.backward(loss_scale);
  }
  if (dp_ != nullptr) {
    all_reduce_gradients();
    float sums[2] = {static_cast<float>(loss_sum), static_cast<float>(aux_sum)};
    dp_->all_reduce(sums, 2);
    loss_sum = sums[0];
    aux_sum = sums[1];
  }
  stats.loss = static_cast<float>(loss_sum / (micro_batches * dp_size_));
  stats.aux_loss = static_cast<float>(aux_sum / (micro_batches * dp_size_));
  stats.lr = learning_rate(config_.train, step);
  stats.grad_norm = optimizer_.step(model_.params(), model_.grads(), static_cast<float>(stats.lr), step);
  if (shards_) all_gather_parameters();
  stats.step_ms = seconds_since(start) * 1e3;
  return stats;
}

void TrainLoop::all_reduce_gradients() {
  float* grads = model_.grads();
  const size_t total = model_.table().total();
  for (size_t offset = 0; offset < total; offset += kAllReduceBucketFloats) {
    dp_->all_reduce(grads + offset, std::min(kAllReduceBucketFloats, total - offset));
  }
}

void TrainLoop::all_gather_parameters() {
  const size_t tensors = shards_->tensor_count();
  shards_->pack(backend_, model_.params(), dp_rank_, 0, tensors, packed_.data());
  dp_->all_gather(packed_.data(), gathered_.data(), packed_.size());
  shards_->unpack(backend_, gathered_.data(), 0, tensors, model_.params());
}

MemoryUse TrainLoop::memory() const {
  const size_t flat_bytes = model_.table().total() * sizeof(float);
  return MemoryUse{flat_bytes, flat_bytes, optimizer_.state_bytes()};
}

float TrainLoop::validate() {
  // A validation batch has train.batch_size sequences whatever the layout;
  // each DP rank evaluates its slice of it in microbatches, as in training.
  const int T = static_cast<int>(config_.model.seq_len);
  const int64_t micro_batches = config_.parallel.micro_batches;
  const int64_t first_sample = static_cast<int64_t>(dp_rank_) * micro_batches * micro_batch_;
  double sum = 0;
  for (int64_t i = 0; i < config_.train.val_batches; ++i) {
    for (int64_t m = 0; m < micro_batches; ++m) {
      fill_val_batch(*val_, i, config_.train.batch_size, T, first_sample + m * micro_batch_, micro_batch_,
                     inputs_.data(), targets_.data());
      sum += model_.forward(inputs_.data(), targets_.data(), micro_batch_);
    }
  }
  if (dp_ != nullptr) {
    float total = static_cast<float>(sum);
    dp_->all_reduce(&total, 1);
    sum = total;
  }
  return static_cast<float>(sum / (config_.train.val_batches * micro_batches * dp_size_));
}

RunSummary TrainLoop::run(const std::atomic<bool>& stop) {
  auto log = common::logger("trainer");
  const auto& train = config_.train;
  const int64_t tokens_per_step = train.batch_size * config_.model.seq_len;
  std::filesystem::path run_dir(config_.job.run_dir);
  // Every DP rank computes the same step records; rank 0 writes them.
  std::optional<MetricsWriter> metrics;
  if (dp_rank_ == 0) metrics.emplace(run_dir);
  log->info("training {} steps of {} tokens ({} x {} microbatches of {} sequences); {} parameters; run_dir {}",
            train.steps, tokens_per_step, config_.parallel.dp, config_.parallel.micro_batches, micro_batch_,
            model_.table().parameter_count(), run_dir.string());

  RunSummary summary;
  const auto run_start = Clock::now();
  double window_ms = 0, window_loss = 0;
  int64_t window_steps = 0;
  for (int64_t step = 0; step < train.steps; ++step) {
    common::set_log_step(step);
    if (dp_ != nullptr) dp_->reset_stats();
    StepStats stats = train_step(step);
    summary.steps_done = step + 1;
    summary.final_train_loss = stats.loss;
    summary.tokens += tokens_per_step;
    if (!std::isfinite(stats.loss)) {
      log->error("loss is {} at step {}; lower train.lr or raise train.warmup_steps", stats.loss, step);
    }

    nlohmann::json record = {{"step", step},
                             {"loss", stats.loss},
                             {"lr", stats.lr},
                             {"grad_norm", stats.grad_norm},
                             {"tokens", summary.tokens},
                             {"tokens_per_s", tokens_per_step / (stats.step_ms / 1e3)},
                             {"step_ms", stats.step_ms}};
    if (config_.model.n_expert > 0) record["aux_loss"] = stats.aux_loss;
    // A stop request reaches the ranks at different moments; they agree on
    // it here so that none is left waiting in a collective for the others.
    bool stop_now = stop.load();
    if (dp_ != nullptr) {
      float requested = stop_now ? 1.0f : 0.0f;
      dp_->all_reduce(&requested, 1);
      stop_now = requested > 0.0f;
    }
    const bool last = step + 1 == train.steps || stop_now;
    if (val_ && train.val_every > 0 && ((step + 1) % train.val_every == 0 || last)) {
      const float val_loss = validate();
      summary.final_val_loss = val_loss;
      record["val_loss"] = val_loss;
      log->info("validation loss {:.4f}", val_loss);
    }
    if (dp_ != nullptr) {
      // Payload bytes this rank handed to the DP group during the step, per op.
      nlohmann::json comm = nlohmann::json::object();
      for (size_t op = 0; op < kCollectiveOpCount; ++op) {
        if (dp_->stats().calls[op] == 0) continue;
        comm[collective_op_name(static_cast<CollectiveOp>(op))] = {{"bytes", dp_->stats().bytes[op]},
                                                                   {"calls", dp_->stats().calls[op]}};
      }
      record["comm"] = comm;
    }
    if (metrics) metrics->write(record);

    window_ms += stats.step_ms;
    window_loss += stats.loss;
    ++window_steps;
    if ((step + 1) % train.log_every == 0 || last) {
      const double elapsed = seconds_since(run_start);
      const double eta = elapsed / static_cast<double>(step + 1) * static_cast<double>(train.steps - step - 1);
      log->info("step {}/{} | loss {:.4f} | lr {:.2e} | grad norm {:.3f} | {} tok/s | {:.0f} ms/step | ETA {}",
                step + 1, train.steps, window_loss / window_steps, stats.lr, stats.grad_norm,
                format_rate(tokens_per_step * window_steps / (window_ms / 1e3)), window_ms / window_steps,
                format_duration(eta));
      window_ms = window_loss = 0;
      window_steps = 0;
    }
    if (stop_now && step + 1 < train.steps) {
      summary.stopped_early = true;
      log->warn("stop requested: stopping after step {}", step);
      break;
    }
  }
  if (metrics) metrics->close();
  summary.wall_s = seconds_since(run_start);
  summary.tokens_per_s = summary.tokens / summary.wall_s;
  summary.memory = memory();
  return summary;
}

}  // namespace keel::trainer
