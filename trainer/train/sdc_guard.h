// The trainer's side of silent-data-corruption detection
// (docs/architecture.md "Health": SDC). keeld compares the replica digests
// across ranks and turns the board's SDC reports into its own records; the
// rank finds the rest itself:
//
// * Replica digests: every health.sdc_digest_every steps, the XXH3 of the
//   bytes this rank's DP replicas hold identically goes on its board.
// * Rerun on anomaly (health.sdc_rerun): a step whose loss, gradient norm
//   or activation squares (StepSignals) is non-finite, or stands out
//   against the recent window, is computed again from the same inputs
//   before the optimizer touches the parameters. A different result was a
//   transient fault: the ranks whose own share of it changed between the
//   runs are named, and the rerun is applied. The same result is no
//   hardware finding but a loss spike the data made: it is recorded as
//   such (loss_spike), never as SDC, and health.spike_policy says whether
//   it is trained on or skipped.
// * Known-answer kernel test (trainer/kernels/known_answer.h) at start and
//   every health.sdc_kat_every_s: a rank that computes wrong numbers, or
//   other numbers than its peers, stops the run with exit 11.
//
// Every rank holds the same window (it is fed the world-wide loss and norm)
// and so takes the same decisions; the calls marked collective must be made
// by every rank at the same point.
#pragma once

#include "common/config.h"
#include "health/board_publisher.h"
#include "trainer/kernels/backend.h"

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace keel::trainer {

// XXH3-64 of the spans' bytes, in order, as one stream.
uint64_t digest_of(Backend& backend, const std::vector<FloatSpan>& spans);

// What this rank's DP replicas hold identically: the spans and a hash
// naming the replica set (ranks with equal sets must hold equal bytes).
// No spans: nothing is replicated, and `none_because` says why.
struct ReplicatedState {
  uint64_t replica_set = 0;
  std::vector<FloatSpan> spans;
  std::string none_because;
};

// What a step's result is judged by, the same on every rank (each is summed
// over the world): its loss, its gradient norm, and the sum of squares of
// the activations that feed the loss: the residual stream leaving the last
// block, which carries every block's output forward, and the logits. The
// last is a range check: a corrupted activation that LayerNorm swallows
// (a huge value makes its row's variance overflow and the row's output
// plain bias) or that softmax ignores (a huge negative logit) hardly moves
// the loss or the norm, yet changes the update; its square does not hide.
struct StepSignals {
  float loss = 0;
  double grad_norm = 0;
  double activation_squares = 0;
};

class SdcGuard {
 public:
  // `sum_over_world` sums floats in place over every rank of the run.
  SdcGuard(const common::Config& config, Backend& backend, int rank, int world_size, int64_t generation,
           health::BoardPublisher& board, std::function<void(float*, size_t)> sum_over_world);
  // What this rank holds identically with its DP replicas, digested from
  // now on (after_step); none until called, as its memory is placed after
  // the guard exists.
  void compare_replicas(ReplicatedState replicated);

  // ---- rerun on anomaly ----
  // Whether this rank's local fingerprints are taken (health.sdc_rerun):
  // the step's hooks feed add_local_* only then.
  bool fingerprinting() const { return rerun_; }
  // A new computation of a step begins: its fingerprints start from zero
  // and the previous computation's are kept for judge_rerun.
  void begin_attempt();
  // This rank's own contribution before any sum over DP or TP: its loss
  // sum, the squares of its local gradients and of its activations.
  void add_local_loss(double loss_sum);
  void add_local_gradients(double squares);
  void add_local_activations(double squares);
  // This attempt's activation squares so far, for the caller to sum over
  // the world with the step's other scalars.
  double local_activation_squares() const { return current_.activation_squares; }
  // How a step's result stands against the recent window, before it is
  // applied. `score`: the largest of its signals' robust scores (the
  // logarithm's distance above the window's median in robust deviations),
  // once the window holds health.sdc_anomaly_window steps after
  // train.warmup_steps; none before (docs/architecture.md "Health": why).
  // `rerun` (with health.sdc_rerun): any signal is non-finite or negative,
  // or the score is above health.sdc_anomaly_z.
  struct Assessment {
    std::optional<double> score;
    std::string signal;  // the signal that scored highest, or the first non-finite one
    bool rerun = false;
  };
  Assessment assess(const StepSignals& result) const;
  // What a rerun showed (judge_rerun).
  enum class RerunOutcome {
    kTransient,     // the results differed: a transient fault, the rerun is applied
    kSpikeApplied,  // the same result: a loss spike, trained on (spike_policy "apply")
    kSpikeSkipped,  // the same result, skipped (spike_policy "skip")
  };
  // Collective, after the rerun (first: the result that asked for it, as
  // `assessment` judged it). Different results: the ranks whose
  // fingerprints changed are named in sdc_detected events (rank 0 appends
  // them) and on their own boards. The same result: rank 0 appends
  // loss_spike (and step_skipped when skipped); no rank is blamed. A rerun
  // whose loss or norm is non-finite is refused (Error kSdcSuspected) after
  // its record.
  RerunOutcome judge_rerun(int64_t step, const Assessment& assessment, const StepSignals& first,
                           const StepSignals& rerun);
  // The result of `step`, about to be applied or skipped, joins the window
  // once train.warmup_steps are done.
  void accept(int64_t step, const StepSignals& result);
  // Error(kSdcSuspected) for a non-finite result that is not re-run.
  [[noreturn]] void refuse(int64_t step, const StepSignals& result) const;

  // ---- replica digests ----
  // After a step: publishes the replica digest when `steps_done` is a
  // multiple of health.sdc_digest_every.
  void after_step(int64_t steps_done);

  // ---- known-answer kernel test ----
  // Whether health.sdc_kat_every_s has passed since this rank's last test
  // (ranks vote, as their clocks differ).
  bool kernel_test_due() const;
  // Collective: runs the test and compares the ranks' results. Any rank
  // wrong: it reports itself (board and sdc_detected) and every rank
  // throws Error(kSdcSuspected) naming the rank and the kernel.
  void test_kernels(int64_t step);

 private:
  struct Fingerprint {
    double loss = 0;
    double grad_squares = 0;
    double activation_squares = 0;
    bool operator==(const Fingerprint&) const = default;
  };
  // Sums one flag per global rank over the world; the ranks whose flag is set.
  std::vector<int> ranks_flagged(bool mine, float value = 1.0f);
  void record(int64_t step, int rank, health::SdcMethod method, health::SdcVerdict verdict,
              nlohmann::json fields) const;

  common::Config config_;
  Backend& backend_;
  int rank_;
  int world_size_;
  int64_t generation_;
  health::BoardPublisher& board_;
  std::function<void(float*, size_t)> sum_over_world_;
  ReplicatedState replicated_;
  bool rerun_;
  Fingerprint current_, previous_;
  std::deque<double> losses_, norms_, activations_;
  std::chrono::steady_clock::time_point last_kernel_test_;
};

}  // namespace keel::trainer
