#include "trainer/parallel/schedule.h"

#include "common/error.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <tuple>

namespace keel::trainer {

std::string describe(const Action& action) {
  switch (action.kind) {
    case ActionKind::kForward: return fmt::format("F{}", action.microbatch);
    case ActionKind::kBackward: return fmt::format("B{}", action.microbatch);
    case ActionKind::kSendActivation: return fmt::format("send act {}", action.microbatch);
    case ActionKind::kRecvActivation: return fmt::format("recv act {}", action.microbatch);
    case ActionKind::kSendGradient: return fmt::format("send grad {}", action.microbatch);
    case ActionKind::kRecvGradient: return fmt::format("recv grad {}", action.microbatch);
  }
  return "?";
}

std::vector<Action> one_f_one_b(int stages, int stage, int microbatches) {
  if (stages < 1 || stage < 0 || stage >= stages || microbatches < 1) {
    throw common::Error(common::ErrorCode::kInternal,
                        fmt::format("1F1B for stage {} of {} over {} microbatches", stage, stages, microbatches));
  }
  const bool first = stage == 0, last = stage == stages - 1;
  std::vector<Action> actions;
  auto add = [&](ActionKind kind, int mb) { actions.push_back({kind, mb}); };
  auto recv_activation = [&](int mb) {
    if (!first) add(ActionKind::kRecvActivation, mb);
  };
  auto send_activation = [&](int mb) {
    if (!last) add(ActionKind::kSendActivation, mb);
  };
  auto recv_gradient = [&](int mb) {
    if (!last) add(ActionKind::kRecvGradient, mb);
  };
  auto send_gradient = [&](int mb) {
    if (!first) add(ActionKind::kSendGradient, mb);
  };
  // Warmup: the forwards that fill the pipeline below this stage.
  const int warmup = std::min(stages - stage - 1, microbatches);
  int forward = 0, backward = 0;
  for (; forward < warmup; ++forward) {
    recv_activation(forward);
    add(ActionKind::kForward, forward);
    send_activation(forward);
  }
  // Steady state: each forward's output leaves as the oldest gradient
  // arrives, and each backward's gradient leaves as the next input arrives.
  if (forward < microbatches) recv_activation(forward);
  for (; forward < microbatches; ++forward, ++backward) {
    add(ActionKind::kForward, forward);
    send_activation(forward);
    recv_gradient(backward);
    add(ActionKind::kBackward, backward);
    send_gradient(backward);
    if (forward + 1 < microbatches) recv_activation(forward + 1);
  }
  // Cooldown: the backwards of the warmup forwards.
  for (; backward < microbatches; ++backward) {
    recv_gradient(backward);
    add(ActionKind::kBackward, backward);
    send_gradient(backward);
  }
  return actions;
}

std::vector<Action> forward_only(int stages, int stage, int microbatches) {
  std::vector<Action> actions;
  for (int mb = 0; mb < microbatches; ++mb) {
    if (stage > 0) actions.push_back({ActionKind::kRecvActivation, mb});
    actions.push_back({ActionKind::kForward, mb});
    if (stage < stages - 1) actions.push_back({ActionKind::kSendActivation, mb});
  }
  return actions;
}

SlotPlan plan_slots(const std::vector<Action>& actions, int microbatches) {
  SlotPlan plan{0, std::vector<int>(static_cast<size_t>(microbatches), -1)};
  // A slot is taken by a microbatch's first action and given back after
  // its last. A transfer posted in the same exchange as that last action
  // may take it again: slots hold a stage's input and activations, while
  // what leaves (the last block's output, the input's gradient) is read
  // from the slot's last block or from scratch before anything is received.
  std::vector<size_t> last(static_cast<size_t>(microbatches), 0);
  for (size_t i = 0; i < actions.size(); ++i) last.at(static_cast<size_t>(actions[i].microbatch)) = i;
  std::vector<int> free;
  for (size_t i = 0; i < actions.size(); ++i) {
    int& slot = plan.slot[static_cast<size_t>(actions[i].microbatch)];
    if (slot < 0) {
      if (free.empty()) free.push_back(plan.slots++);
      slot = free.back();
      free.pop_back();
    }
    if (last[static_cast<size_t>(actions[i].microbatch)] == i) free.push_back(slot);
  }
  return plan;
}

namespace {

// A stage's actions as steps: one compute action, or the transfers that
// follow each other (one exchange).
struct Step {
  std::vector<Action> actions;
  bool compute() const { return !actions.front().transfer(); }
};

std::vector<Step> steps_of(const std::vector<Action>& actions) {
  std::vector<Step> steps;
  for (const Action& a : actions) {
    if (a.transfer() && !steps.empty() && !steps.back().compute()) {
      steps.back().actions.push_back(a);
    } else {
      steps.push_back({{a}});
    }
  }
  return steps;
}

// Which directed channel a transfer uses: (sender, receiver, carries
// gradients), and which side of it this stage is.
struct Channel {
  std::tuple<int, int, bool> key;
  bool sender;
};

Channel channel_of(int stage, const Action& a) {
  switch (a.kind) {
    case ActionKind::kSendActivation: return {{stage, stage + 1, false}, true};
    case ActionKind::kRecvActivation: return {{stage - 1, stage, false}, false};
    case ActionKind::kSendGradient: return {{stage, stage - 1, true}, true};
    case ActionKind::kRecvGradient: return {{stage + 1, stage, true}, false};
    default: break;
  }
  throw common::Error(common::ErrorCode::kInternal, "a compute action has no channel");
}

}  // namespace

PipelineRun simulate(const std::vector<std::vector<Action>>& stages, double forward_time, double backward_time) {
  const int p = static_cast<int>(stages.size());
  std::vector<std::vector<Step>> steps;
  for (const auto& actions : stages) steps.push_back(steps_of(actions));
  std::vector<size_t> next(p, 0);
  std::vector<double> clock(p, 0.0), busy(p, 0.0);
  std::vector<int> alive(p, 0);
  PipelineRun run;
  run.peak_alive.assign(p, 0);
  // Per channel, the post time and microbatch of each send and receive, in
  // the order they were posted: the n-th send pairs with the n-th receive.
  struct Posted {
    double time;
    int microbatch;
  };
  std::map<std::tuple<int, int, bool>, std::vector<Posted>> sends, receives;
  std::vector<bool> posted(p, false);  // whether stage s has posted its current exchange
  std::vector<std::vector<size_t>> slots(p);  // the index in its channel of each transfer of that exchange

  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < p; ++s) {
      while (next[s] < steps[s].size()) {
        const Step& step = steps[s][next[s]];
        if (step.compute()) {
          const Action& a = step.actions.front();
          const double t = a.kind == ActionKind::kForward ? forward_time : backward_time;
          clock[s] += t;
          busy[s] += t;
          alive[s] += a.kind == ActionKind::kForward ? 1 : -1;
          run.peak_alive[s] = std::max(run.peak_alive[s], alive[s]);
          ++next[s];
          progress = true;
          continue;
        }
        if (!posted[s]) {
          slots[s].clear();
          for (const Action& a : step.actions) {
            const Channel c = channel_of(s, a);
            auto& mine = c.sender ? sends[c.key] : receives[c.key];
            slots[s].push_back(mine.size());
            mine.push_back({clock[s], a.microbatch});
          }
          posted[s] = true;
          progress = true;
        }
        // Done once every partner has been posted.
        double done = clock[s];
        bool ready = true;
        for (size_t i = 0; i < step.actions.size(); ++i) {
          const Channel c = channel_of(s, step.actions[i]);
          const auto& theirs = c.sender ? receives[c.key] : sends[c.key];
          if (theirs.size() <= slots[s][i]) {
            ready = false;
            break;
          }
          const Posted& partner = theirs[slots[s][i]];
          if (partner.microbatch != step.actions[i].microbatch) {
            run.stuck = fmt::format("stage {} has {} where its peer has microbatch {}", s,
                                    describe(step.actions[i]), partner.microbatch);
            return run;
          }
          done = std::max(done, partner.time);
        }
        if (!ready) break;
        clock[s] = done;
        posted[s] = false;
        ++next[s];
        progress = true;
      }
    }
  }
  for (int s = 0; s < p; ++s) {
    if (next[s] < steps[s].size()) {
      const auto& waiting = steps[s][next[s]].actions;
      std::vector<std::string> names;
      for (const Action& a : waiting) names.push_back(describe(a));
      run.stuck = fmt::format("stage {} waits in [{}]", s, fmt::join(names, ", "));
      return run;
    }
  }
  run.completed = true;
  run.makespan = *std::max_element(clock.begin(), clock.end());
  for (int s = 0; s < p; ++s) run.idle.push_back(run.makespan > 0 ? 1.0 - busy[s] / run.makespan : 0.0);
  return run;
}

}  // namespace keel::trainer
