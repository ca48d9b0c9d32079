#include "trainer/train/sdc_guard.h"

#include "common/error.h"
#include "common/events.h"
#include "common/log.h"
#include "trainer/kernels/known_answer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>

namespace keel::trainer {
namespace {

using health::SdcMethod;
using health::SdcVerdict;

// The deviation unit is never below 5% (in log terms): a window of nearly
// equal values (a plateau) would otherwise call a few percent an anomaly.
constexpr double kMinDeviation = 0.05;

double median(std::vector<double> values) {
  const auto mid = values.begin() + static_cast<std::ptrdiff_t>(values.size() / 2);
  std::nth_element(values.begin(), mid, values.end());
  return *mid;
}

// Losses and norms are positive and their swings multiplicative: they are
// scored as logarithms, which keeps a norm's heavy right tail from reading
// as an anomaly while a corrupted value (many times larger) still stands
// out by far.
double log_of(double x) { return std::log(std::max(x, 1e-30)); }

// How far `x` lies above the window's median, in robust standard
// deviations (1.4826 MAD). One-sided: corruption makes a loss or norm
// blow up, while a sudden fall is what training does when it learns.
double robust_score(const std::deque<double>& window, double x) {
  std::vector<double> logs;
  logs.reserve(window.size());
  for (double v : window) logs.push_back(log_of(v));
  const double m = median(logs);
  std::vector<double> deviations;
  deviations.reserve(logs.size());
  for (double v : logs) deviations.push_back(std::abs(v - m));
  return (log_of(x) - m) / std::max(1.4826 * median(deviations), kMinDeviation);
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Floats hold integers exactly up to 2^24: a digest folded to 24 bits
// survives a float sum over ranks where every other slot is zero.
float fold24(uint64_t digest) { return static_cast<float>((digest ^ (digest >> 24) ^ (digest >> 48)) & 0xFFFFFFu); }

}  // namespace

uint64_t digest_of(Backend& backend, const std::vector<FloatSpan>& spans) {
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), &XXH3_freeState);
  XXH3_64bits_reset(state.get());
  std::vector<float> host;
  for (const FloatSpan& span : spans) {
    const size_t bytes = span.numel * sizeof(float);
    if (backend.host_memory()) {
      XXH3_64bits_update(state.get(), span.data, bytes);
    } else {
      host.resize(span.numel);
      backend.copy_to_host(host.data(), span.data, bytes);
      XXH3_64bits_update(state.get(), host.data(), bytes);
    }
  }
  return XXH3_64bits_digest(state.get());
}

SdcGuard::SdcGuard(const common::Config& config, Backend& backend, int rank, int world_size, int64_t generation,
                   health::BoardPublisher& board, std::function<void(float*, size_t)> sum_over_world)
    : config_(config),
      backend_(backend),
      rank_(rank),
      world_size_(world_size),
      generation_(generation),
      board_(board),
      sum_over_world_(std::move(sum_over_world)),
      rerun_(config.health.sdc_rerun),
      last_kernel_test_(std::chrono::steady_clock::now()) {}

void SdcGuard::compare_replicas(ReplicatedState replicated) {
  replicated_ = std::move(replicated);
  if (config_.health.sdc_digest_every > 0 && replicated_.spans.empty()) {
    common::logger("sdc")->info("no replica digests: {}", replicated_.none_because);
  }
}

void SdcGuard::begin_attempt() {
  previous_ = current_;
  current_ = Fingerprint{};
}

void SdcGuard::add_local_loss(double loss_sum) { current_.loss += loss_sum; }

void SdcGuard::add_local_gradients(double squares) { current_.grad_squares += squares; }

void SdcGuard::add_local_activations(double squares) { current_.activation_squares += squares; }

SdcGuard::Assessment SdcGuard::assess(const StepSignals& result) const {
  const std::pair<const char*, double> signals[] = {{"loss", result.loss},
                                                    {"grad_norm", result.grad_norm},
                                                    {"activation_squares", result.activation_squares}};
  const std::deque<double>* windows[] = {&losses_, &norms_, &activations_};
  Assessment a;
  // A cross-entropy, a norm or a sum of squares below zero is impossible.
  for (const auto& [name, value] : signals) {
    if (!std::isfinite(value) || value < 0) {
      a.signal = name;
      a.rerun = rerun_;
      return a;
    }
  }
  if (losses_.size() < static_cast<size_t>(config_.health.sdc_anomaly_window)) return a;
  for (size_t i = 0; i < std::size(signals); ++i) {
    const double score = robust_score(*windows[i], signals[i].second);
    if (!a.score || score > *a.score) {
      a.score = score;
      a.signal = signals[i].first;
    }
  }
  a.rerun = rerun_ && *a.score > config_.health.sdc_anomaly_z;
  return a;
}

void SdcGuard::accept(int64_t step, const StepSignals& result) {
  // Warm-up's steps are not training's normal: the loss falls fastest and
  // the norm swings most while the learning rate still rises.
  if (step < config_.train.warmup_steps) return;
  for (auto [window, value] : {std::pair{&losses_, static_cast<double>(result.loss)},
                               {&norms_, result.grad_norm},
                               {&activations_, result.activation_squares}}) {
    window->push_back(value);
    if (window->size() > static_cast<size_t>(config_.health.sdc_anomaly_window)) window->pop_front();
  }
}

void SdcGuard::refuse(int64_t step, const StepSignals& result) const {
  throw common::Error(
      common::ErrorCode::kSdcSuspected,
      fmt::format("step {}: the loss is {} and the gradient norm {}; the update was not applied and no checkpoint "
                  "is written from this state, so the newest checkpoint is the last good state. A restart resumes "
                  "from it; if the same step fails again, the data or the settings (train.lr, "
                  "train.warmup_steps) are the likely cause, otherwise the hardware",
                  step, result.loss, result.grad_norm));
}

std::vector<int> SdcGuard::ranks_flagged(bool mine, float value) {
  std::vector<float> flags(static_cast<size_t>(world_size_), 0.0f);
  if (mine) flags[static_cast<size_t>(rank_)] = value;
  sum_over_world_(flags.data(), flags.size());
  std::vector<int> flagged;
  for (int r = 0; r < world_size_; ++r) {
    if (flags[static_cast<size_t>(r)] != 0.0f) flagged.push_back(r);
  }
  return flagged;
}

void SdcGuard::record(int64_t step, int rank, SdcMethod method, SdcVerdict verdict, nlohmann::json fields) const {
  fields["step"] = step;
  fields["method"] = health::sdc_method_name(static_cast<uint32_t>(method));
  fields["verdict"] = health::sdc_verdict_name(static_cast<uint32_t>(verdict));
  common::append_event(config_.job.run_dir, "sdc_detected", generation_, rank, std::move(fields));
}

SdcGuard::RerunOutcome SdcGuard::judge_rerun(int64_t step, const Assessment& assessment, const StepSignals& first,
                                              const StepSignals& rerun) {
  auto log = common::logger("sdc");
  const bool same = same_bits(first.loss, rerun.loss) && same_bits(first.grad_norm, rerun.grad_norm) &&
                    same_bits(first.activation_squares, rerun.activation_squares);
  const bool finite = std::isfinite(rerun.loss) && std::isfinite(rerun.grad_norm);
  const nlohmann::json results = {{"loss", first.loss},
                                  {"grad_norm", first.grad_norm},
                                  {"activation_squares", first.activation_squares},
                                  {"rerun_loss", rerun.loss},
                                  {"rerun_grad_norm", rerun.grad_norm},
                                  {"rerun_activation_squares", rerun.activation_squares}};
  if (same) {
    // The same inputs gave the same numbers: whatever made the step stand
    // out is in the data or the training, not in a rank's hardware.
    const bool skip = config_.health.spike_policy == "skip";
    const char* action = !finite ? "refused" : skip ? "skipped" : "applied";
    const std::string why = assessment.score ? fmt::format("its {} scored {:.1f} (threshold {})", assessment.signal,
                                                           *assessment.score, config_.health.sdc_anomaly_z)
                                             : fmt::format("its {} is not finite", assessment.signal);
    log->warn("step {}: {}, and the rerun gave the same loss {}, gradient norm {} and activation squares {}: a loss "
              "spike the data made, no hardware fault; the step is {}{}",
              step, why, rerun.loss, rerun.grad_norm, rerun.activation_squares, action,
              finite ? fmt::format(" (health.spike_policy = \"{}\")", config_.health.spike_policy) : std::string());
    if (rank_ == 0) {
      common::append_event(config_.job.run_dir, "loss_spike", generation_, -1,
                           {{"step", step},
                            {"loss", rerun.loss},
                            {"grad_norm", rerun.grad_norm},
                            {"activation_squares", rerun.activation_squares},
                            {"score", assessment.score ? nlohmann::json(*assessment.score) : nlohmann::json(nullptr)},
                            {"signal", assessment.signal},
                            {"threshold", config_.health.sdc_anomaly_z},
                            {"rerun_equal", true},
                            {"action", action}});
      if (finite && skip) {
        common::append_event(config_.job.run_dir, "step_skipped", generation_, -1,
                             {{"step", step}, {"loss", rerun.loss}, {"grad_norm", rerun.grad_norm}});
      }
    }
    if (!finite) refuse(step, rerun);
    return skip ? RerunOutcome::kSpikeSkipped : RerunOutcome::kSpikeApplied;
  }
  const std::vector<int> named = ranks_flagged(!(current_ == previous_));
  log->warn(
      "step {}: a transient fault: loss {}, gradient norm {} and activation squares {}, then {}, {} and {} on the "
      "rerun; the rerun's result is applied. Ranks whose own share changed: [{}]",
      step, first.loss, first.grad_norm, first.activation_squares, rerun.loss, rerun.grad_norm,
      rerun.activation_squares, fmt::join(named, ", "));
  if (rank_ == 0) {
    for (int r : named) record(step, r, SdcMethod::kRerun, SdcVerdict::kTransient, results);
    if (named.empty()) record(step, -1, SdcMethod::kRerun, SdcVerdict::kTransient, results);
  }
  if (std::find(named.begin(), named.end(), rank_) != named.end()) {
    board_.report_sdc(step, rank_, SdcMethod::kRerun, SdcVerdict::kTransient);
  }
  if (!finite) refuse(step, rerun);
  return RerunOutcome::kTransient;
}

void SdcGuard::after_step(int64_t steps_done) {
  const int64_t every = config_.health.sdc_digest_every;
  if (every <= 0 || replicated_.spans.empty() || steps_done % every != 0) return;
  board_.publish_digest(steps_done, replicated_.replica_set, digest_of(backend_, replicated_.spans));
}

bool SdcGuard::kernel_test_due() const {
  const double every = config_.health.sdc_kat_every_s;
  return every > 0 &&
         std::chrono::duration<double>(std::chrono::steady_clock::now() - last_kernel_test_).count() >= every;
}

void SdcGuard::test_kernels(int64_t step) {
  auto log = common::logger("sdc");
  const KnownAnswers answers = test_known_answers(backend_);
  last_kernel_test_ = std::chrono::steady_clock::now();
  const bool failed = !answers.failed_kernel.empty();
  // One all-reduce carries both: which ranks failed against the exact
  // result, and each rank's digest, so that a rank that differs from the
  // majority of its peers is found too.
  std::vector<float> slots(2 * static_cast<size_t>(world_size_), 0.0f);
  slots[static_cast<size_t>(rank_)] = failed ? 1.0f : 0.0f;
  slots[static_cast<size_t>(world_size_ + rank_)] = fold24(answers.digest);
  sum_over_world_(slots.data(), slots.size());
  std::map<float, int> votes;
  for (int r = 0; r < world_size_; ++r) votes[slots[static_cast<size_t>(world_size_ + r)]] += 1;
  const auto majority =
      std::max_element(votes.begin(), votes.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  const bool has_majority = 2 * majority->second > world_size_;
  std::vector<int> wrong;
  for (int r = 0; r < world_size_; ++r) {
    const bool odd = has_majority && slots[static_cast<size_t>(world_size_ + r)] != majority->first;
    if (slots[static_cast<size_t>(r)] != 0.0f || odd) wrong.push_back(r);
  }
  if (wrong.empty() && votes.size() == 1) {
    log->info("known-answer kernel test passed in {:.1f} ms (digest {:016x})", answers.seconds * 1e3, answers.digest);
    return;
  }
  const bool mine = std::find(wrong.begin(), wrong.end(), rank_) != wrong.end();
  const std::string what = failed ? fmt::format("kernel {} gave a wrong result", answers.failed_kernel)
                                  : std::string("its results differ from the majority of ranks'");
  if (mine) {
    board_.report_sdc(step, rank_, SdcMethod::kKat, SdcVerdict::kPersistent);
    record(step, rank_, SdcMethod::kKat, SdcVerdict::kPersistent,
           {{"kernel", failed ? answers.failed_kernel : std::string()}});
    throw common::Error(common::ErrorCode::kSdcSuspected,
                        fmt::format("known-answer kernel test before step {}: on this rank (rank {}) {}; this device "
                                    "computes wrong numbers without an error. Take it out of service",
                                    step, rank_, what));
  }
  throw common::Error(common::ErrorCode::kSdcSuspected,
                      fmt::format("known-answer kernel test before step {}: {} computed wrong results; the run stops "
                                  "so that a restart can leave them out",
                                  step,
                                  wrong.empty() ? std::string("the ranks disagree with no majority and")
                                                : fmt::format("rank(s) {}", fmt::join(wrong, ", "))));
}

}  // namespace keel::trainer
