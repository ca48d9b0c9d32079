#include "trainer/parallel/schedule.h"

#include "common/error.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <tuple>

namespace keel::trainer {

namespace {

const char* kind_name(ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward:
      return "F";
    case ActionKind::kBackward:
      return "B";
    case ActionKind::kWeight:
      return "W";
    case ActionKind::kSendActivation:
      return "send act ";
    case ActionKind::kRecvActivation:
      return "recv act ";
    case ActionKind::kSendGradient:
      return "send grad ";
    case ActionKind::kRecvGradient:
      return "recv grad ";
  }
  return "?";
}

}  // namespace

std::string describe(const Action& action) {
  const std::string chunk = action.chunk > 0 ? fmt::format(":{}", action.chunk) : "";
  return fmt::format("{}{}{}", kind_name(action.kind), action.microbatch, chunk);
}

namespace {

// Stage `stage` of `stages`, each with `chunks` model chunks, over
// `microbatches`: which pass its k-th forward and k-th backward run, and
// which of their transfers exist.
struct Passes {
  int p, s, v, m;

  Passes(int stages, int stage, int microbatches, int chunks) : p(stages), s(stage), v(chunks), m(microbatches) {
    if (p < 1 || s < 0 || s >= p || m < 1 || v < 1 || (v > 1 && p < 2)) {
      throw common::Error(common::ErrorCode::kInternal,
                          fmt::format("a schedule for stage {} of {} with {} chunks over {} microbatches", s, p, v, m));
    }
  }
  int count() const { return m * v; }
  // Megatron's order: microbatches in groups of p, each group through
  // chunk 0, then chunk 1, ...; a last group of fewer the same way.
  Action forward(int k) const {
    if (v == 1) return {ActionKind::kForward, k, 0};
    const int whole = m / p * p * v;
    if (k >= whole) {
      const int rest = m % p, within = k - whole;
      return {ActionKind::kForward, m / p * p + within % rest, within / rest};
    }
    const int group = k / (p * v), within = k % (p * v);
    return {ActionKind::kForward, group * p + within % p, within / p};
  }
  Action backward(int k) const {
    const Action f = forward(k);
    return {ActionKind::kBackward, f.microbatch, v - 1 - f.chunk};
  }
  // Virtual stage 0 takes the tokens and the last one the loss: they have
  // no input to receive and no output gradient to wait for.
  bool first(int chunk) const { return s == 0 && chunk == 0; }
  bool last(int chunk) const { return s == p - 1 && chunk == v - 1; }
  int warmup() const { return std::min(v == 1 ? p - s - 1 : 2 * (p - s - 1) + (v - 1) * p, count()); }
};

}  // namespace

std::vector<Action> one_f_one_b(int stages, int stage, int microbatches, int chunks) {
  const Passes passes(stages, stage, microbatches, chunks);
  if (chunks > 1 && microbatches % stages != 0) {
    throw common::Error(
        common::ErrorCode::kInternal,
        fmt::format("interleaved 1F1B over {} microbatches, not a multiple of {} stages", microbatches, stages));
  }
  std::vector<Action> actions;
  auto add = [&](ActionKind kind, const Action& pass) { actions.push_back({kind, pass.microbatch, pass.chunk}); };
  auto recv_activation = [&](int k) {
    if (const Action f = passes.forward(k); !passes.first(f.chunk)) add(ActionKind::kRecvActivation, f);
  };
  auto send_activation = [&](int k) {
    if (const Action f = passes.forward(k); !passes.last(f.chunk)) add(ActionKind::kSendActivation, f);
  };
  auto recv_gradient = [&](int k) {
    if (const Action b = passes.backward(k); !passes.last(b.chunk)) add(ActionKind::kRecvGradient, b);
  };
  auto send_gradient = [&](int k) {
    if (const Action b = passes.backward(k); !passes.first(b.chunk)) add(ActionKind::kSendGradient, b);
  };
  const int total = passes.count(), warmup = passes.warmup();
  int forward = 0, backward = 0;
  if (chunks > 1) {
    // Megatron's interleaved order with its overlapped transfers
    // (overlap_p2p_comm): a forward's output leaves as the next forward's
    // input comes in, a backward's gradient as the next backward's comes
    // in, each exchange in flight while the other pass computes. Transfers
    // paired with the computes as below would deadlock here, since a
    // stage's gradients and activations now travel to the same neighbour.
    recv_activation(0);
    for (; forward < warmup; ++forward) {
      actions.push_back(passes.forward(forward));
      send_activation(forward);
      if (forward + 1 < total) recv_activation(forward + 1);
      if (forward + 1 == warmup && warmup < total) recv_gradient(0);
    }
    for (; forward < total; ++forward, ++backward) {
      actions.push_back(passes.forward(forward));
      send_activation(forward);
      if (forward + 1 < total) recv_activation(forward + 1);
      actions.push_back(passes.backward(backward));
      send_gradient(backward);
      recv_gradient(backward + 1);
    }
    for (; backward < total; ++backward) {
      if (backward == 0) recv_gradient(0);
      actions.push_back(passes.backward(backward));
      send_gradient(backward);
      if (backward + 1 < total) recv_gradient(backward + 1);
    }
    return actions;
  }
  // Warmup: the forwards that fill the pipeline below this stage.
  for (; forward < warmup; ++forward) {
    recv_activation(forward);
    actions.push_back(passes.forward(forward));
    send_activation(forward);
  }
  // Steady state: each forward's output leaves as the oldest gradient
  // arrives, and each backward's gradient leaves as the next input arrives.
  if (forward < total) recv_activation(forward);
  for (; forward < total; ++forward, ++backward) {
    actions.push_back(passes.forward(forward));
    send_activation(forward);
    recv_gradient(backward);
    actions.push_back(passes.backward(backward));
    send_gradient(backward);
    if (forward + 1 < total) recv_activation(forward + 1);
  }
  // Cooldown: the backwards of the warmup forwards.
  for (; backward < total; ++backward) {
    recv_gradient(backward);
    actions.push_back(passes.backward(backward));
    send_gradient(backward);
  }
  return actions;
}

std::vector<Action> zero_bubble_h1(int stages, int stage, int microbatches) {
  // 1F1B's actions, each backward computing input gradients alone. A W
  // runs where the stage would otherwise hold more than p passes (1F1B's
  // first stage's peak), before a forward, and before each cooldown
  // backward's receive, while that gradient is on its way; the rest after
  // the last backward. The executor runs a W while the exchange before it
  // is in flight.
  const std::vector<Action> plain = one_f_one_b(stages, stage, microbatches);
  std::vector<Action> actions;
  int alive = 0, backwards = 0, weights = 0;
  const int cooldown_from = microbatches - Passes(stages, stage, microbatches, 1).warmup();
  auto weight = [&] {
    actions.push_back({ActionKind::kWeight, weights++, 0});
    --alive;
  };
  for (const Action& a : plain) {
    if (a.kind == ActionKind::kForward) {
      while (alive >= stages) weight();
      ++alive;
    }
    if (a.kind == ActionKind::kRecvGradient && a.microbatch >= cooldown_from && weights < backwards) weight();
    if (a.kind == ActionKind::kBackward) ++backwards;
    actions.push_back(a);
  }
  while (weights < microbatches) weight();
  return actions;
}

bool splits_backward(const std::vector<Action>& actions) {
  return std::any_of(actions.begin(), actions.end(), [](const Action& a) { return a.kind == ActionKind::kWeight; });
}

bool waits_for(const Action& compute, const Action& transfer) {
  const bool same_pass = compute.microbatch == transfer.microbatch && compute.chunk == transfer.chunk;
  switch (compute.kind) {
    case ActionKind::kForward:
      return (transfer.kind == ActionKind::kRecvActivation && same_pass) ||
             transfer.kind == ActionKind::kSendActivation;
    case ActionKind::kBackward:
      return (transfer.kind == ActionKind::kRecvGradient && same_pass) || transfer.kind == ActionKind::kSendGradient;
    default:
      return false;
  }
}

bool waits_for(const Action& compute, const std::vector<Action>& transfers) {
  return std::any_of(transfers.begin(), transfers.end(),
                     [&](const Action& transfer) { return waits_for(compute, transfer); });
}

std::vector<Action> forward_only(int stages, int stage, int microbatches, int chunks) {
  // A DP rank left no windows of an evaluation runs nothing.
  if (microbatches == 0) return {};
  const Passes passes(stages, stage, microbatches, chunks);
  std::vector<Action> actions;
  for (int k = 0; k < passes.count(); ++k) {
    const Action f = passes.forward(k);
    if (!passes.first(f.chunk)) actions.push_back({ActionKind::kRecvActivation, f.microbatch, f.chunk});
    actions.push_back(f);
    if (!passes.last(f.chunk)) actions.push_back({ActionKind::kSendActivation, f.microbatch, f.chunk});
  }
  return actions;
}

SlotPlan plan_slots(const std::vector<Action>& actions, int microbatches) {
  int chunks = 1;
  for (const Action& a : actions) chunks = std::max(chunks, a.chunk + 1);
  const size_t passes = static_cast<size_t>(microbatches * chunks);
  SlotPlan plan{0, std::vector<int>(passes, -1)};
  auto pass = [microbatches](const Action& a) { return static_cast<size_t>(a.chunk * microbatches + a.microbatch); };
  // A slot is taken by a pass's first action and given back after its
  // last. A transfer posted in the same exchange as that last action may
  // take it again: slots hold a stage's input and activations, while what
  // leaves (the last block's output, the input's gradient) is read from
  // the slot's last block or from scratch before anything is received.
  std::vector<size_t> last(passes, 0);
  for (size_t i = 0; i < actions.size(); ++i) last.at(pass(actions[i])) = i;
  std::vector<int> free;
  for (size_t i = 0; i < actions.size(); ++i) {
    int& slot = plan.slot[pass(actions[i])];
    if (slot < 0) {
      if (free.empty()) free.push_back(plan.slots++);
      slot = free.back();
      free.pop_back();
    }
    if (last[pass(actions[i])] == i) free.push_back(slot);
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

// A transfer as the pair of stages it connects (sender, receiver), which
// side of it this stage is, and what it carries: an activation or a
// gradient of microbatch mb across the boundary after virtual stage
// `boundary`. Both sides of one message agree on all of it.
struct Message {
  std::pair<int, int> channel;
  bool sender;
  std::tuple<bool, int, int> what;  // (gradient, mb, boundary)
};

Message message_of(int p, int stage, const Action& a) {
  const int virtual_stage = a.chunk * p + stage, next = (stage + 1) % p, prev = (stage + p - 1) % p;
  switch (a.kind) {
    case ActionKind::kSendActivation:
      return {{stage, next}, true, {false, a.microbatch, virtual_stage}};
    case ActionKind::kRecvActivation:
      return {{prev, stage}, false, {false, a.microbatch, virtual_stage - 1}};
    case ActionKind::kSendGradient:
      return {{stage, prev}, true, {true, a.microbatch, virtual_stage - 1}};
    case ActionKind::kRecvGradient:
      return {{next, stage}, false, {true, a.microbatch, virtual_stage}};
    default: break;
  }
  throw common::Error(common::ErrorCode::kInternal, "a compute action has no channel");
}

}  // namespace

PipelineRun simulate(const std::vector<std::vector<Action>>& stages, ActionTimes times) {
  const int p = static_cast<int>(stages.size());
  std::vector<std::vector<Step>> steps;
  std::vector<bool> deferred;  // whether a stage's passes end with W instead of B
  for (const auto& actions : stages) {
    steps.push_back(steps_of(actions));
    deferred.push_back(splits_backward(actions));
  }
  std::vector<size_t> next(p, 0);
  std::vector<double> clock(p, 0.0), busy(p, 0.0);
  std::vector<int> alive(p, 0);
  PipelineRun run;
  run.peak_alive.assign(p, 0);
  // Per channel, the post time and content of each send and receive, in
  // the order they were posted: the n-th send pairs with the n-th receive.
  struct Posted {
    double time;
    std::tuple<bool, int, int> what;
  };
  std::map<std::pair<int, int>, std::vector<Posted>> sends, receives;
  // The exchange each stage has posted and not yet waited for (-1: none),
  // when it posted it, and the index in its channel of each of its
  // transfers. A stage waits for it before its next exchange, and before a
  // compute that waits_for() one of its transfers.
  std::vector<int> open(p, -1);
  std::vector<double> posted_at(p, 0.0);
  std::vector<std::vector<size_t>> slots(p);
  auto needs_open = [&](int s, const Action& compute) {
    return open[s] >= 0 && waits_for(compute, steps[s][static_cast<size_t>(open[s])].actions);
  };
  // Resolves stage s's open exchange: false while a partner is not posted.
  auto wait_open = [&](int s) {
    if (open[s] < 0) return true;
    const Step& step = steps[s][static_cast<size_t>(open[s])];
    double done = clock[s];
    for (size_t i = 0; i < step.actions.size(); ++i) {
      const Message message = message_of(p, s, step.actions[i]);
      const auto& theirs = message.sender ? receives[message.channel] : sends[message.channel];
      if (theirs.size() <= slots[s][i]) return false;
      const Posted& partner = theirs[slots[s][i]];
      if (partner.what != message.what) {
        const auto [gradient, mb, boundary] = partner.what;
        run.stuck = fmt::format("stage {} has {} where its peer has the {} of microbatch {} after virtual stage {}", s,
                                describe(step.actions[i]), gradient ? "gradient" : "activation", mb, boundary);
        return false;
      }
      done = std::max(done, std::max(posted_at[s], partner.time) + times.transfer);
    }
    clock[s] = done;
    open[s] = -1;
    return true;
  };

  for (bool progress = true; progress && run.stuck.empty();) {
    progress = false;
    for (int s = 0; s < p && run.stuck.empty(); ++s) {
      while (next[s] <= steps[s].size()) {
        const bool end = next[s] == steps[s].size();
        const bool waits = end || !steps[s][next[s]].compute() || needs_open(s, steps[s][next[s]].actions.front());
        if (waits && !wait_open(s)) break;
        if (end) break;
        const Step& step = steps[s][next[s]];
        ++next[s];
        progress = true;
        if (!step.compute()) {
          slots[s].clear();
          for (const Action& a : step.actions) {
            const Message message = message_of(p, s, a);
            auto& mine = message.sender ? sends[message.channel] : receives[message.channel];
            slots[s].push_back(mine.size());
            mine.push_back({clock[s], message.what});
          }
          open[s] = static_cast<int>(next[s] - 1);
          posted_at[s] = clock[s];
          continue;
        }
        const Action& a = step.actions.front();
        const double t = a.kind == ActionKind::kForward    ? times.forward
                         : a.kind == ActionKind::kBackward ? times.backward
                                                           : times.weight;
        clock[s] += t;
        busy[s] += t;
        if (a.kind == ActionKind::kForward) ++alive[s];
        if (a.kind == (deferred[s] ? ActionKind::kWeight : ActionKind::kBackward)) --alive[s];
        run.peak_alive[s] = std::max(run.peak_alive[s], alive[s]);
      }
    }
  }
  if (!run.stuck.empty()) return run;
  for (int s = 0; s < p; ++s) {
    if (next[s] < steps[s].size() || open[s] >= 0) {
      const auto& waiting = steps[s][static_cast<size_t>(open[s] >= 0 ? open[s] : static_cast<int>(next[s]))].actions;
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
