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
  kBackward,        // and back, freeing its activations
  kSendActivation,  // the forward's output to the next stage
  kRecvActivation,  // the previous stage's output, the input of a forward
  kSendGradient,    // the gradient of the forward's input to the previous stage
  kRecvGradient,    // the gradient of the forward's output from the next stage
};

struct Action {
  ActionKind kind;
  int microbatch;

  bool operator==(const Action&) const = default;
  bool transfer() const { return kind != ActionKind::kForward && kind != ActionKind::kBackward; }
};

// "F3", "B0", "send act 2", ...: for logs and test failures.
std::string describe(const Action& action);

// One-forward-one-backward (PipeDream-Flush, Megatron's default): stage s
// first runs min(p - s - 1, m) forwards, then alternates one forward and
// one backward, then drains the backwards. At most p - s microbatches'
// activations are alive on stage s at once, whatever m; the idle fraction
// of a stage is (p - 1) / (m + p - 1) when the stages take equal time.
// With one stage it is forward, backward, forward, ... with no transfers.
std::vector<Action> one_f_one_b(int stages, int stage, int microbatches);

// Forwards alone (validation): each microbatch received, run and passed on.
std::vector<Action> forward_only(int stages, int stage, int microbatches);

// Which activation slot each microbatch of `actions` uses (Gpt keeps a
// microbatch's activations in its slot from its forward, or the receive of
// its input, to its backward): slot[mb], and how many slots the stage
// needs, the most microbatches alive at once.
struct SlotPlan {
  int slots = 0;
  std::vector<int> slot;
};
SlotPlan plan_slots(const std::vector<Action>& actions, int microbatches);

// What running every stage's actions gives, transfers taking no time and a
// transfer done once both sides have posted theirs (Gloo's sends wait for
// their receive). Forward takes `forward_time`, backward `backward_time`.
struct PipelineRun {
  bool completed = false;       // false: some stage waits for ever (the schedules deadlock)
  std::string stuck;            // then, which stage waits on what
  double makespan = 0;          // when the last stage finishes
  std::vector<double> idle;     // per stage: the fraction of the makespan it computed nothing
  std::vector<int> peak_alive;  // per stage: the most microbatches forwarded and not yet backwarded
};
PipelineRun simulate(const std::vector<std::vector<Action>>& stages, double forward_time = 1.0,
                     double backward_time = 2.0);

}  // namespace keel::trainer
