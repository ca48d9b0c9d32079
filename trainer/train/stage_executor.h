// Runs one pipeline stage's schedule (trainer/parallel/schedule.h) on this
// rank's model stage (docs/architecture.md "Pipeline schedules"): compute
// actions call back into the training loop, which feeds the model its
// tokens; each run of consecutive transfers is one exchange with the
// neighbouring stages over the PP group, posted together and done
// together, once the exchange before it is done. The next compute runs
// while the exchange is in flight unless it must wait for one of its
// transfers (waits_for: a forward for its input, a backward for its
// output's gradient): so an interleaved stage's activations travel while
// it runs a backward, and a weight pass (zero-bubble schedules) runs while
// the gradients travel. With one stage the schedule holds no transfers and
// this is gradient accumulation.
#pragma once

#include "trainer/comm/communicator.h"
#include "trainer/model/gpt.h"
#include "trainer/parallel/schedule.h"

#include <algorithm>
#include <functional>
#include <vector>

namespace keel::trainer {

struct StageWork {
  // Sequences in microbatch mb: every stage knows it without being told,
  // so that the transfers' counts agree.
  std::function<int(int mb)> batch;
  // Runs the model's forward (or backward) of mb through the stage's
  // model chunk `chunk` in activation slot `slot`.
  std::function<void(int mb, int chunk, int slot)> forward;
  std::function<void(int mb, int chunk, int slot)> backward;
  // The weight gradients of that backward (ActionKind::kWeight), when the
  // schedule splits them off.
  std::function<void(int mb, int chunk, int slot)> weight;
};

// Where a stage's time went: computing (its forwards and backwards, data
// included) or waiting for and moving what the other stages send. The
// difference is the pipeline bubble plus the transfers. And the most
// microbatches it held activations for at once, what its memory grows with
// (1F1B: min(p - s, m) on stage s; all forwards first would hold m), from
// a pass's forward to its backward, or to its weight pass if it has one.
struct StageTime {
  double compute_s = 0;
  double total_s = 0;
  int peak_alive = 0;
  StageTime& operator+=(const StageTime& other) {
    compute_s += other.compute_s;
    total_s += other.total_s;
    peak_alive = std::max(peak_alive, other.peak_alive);
    return *this;
  }
};

// `pp` is the PP group (nullptr with one stage), in which stage s is rank
// s (an interleaved schedule's last stage hands on to stage 0); `model`
// must have at least plan_slots(actions).slots slots. Throws
// what the communicator throws (a peer failure, a hang).
StageTime run_stage(const std::vector<Action>& actions, int microbatches, Gpt& model, Communicator* pp,
                    const StageWork& work);

}  // namespace keel::trainer
