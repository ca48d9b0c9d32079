#include "trainer/train/stage_executor.h"

#include "common/error.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

namespace keel::trainer {

StageTime run_stage(const std::vector<Action>& actions, int microbatches, Gpt& model, Communicator* pp,
                    const StageWork& work) {
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  const auto start = Clock::now();
  StageTime time;
  auto timed = [&](const std::function<void(int, int, int)>& compute, const Action& pass, int slot) {
    const auto begin = Clock::now();
    compute(pass.microbatch, pass.chunk, slot);
    time.compute_s += seconds(Clock::now() - begin);
  };
  const SlotPlan plan = plan_slots(actions, microbatches);
  if (plan.slots > model.slots()) {
    throw common::Error(
        common::ErrorCode::kInternal,
        fmt::format("the schedule keeps {} microbatches alive but the model has {} slots", plan.slots, model.slots()));
  }
  const int stage = model.stage().index, stages = model.stage().count;
  const int next = (stage + 1) % stages, previous = (stage + stages - 1) % stages;
  const bool split = splits_backward(actions);
  int alive = 0;
  std::vector<Communicator::Send> sends;
  std::vector<Communicator::Recv> recvs;
  CommWork in_flight;
  auto check_group = [&] {
    if (pp == nullptr) throw common::Error(common::ErrorCode::kInternal, "a pipeline transfer without a PP group");
  };
  // The transfers gathered so far as one exchange: started and left in
  // flight before a weight pass, done at once before anything else (on
  // this thread, as fast as a transfer gets).
  auto start_transfers = [&] {
    if (sends.empty() && recvs.empty()) return;
    check_group();
    in_flight.wait();
    in_flight = pp->start_exchange(std::move(sends), std::move(recvs));
    sends.clear();
    recvs.clear();
  };
  auto settle = [&] {
    in_flight.wait();
    if (sends.empty() && recvs.empty()) return;
    check_group();
    pp->exchange(std::move(sends), std::move(recvs));
    sends.clear();
    recvs.clear();
  };
  for (const Action& action : actions) {
    const int mb = action.microbatch, slot = plan.of(action, microbatches);
    const size_t count = model.boundary_numel(work.batch(mb));
    switch (action.kind) {
      case ActionKind::kForward:
        settle();
        timed(work.forward, action, slot);
        time.peak_alive = std::max(time.peak_alive, ++alive);
        break;
      case ActionKind::kBackward:
        settle();
        timed(work.backward, action, slot);
        if (!split) --alive;
        break;
      case ActionKind::kWeight:
        start_transfers();
        timed(work.weight, action, slot);
        --alive;
        break;
      case ActionKind::kSendActivation:
        sends.push_back({model.stage_output(slot), count, next});
        break;
      case ActionKind::kRecvActivation:
        recvs.push_back({model.stage_input(slot), count, previous});
        break;
      case ActionKind::kSendGradient:
        sends.push_back({model.input_gradient(), count, previous});
        break;
      case ActionKind::kRecvGradient:
        recvs.push_back({model.output_gradient(slot), count, next});
        break;
    }
  }
  settle();
  time.total_s = seconds(Clock::now() - start);
  return time;
}

}  // namespace keel::trainer
