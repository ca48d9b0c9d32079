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
  std::vector<Action> gathered;  // the transfers of sends and recvs, in order
  CommWork in_flight;
  std::vector<Action> in_flight_transfers;
  // The transfers gathered so far as one exchange, issued once the compute
  // before them is done and the exchange before them has completed (a
  // group's transfers pair up in the order they are issued). One the next
  // compute `then` waits for runs here, on this thread, as fast as a
  // transfer gets; the others are left in flight while it computes.
  auto issue_transfers = [&](const Action* then) {
    if (gathered.empty()) return;
    if (pp == nullptr) throw common::Error(common::ErrorCode::kInternal, "a pipeline transfer without a PP group");
    in_flight.wait();
    in_flight_transfers.clear();
    if (then == nullptr || waits_for(*then, gathered)) {
      pp->exchange(std::move(sends), std::move(recvs));
    } else {
      in_flight = pp->start_exchange(std::move(sends), std::move(recvs));
      in_flight_transfers = std::move(gathered);
    }
    sends.clear();
    recvs.clear();
    gathered.clear();
  };
  auto compute = [&](const std::function<void(int, int, int)>& pass, const Action& action, int slot) {
    issue_transfers(&action);
    if (waits_for(action, in_flight_transfers)) in_flight.wait();
    timed(pass, action, slot);
  };
  for (const Action& action : actions) {
    const int mb = action.microbatch, slot = plan.of(action, microbatches);
    const size_t count = model.boundary_numel(work.batch(mb));
    if (action.transfer()) gathered.push_back(action);
    switch (action.kind) {
      case ActionKind::kForward:
        compute(work.forward, action, slot);
        time.peak_alive = std::max(time.peak_alive, ++alive);
        break;
      case ActionKind::kBackward:
        compute(work.backward, action, slot);
        if (!split) --alive;
        break;
      case ActionKind::kWeight:
        compute(work.weight, action, slot);
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
  issue_transfers(nullptr);
  in_flight.wait();
  time.total_s = seconds(Clock::now() - start);
  return time;
}

}  // namespace keel::trainer
