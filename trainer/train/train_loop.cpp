#include "trainer/train/train_loop.h"

#include "common/clock.h"
#include "common/error.h"
#include "common/human_format.h"
#include "common/layout_check.h"
#include "common/log.h"
#include "trainer/data/batches.h"
#include "trainer/train/rank_parts.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <iterator>

namespace keel::trainer {
namespace {

using Clock = std::chrono::steady_clock;
using common::seconds_since;

std::string format_rate(double tokens_per_s) {
  return tokens_per_s >= 1e4 ? fmt::format("{:.1f}k", tokens_per_s / 1e3) : fmt::format("{:.0f}", tokens_per_s);
}

// What every rank acts on after a step, agreed over the grid so that none
// is left waiting in a collective for the others: a request reaches the
// ranks at different moments (a stop, keeld's checkpoint request through
// each board) and clocks differ (a save by time). Each is true when any
// rank voted for it.
struct StepVotes {
  bool stop = false;          // stop after this step
  bool save = false;          // save a checkpoint, by time or on keeld's request
  bool test_kernels = false;  // the SDC guard's kernel test is due
  bool snapshot = false;      // an in-memory snapshot is due, so every rank holds the same steps
  bool copy_pending = false;  // keeld is still copying the last snapshot to the buddy

  StepVotes agreed(const ProcessGroups& groups) const {
    static constexpr bool StepVotes::*kFields[] = {&StepVotes::stop, &StepVotes::save, &StepVotes::test_kernels,
                                                   &StepVotes::snapshot, &StepVotes::copy_pending};
    constexpr size_t kCount = std::size(kFields);
    float sums[kCount];
    for (size_t f = 0; f < kCount; ++f) sums[f] = this->*kFields[f] ? 1.0f : 0.0f;
    groups.sum_over_grid(sums, kCount);
    StepVotes any;
    for (size_t f = 0; f < kCount; ++f) any.*kFields[f] = sums[f] > 0.0f;
    return any;
  }
};

// The progress line, every log_every steps and at the last: the window's
// mean loss, rate and step time, and the ETA at the run's mean pace.
class ProgressLog {
 public:
  ProgressLog(const common::TrainConfig& train, int64_t tokens_per_step)
      : train_(train), tokens_per_step_(tokens_per_step), start_(Clock::now()) {}

  void add(int64_t step, const StepStats& stats, bool last) {
    window_ms_ += stats.step_ms;
    window_loss_ += stats.loss;
    ++window_steps_;
    if ((step + 1) % train_.log_every != 0 && !last) return;
    const double elapsed = seconds_since(start_);
    const double eta = elapsed / static_cast<double>(step + 1) * static_cast<double>(train_.steps - step - 1);
    common::logger("trainer")->info(
        "step {}/{} | loss {:.4f} | lr {:.2e} | grad norm {:.3f} | {} tok/s | {:.0f} ms/step | ETA {}", step + 1,
        train_.steps, window_loss_ / window_steps_, stats.lr, stats.grad_norm,
        format_rate(tokens_per_step_ * window_steps_ / (window_ms_ / 1e3)), window_ms_ / window_steps_,
        common::format_duration(eta));
    window_ms_ = window_loss_ = 0;
    window_steps_ = 0;
  }
  double seconds() const { return seconds_since(start_); }

 private:
  const common::TrainConfig& train_;
  int64_t tokens_per_step_;
  Clock::time_point start_;
  double window_ms_ = 0, window_loss_ = 0;
  int64_t window_steps_ = 0;
};

// The payload bytes this rank handed to each group since the step began,
// per op, and how long the group's collectives ran against how long
// training was blocked on them (the rest overlapped compute): metrics'
// "comm" and "comm_ms".
void add_comm_stats(const ProcessGroups& groups, nlohmann::json& record) {
  nlohmann::json comm = nlohmann::json::object(), comm_ms = nlohmann::json::object();
  for (const auto& group : groups.communicators()) {
    const CommStats group_stats = group.comm->stats();
    nlohmann::json ops = nlohmann::json::object();
    for (size_t op = 0; op < kCollectiveOpCount; ++op) {
      if (group_stats.calls[op] == 0) continue;
      ops[collective_op_name(static_cast<CollectiveOp>(op))] = {{"bytes", group_stats.bytes[op]},
                                                                {"calls", group_stats.calls[op]}};
    }
    const char* name = axis_name(group.axis);
    comm[name] = ops;
    comm_ms[name] = {{"busy", static_cast<double>(group_stats.busy_ns) / 1e6},
                     {"exposed", static_cast<double>(group_stats.wait_ns) / 1e6}};
  }
  if (comm.empty()) return;
  record["comm"] = comm;
  record["comm_ms"] = comm_ms;
}

}  // namespace

Step::Buffers TrainLoop::lay_out_memory() {
  Step::Buffers buffers;
  state_memory_ = std::make_unique<Arena>(
      backend_, [&](Arena& arena) { buffers = lay_out_rank(arena, storage_, optimizer_, model_, groups_); });
  return buffers;
}

TrainLoop::TrainLoop(const common::Config& config, Backend& backend, const ProcessGroups& groups, RankContext rank)
    : config_(config),
      backend_(backend),
      groups_(groups),
      dp_rank_(groups.rank(Axis::kDp)),
      dp_size_(groups.size(Axis::kDp)),
      tp_rank_(groups.rank(Axis::kTp)),
      train_(DataMix::open(config.data.train_sources(), config.model.vocab_size, config.model.seq_len + 1)),
      micro_batch_(sequences_per_microbatch(config)),
      stage_(stage_of(config, groups)),
      schedule_(schedule_of(config, stage_)),
      table_(table_of(config, stage_, groups)),
      storage_(backend, table_, static_cast<int>(config.parallel.zero), ReduceGroups::of(groups),
               config.parallel.overlap_comm),
      optimizer_(backend, table_, config.train, owned_numels(storage_)),
      model_(config.model, backend, micro_batch_, storage_, groups,
             slots_for(schedule_, static_cast<int>(config.parallel.micro_batches)), splits_backward(schedule_)),
      rank_(rank),
      board_(rank.board != nullptr ? *rank.board : no_board_),
      faults_(config, rank.rank, rank.generation),
      sdc_(config, backend, rank.rank, rank.world_size, rank.generation, board_,
           [&groups](float* values, size_t count) { groups.sum_over_grid(values, count); }),
      state_(config_, backend_, table_, storage_, optimizer_, tp_rank_, rank_, board_, faults_),
      step_({config_, backend_, groups_, schedule_, storage_, optimizer_, model_, train_, board_, faults_, sdc_},
            lay_out_memory(), micro_batch_) {
  const Layout layout = Layout::from(config.parallel);
  for (Axis axis : kAxes) {
    if (groups.size(axis) != Mesh::group_size(layout, axis)) {
      throw common::Error(common::ErrorCode::kInternal,
                          fmt::format("the {} group has {} ranks but the layout gives it {}", axis_name(axis),
                                      groups.size(axis), Mesh::group_size(layout, axis)));
    }
  }
  if (!config.data.val.empty()) {
    val_ = open_token_stream(config.data.val, config.model.vocab_size, config.model.seq_len + 1);
  }
  storage_.init(static_cast<uint64_t>(config.job.seed));
  sdc_.compare_replicas(replicated_state());
  const size_t tokens = static_cast<size_t>(micro_batch_) * config.model.seq_len;
  inputs_.resize(tokens);
  targets_.resize(tokens);
}

ReplicatedState TrainLoop::replicated_state() {
  if (groups_.size(Axis::kDpCp) == 1) return {0, {}, "one DP rank holds no replica of another"};
  if (config_.parallel.ep > 1 && groups_.size(Axis::kExpertDp) == 1) {
    return {0, {}, "each rank holds experts of its own (ep = dp x cp), so no rank holds a replica of another's state"};
  }
  if (storage_.stage() == 3) {
    return {0, {}, "ZeRO-3 shards parameters and optimizer state over DP, so no rank holds a replica; the rerun and "
                   "the known-answer test cover them"};
  }
  // Below ZeRO-3 the parameters of a TP rank are whole and the same on
  // every DP rank of one EP rank; at ZeRO-0 so are the optimizer moments, so a flip there
  // shows at once rather than after it reaches the parameters.
  const size_t params = storage_.parameter_bytes() / sizeof(float);
  std::vector<FloatSpan> spans = {{storage_.params_for_io(), params}};
  if (storage_.stage() == 0) {
    spans.push_back({optimizer_.exp_avg(0), params});
    spans.push_back({optimizer_.exp_avg_sq(0), params});
  }
  // Only ranks holding the same slice of the same model at the same ZeRO
  // stage compare.
  const std::string set =
      fmt::format("tp {} of {}, pipeline stage {} of {}, experts of ep {} of {}, zero {}, model {}", tp_rank_,
                  config_.parallel.tp, stage_.index, stage_.count, groups_.rank(Axis::kEp), config_.parallel.ep,
                  storage_.stage(), config_.to_json().at("model").dump());
  return {XXH3_64bits(set.data(), set.size()), std::move(spans), ""};
}

MemoryUse TrainLoop::memory() const {
  return MemoryUse{storage_.parameter_bytes(), storage_.gemm_copy_bytes(), storage_.gradient_bytes(),
                   optimizer_.state_bytes(),
                   storage_.working_bytes() + step_.working_bytes(),
                   state_memory_->bytes(),
                   backend_.scratch_bytes()};
}

float TrainLoop::validate() {
  // A validation batch has train.batch_size sequences whatever the layout;
  // each DP rank evaluates its slice of it in microbatches, as in training.
  const int T = static_cast<int>(config_.model.seq_len);
  const int64_t micro_batches = config_.parallel.micro_batches;
  const int64_t first_sample = static_cast<int64_t>(dp_rank_) * micro_batches * micro_batch_;
  board_.set_phase(health::Phase::kValidation);
  faults_.stall("validation");
  double sum = 0;
  for (int64_t i = 0; i < config_.train.val_batches; ++i) {
    sum += forward_pass(
               static_cast<int>(micro_batches), [this](int) { return micro_batch_; },
               [&](int mb) {
                 fill_val_batch(*val_, i, config_.train.batch_size, T, first_sample + mb * micro_batch_, micro_batch_,
                                inputs_.data(), targets_.data());
               }) /
           micro_batch_;
  }
  sum_over_pipeline_and_dp(&sum);
  return static_cast<float>(sum / (config_.train.val_batches * micro_batches * groups_.size(Axis::kDpCp)));
}

double TrainLoop::forward_pass(int microbatches, const std::function<int(int mb)>& batch,
                               const std::function<void(int mb)>& fill) {
  double sum = 0;
  StageWork work;
  work.batch = batch;
  work.forward = [&](int mb, int chunk, int slot) {
    if (stage_.reads_tokens(chunk)) fill(mb);
    model_.forward(inputs_.data(), targets_.data(), batch(mb), slot, chunk);
    sum += static_cast<double>(model_.loss(slot)) * batch(mb);
  };
  run_stage(forward_only(stage_.count, stage_.index, microbatches, static_cast<int>(stage_.chunks.size())),
            microbatches, model_, groups_.get(Axis::kPp), work);
  return sum;
}

void TrainLoop::sum_over_pipeline_and_dp(double* value) {
  float total = static_cast<float>(*value);
  for (Axis axis : {Axis::kPp, Axis::kDpCp}) {
    if (Communicator* group = groups_.get(axis)) group->all_reduce(&total, 1);
  }
  *value = total;
}

TrainLoop::Evaluation TrainLoop::evaluate(const std::filesystem::path& path, int64_t sequences) {
  const int T = static_cast<int>(config_.model.seq_len);
  const auto data = open_token_stream(path.string(), config_.model.vocab_size, T + 1);
  const int64_t available = data->num_tokens() / (T + 1);
  if (sequences < 0) sequences = available;
  if (sequences < 1 || sequences > available) {
    throw common::Error(common::ErrorCode::kDataError,
                        fmt::format("{} holds {} windows of seq_len + 1 = {} tokens but {} were asked for; pass "
                                    "--eval-sequences between 1 and {}",
                                    path.string(), available, T + 1, sequences, available));
  }
  // MoE blocks sum their routing statistics over dp x cp (and dispatch
  // over EP) in every forward, so every DP rank must run as many.
  if (config_.model.n_expert > 0 && sequences % dp_size_ != 0) {
    throw common::Error(
        common::ErrorCode::kDataError,
        fmt::format("a MoE model evaluates over dp={} ranks that must run the same forwards, but "
                    "--eval-sequences {} is not a multiple of {}: pass a multiple such as {}",
                    dp_size_, sequences, dp_size_, std::max<int64_t>(dp_size_, sequences / dp_size_ * dp_size_)));
  }
  // DP rank d takes windows d, d + dp, d + 2dp, ... in microbatches; the TP
  // ranks and pipeline stages of a DP rank take the same ones.
  const int64_t mine = sequences > dp_rank_ ? (sequences - dp_rank_ + dp_size_ - 1) / dp_size_ : 0;
  const int microbatches = static_cast<int>((mine + micro_batch_ - 1) / micro_batch_);
  auto batch = [&](int mb) { return static_cast<int>(std::min<int64_t>(micro_batch_, mine - mb * micro_batch_)); };
  std::vector<int32_t> window(static_cast<size_t>(T) + 1);
  double loss_sum = forward_pass(microbatches, batch, [&](int mb) {
    for (int b = 0; b < batch(mb); ++b) {
      const int64_t i = dp_rank_ + (static_cast<int64_t>(mb) * micro_batch_ + b) * dp_size_;
      data->copy(i * (T + 1), T + 1, window.data());
      std::copy(window.begin(), window.end() - 1, inputs_.begin() + static_cast<ptrdiff_t>(b) * T);
      std::copy(window.begin() + 1, window.end(), targets_.begin() + static_cast<ptrdiff_t>(b) * T);
    }
  });
  sum_over_pipeline_and_dp(&loss_sum);
  // The CP ranks of a window each hold the mean over their share of it.
  return Evaluation{static_cast<float>(loss_sum / static_cast<double>(sequences * groups_.size(Axis::kCp))), sequences};
}

RunSummary TrainLoop::run(const std::atomic<bool>& stop, int64_t stop_after) {
  try {
    return train_until(stop, stop_after);
  } catch (const common::Error& e) {
    // A peer that died or hangs will never report its file: the commit in
    // flight is abandoned now rather than after checkpoint.timeout_s, so
    // this rank exits (and leaves its flight dump) at once.
    if (e.code() == common::ErrorCode::kPeerFailure || e.code() == common::ErrorCode::kCollectiveHang) {
      state_.cancel_checkpoint(e.what());
    }
    throw;
  }
}

RunSummary TrainLoop::train_until(const std::atomic<bool>& stop, int64_t stop_after) {
  const auto& train = config_.train;
  const int64_t tokens_per_step = train.batch_size * config_.model.seq_len;
  ProgressLog progress(train, tokens_per_step);
  begin_run(tokens_per_step);
  // Every DP and TP rank computes the same step records, and the pipeline
  // passes its loss back from the last stage: the last stage's first rank
  // writes them.
  std::optional<MetricsWriter> metrics;
  if (groups_.rank(Axis::kDpCp) == 0 && tp_rank_ == 0 && stage_.last()) {
    metrics.emplace(config_.job.run_dir, state_.start_step());
  }
  RunSummary summary;
  summary.first_step = summary.steps_done = state_.start_step();
  summary.tokens = summary.first_step * tokens_per_step;
  auto last_save = Clock::now();
  for (int64_t step = summary.first_step; step < train.steps; ++step) {
    // Resumed at or past the requested stop: nothing to train, only the
    // final save below.
    if (stop_after >= 0 && step >= stop_after) break;
    const StepStats stats = run_step(step);
    summary.steps_done = step + 1;
    summary.final_train_loss = stats.loss;
    summary.tokens += tokens_per_step;
    nlohmann::json record = step_record(step, stats, summary.tokens, tokens_per_step);

    const bool save_time = config_.checkpoint.every_seconds > 0 &&
                           seconds_since(last_save) >= config_.checkpoint.every_seconds;
    const StepVotes votes =
        StepVotes{stop.load() || (stop_after >= 0 && step + 1 >= stop_after),
                  board_.take_checkpoint_request() || save_time, sdc_.kernel_test_due(),
                  state_.snapshot_due(step + 1, stats.step_ms / 1e3), state_.copy_pending()}
            .agreed(groups_);
    if (votes.test_kernels) sdc_.test_kernels(step + 1);
    const bool last = step + 1 == train.steps || votes.stop;
    if (val_ && train.val_every > 0 && ((step + 1) % train.val_every == 0 || last)) {
      summary.final_val_loss = validate();
      record["val_loss"] = *summary.final_val_loss;
      common::logger("trainer")->info("validation loss {:.4f}", *summary.final_val_loss);
    }
    // After validation, whose collectives the step's record counts too.
    add_comm_stats(groups_, record);
    if (metrics) metrics->write(record);
    board_.finish_step(step + 1, stats.loss, stats.grad_norm, tokens_per_step / (stats.step_ms / 1e3), stats.step_ms);
    progress.add(step, stats, last);

    if (votes.snapshot) state_.save_snapshot(step + 1, votes.copy_pending);
    const int64_t every = config_.checkpoint.every_steps;
    if (state_.checkpoints() && !last && (votes.save || (every > 0 && (step + 1) % every == 0))) {
      state_.save_checkpoint(step + 1);
      last_save = Clock::now();
    }
    if (votes.stop && step + 1 < train.steps) {
      summary.stopped_early = true;
      common::logger("trainer")->warn("stop requested: stopping after step {}", step);
      break;
    }
  }
  if (metrics) metrics->close();
  finish_run(summary);
  summary.wall_s = progress.seconds();
  summary.tokens_per_s = static_cast<double>(summary.tokens - summary.first_step * tokens_per_step) / summary.wall_s;
  return summary;
}

void TrainLoop::begin_run(int64_t tokens_per_step) {
  const auto& train = config_.train;
  common::logger("trainer")->info(
      "training {} steps of {} tokens ({} x {} microbatches of {} sequences); {} parameters on this rank (tp={}, "
      "zero={}); run_dir {}",
      train.steps, tokens_per_step, config_.parallel.dp, config_.parallel.micro_batches, micro_batch_,
      table_.parameter_count(), config_.parallel.tp, storage_.stage(), config_.job.run_dir);
  board_.set_extent(state_.start_step(), train.steps);
  sdc_.test_kernels(state_.start_step());
}

StepStats TrainLoop::run_step(int64_t step) {
  common::set_log_step(step);
  if (const auto request = board_.take_fault_request()) faults_.apply(*request, step);
  faults_.before_step(step);
  board_.begin_step(step);
  for (const auto& group : groups_.communicators()) group.comm->reset_stats();
  const StepStats stats = train_step(step);
  board_.record_step_timing();
  return stats;
}

nlohmann::json TrainLoop::step_record(int64_t step, const StepStats& stats, int64_t tokens,
                                      int64_t tokens_per_step) {
  nlohmann::json record = {{"step", step},
                           {"loss", stats.loss},
                           {"lr", stats.lr},
                           {"grad_norm", stats.grad_norm},
                           {"tokens", tokens},
                           {"tokens_per_s", tokens_per_step / (stats.step_ms / 1e3)},
                           {"step_ms", stats.step_ms}};
  if (config_.model.n_expert > 0) {
    record["aux_loss"] = stats.aux_loss;
    record["expert_tokens"] = step_.expert_tokens();
  }
  if (stats.anomaly_score) record["anomaly_score"] = *stats.anomaly_score;
  if (stats.loss_spike) record["loss_spike"] = true;
  if (stats.skipped) record["skipped"] = true;
  return record;
}

void TrainLoop::finish_run(RunSummary& summary) {
  board_.set_phase(health::Phase::kCheckpoint);
  // The end of a run, finished or stopped, is always saved.
  if (const std::optional<bool> saved = state_.save_end(summary.steps_done)) {
    // Rank 0 knows whether the commit happened, the others only whether
    // their file was written: they agree on the outcome, so that a failed
    // final save is every rank's exit 13, never a clean stop.
    float failed = *saved ? 0.0f : 1.0f;
    groups_.sum_over_grid(&failed, 1);
    summary.final_checkpoint_failed = failed > 0.0f;
  }
  board_.set_phase(health::Phase::kIdle);
  summary.parameter_digest = parameter_digest();
  summary.memory = memory();
  summary.schedules = step_.schedule_time();
}

std::string TrainLoop::parameter_digest() {
  std::vector<FloatSpan> spans;
  for (size_t t = 0; t < table_.specs().size(); ++t) {
    if (storage_.stage() == 3) {
      spans.push_back({storage_.owned_parameters_for_io(t), storage_.owned_numel(t)});
    } else {
      spans.push_back({storage_.params_for_io() + table_.specs()[t].offset, table_.specs()[t].numel});
    }
  }
  return fmt::format("{:016x}", digest_of(backend_, spans));
}

}  // namespace keel::trainer
