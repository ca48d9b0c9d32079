// Pipeline schedules as data (docs/architecture.md "Pipeline schedules"):
// the actions one stage runs in a step, in order, which the training loop
// executes. Consecutive transfers form one exchange (Communicator::
// exchange), posted together and done together, so a stage can pass an
// activation on while the gradient of an earlier microbatch comes back.
#pragma once

#include <string>
#include <vector>

namespace keel::trainer {

enum class ActionKind : int {
  kForward,         // run this stage's layers on a microbatch
  kBackward,        // and back, freeing its activations (input gradients only when a kWeight follows)
  kWeight,          // the weight gradients of an earlier backward, freeing its activations
  kSendActivation,  // the forward's output to the next stage
  kRecvActivation,  // the previous stage's output, the input of a forward
  kSendGradient,    // the gradient of the forward's input to the previous stage
  kRecvGradient,    // the gradient of the forward's output from the next stage
};

struct Action {
  ActionKind kind;
  int microbatch;
  // Which of the stage's model chunks (interleaved schedules): chunk j of
  // stage s is virtual stage j·p + s of p·v. 0 without interleaving.
  int chunk = 0;

  bool operator==(const Action&) const = default;
  bool transfer() const {
    return kind != ActionKind::kForward && kind != ActionKind::kBackward && kind != ActionKind::kWeight;
  }
};

// "F3", "B0", "W0", "send act 2", "F3:1" (chunk 1), ...: for logs and test failures.
std::string describe(const Action& action);

// One-forward-one-backward (PipeDream-Flush, Megatron's default): stage s
// first runs min(p - s - 1, m) forwards, then alternates one forward and
// one backward, then drains the backwards. At most p - s microbatches'
// activations are alive on stage s at once, whatever m; the idle fraction
// of a stage is (p - 1) / (m + p - 1) when the stages take equal time.
// With one stage it is forward, backward, forward, ... with no transfers.
//
// With `chunks` = v > 1, interleaved 1F1B (Megatron's virtual pipeline):
// stage s holds v model chunks, chunk j being virtual stage j·p + s, so
// a microbatch passes every stage v times, the last stage handing it on
// to the first. Forwards go in groups of p microbatches through chunk 0,
// then chunk 1, ...; backwards through the chunks in reverse. The warmup
// grows to 2(p - s - 1) + (v - 1)p forwards, and the bubble shrinks by v:
// idle (p - 1) / (v·m + p - 1) with chunks of equal time. m must be a
// multiple of p.
std::vector<Action> one_f_one_b(int stages, int stage, int microbatches, int chunks = 1);

// Zero bubble, ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"):
// 1F1B's order and transfers, with each backward split into B, the input
// gradients alone, and W, the weight gradients, later. A gradient then
// crosses a stage in B's time instead of B + W's, and the W's run where
// 1F1B's stage would wait: before a forward when the stage would otherwise
// hold more than p passes (1F1B's first stage's peak, now every stage's
// bound), and before each cooldown backward's receive. A W runs while the
// exchange before it is in flight, so the receive in that exchange needs
// a slot of its own: stage 0 keeps min(p, m) slots, a later stage
// min(p + 1, m). With F = B = W a stage idles (p - 1) / (3m + p - 1), a
// third of 1F1B's (p - 1)(F + B + W) bubble.
std::vector<Action> zero_bubble_h1(int stages, int stage, int microbatches);

// Whether `actions` split their backwards into B and W (a pass's last
// compute is then its W, and the model keeps what W reads).
bool splits_backward(const std::vector<Action>& actions);

// Whether compute action `compute` must wait for `transfer`, posted before
// it and still in flight: a forward for the receive of its input and for
// every activation send (a pass whose last action is that send, as in
// forward_only, gives its slot back to the next forward), a backward for
// the receive of its output's gradient and for every gradient send (they
// all leave from the one input-gradient buffer the backward overwrites).
// Nothing else a compute touches is in flight: a slot's input is received
// only once the slot is free, and a weight pass reads what its backward
// kept. Any other compute runs while the exchange before it is in flight.
bool waits_for(const Action& compute, const Action& transfer);
// Whether it must wait for any of `transfers` (one exchange).
bool waits_for(const Action& compute, const std::vector<Action>& transfers);

// Forwards alone (validation, evaluation): each microbatch received, run
// and passed on, chunk by chunk in the order of one_f_one_b's forwards (any
// m >= 0: a last group of fewer than p microbatches goes through the
// chunks the same way, and none is no action).
std::vector<Action> forward_only(int stages, int stage, int microbatches, int chunks = 1);

// Which activation slot each microbatch's pass through a chunk of
// `actions` uses (Gpt keeps its activations in its slot from its forward,
// or the receive of its input, to its backward): slot[chunk·m + mb], and
// how many slots the stage needs, the most passes alive at once.
struct SlotPlan {
  int slots = 0;
  std::vector<int> slot;
  int of(const Action& a, int microbatches) const {
    return slot[static_cast<size_t>(a.chunk * microbatches + a.microbatch)];
  }
};
SlotPlan plan_slots(const std::vector<Action>& actions, int microbatches);

// How long each kind of action takes in simulate(): a transfer completes
// `transfer` after both sides have posted theirs.
struct ActionTimes {
  double forward = 1.0;
  double backward = 2.0;
  double weight = 1.0;
  double transfer = 0.0;
};

// What running every stage's actions gives as the stage executor runs
// them: each run of consecutive transfers is one exchange, posted after
// the compute before it once the stage's previous exchange is done; a
// transfer is done once both sides have posted theirs (Gloo's sends wait
// for their receive) and `times.transfer` has passed, the n-th message
// from one stage to another meeting the n-th receive there (as Gloo
// numbers them per pair of ranks); a compute waits for the exchange in
// flight only as waits_for() says.
struct PipelineRun {
  bool completed = false;       // false: some stage waits for ever (the schedules deadlock)
  std::string stuck;            // then, which stage waits on what
  double makespan = 0;          // when the last stage finishes
  std::vector<double> idle;     // per stage: the fraction of the makespan it computed nothing
  std::vector<int> peak_alive;  // per stage: the most passes forwarded and not yet done (B, or W if any)
};
PipelineRun simulate(const std::vector<std::vector<Action>>& stages, ActionTimes times = {});

}  // namespace keel::trainer
