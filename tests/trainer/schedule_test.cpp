// Pipeline schedules (trainer/parallel/schedule.h), held to what they
// promise by running every stage's actions in the simulator: no deadlock
// under rendezvous transfers, each microbatch forwarded and backwarded once
// per stage, the activation memory bound and the bubble formula.
#include "trainer/parallel/schedule.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace {

using keel::trainer::Action;
using keel::trainer::ActionKind;
using keel::trainer::ActionTimes;
using keel::trainer::forward_only;
using keel::trainer::one_f_one_b;
using keel::trainer::plan_slots;
using keel::trainer::simulate;
using keel::trainer::zero_bubble_h1;

// Every stage's 1F1B, or forward_only, schedule.
std::vector<std::vector<Action>> all_stages(int stages, int microbatches, int chunks = 1, bool forwards = false) {
  std::vector<std::vector<Action>> out;
  for (int s = 0; s < stages; ++s) {
    out.push_back(forwards ? forward_only(stages, s, microbatches, chunks)
                           : one_f_one_b(stages, s, microbatches, chunks));
  }
  return out;
}

// Requires each microbatch of `m` to pass through each of `kinds` once, in
// microbatch order, and each kind after the one before it in `kinds`
// (a backward only of a microbatch forwarded, a W only of one backwarded).
void check_each_pass_once(const std::vector<Action>& actions, int m, const std::vector<ActionKind>& kinds) {
  std::vector<std::vector<int>> seen(kinds.size());
  for (const Action& a : actions) {
    for (size_t k = 0; k < kinds.size(); ++k) {
      if (a.kind != kinds[k]) continue;
      if (k > 0) CHECK(a.microbatch < static_cast<int>(seen[k - 1].size()));
      seen[k].push_back(a.microbatch);
    }
  }
  std::vector<int> in_order(static_cast<size_t>(m));
  for (int i = 0; i < m; ++i) in_order[static_cast<size_t>(i)] = i;
  for (const auto& microbatches : seen) CHECK(microbatches == in_order);
}

std::string listing(const std::vector<Action>& actions) {
  std::string out;
  for (const Action& a : actions) out += describe(a) + "; ";
  return out;
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("1F1B on one stage is forward then backward for each microbatch with no transfers") {
    const std::vector<Action> want = {{ActionKind::kForward, 0}, {ActionKind::kBackward, 0},
                                      {ActionKind::kForward, 1}, {ActionKind::kBackward, 1},
                                      {ActionKind::kForward, 2}, {ActionKind::kBackward, 2}};
    CHECK(one_f_one_b(1, 0, 3) == want);
  }

  TEST_CASE("1F1B pairs each forward output with the oldest gradient and each gradient with the next input") {
    // Stage 1 of 4 over 4 microbatches: two warmup forwards, then steady state.
    const auto got = listing(one_f_one_b(4, 1, 4));
    CHECK(got ==
          "recv act 0; F0; send act 0; recv act 1; F1; send act 1; recv act 2; "
          "F2; send act 2; recv grad 0; B0; send grad 0; recv act 3; "
          "F3; send act 3; recv grad 1; B1; send grad 1; "
          "recv grad 2; B2; send grad 2; recv grad 3; B3; send grad 3; ");
  }

  TEST_CASE("every stage of 1F1B forwards and then backwards each microbatch once and in order") {
    for (int p = 1; p <= 6; ++p) {
      for (int m = 1; m <= 10; ++m) {
        for (int s = 0; s < p; ++s) {
          CAPTURE(p);
          CAPTURE(m);
          CAPTURE(s);
          check_each_pass_once(one_f_one_b(p, s, m), m, {ActionKind::kForward, ActionKind::kBackward});
        }
      }
    }
  }

  TEST_CASE("1F1B never deadlocks keeps at most p - s microbatches alive and idles (p - 1) / (m + p - 1)") {
    for (int p = 1; p <= 6; ++p) {
      for (int m = 1; m <= 12; ++m) {
        CAPTURE(p);
        CAPTURE(m);
        const auto run = simulate(all_stages(p, m));
        REQUIRE_MESSAGE(run.completed, run.stuck);
        // Forward 1 and backward 2 time units: every stage computes 3m of
        // a makespan of 3(m + p - 1).
        CHECK(run.makespan == doctest::Approx(3.0 * (m + p - 1)));
        for (int s = 0; s < p; ++s) {
          CAPTURE(s);
          CHECK(run.peak_alive[static_cast<size_t>(s)] == std::min(p - s, m));
          CHECK(run.idle[static_cast<size_t>(s)] == doctest::Approx(static_cast<double>(p - 1) / (m + p - 1)));
        }
      }
    }
  }

  TEST_CASE("activation slots are never shared by two live microbatches and 1F1B needs the lesser of p - s and m of them") {
    for (int p = 1; p <= 6; ++p) {
      for (int m = p; m <= 12; ++m) {
        for (int s = 0; s < p; ++s) {
          CAPTURE(p);
          CAPTURE(m);
          CAPTURE(s);
          const auto actions = one_f_one_b(p, s, m);
          const auto plan = plan_slots(actions, m);
          CHECK(plan.slots == std::min(p - s, m));
          // A microbatch holds its slot from its first action to its last;
          // the next holder may take it only after that.
          std::vector<int> holder(static_cast<size_t>(plan.slots), -1);
          std::vector<size_t> last(static_cast<size_t>(m), 0);
          for (size_t i = 0; i < actions.size(); ++i) last[static_cast<size_t>(actions[i].microbatch)] = i;
          for (size_t i = 0; i < actions.size(); ++i) {
            const int mb = actions[i].microbatch, slot = plan.slot[static_cast<size_t>(mb)];
            REQUIRE(slot >= 0);
            REQUIRE(slot < plan.slots);
            int& owner = holder[static_cast<size_t>(slot)];
            CHECK((owner == -1 || owner == mb));
            owner = mb;
            if (last[static_cast<size_t>(mb)] == i) owner = -1;
          }
        }
        CHECK(plan_slots(forward_only(p, p - 1, m), m).slots == 1);
      }
    }
  }

  TEST_CASE(
      "interleaved 1F1B never deadlocks runs every pass once idles (p - 1) / (v m + p - 1) and holds its warmup") {
    for (int p = 2; p <= 5; ++p) {
      for (int v = 2; v <= 4; ++v) {
        for (int m = p; m <= 3 * p; m += p) {
          CAPTURE(p);
          CAPTURE(v);
          CAPTURE(m);
          const auto stages = all_stages(p, m, v);
          const auto run = simulate(stages);
          REQUIRE_MESSAGE(run.completed, run.stuck);
          for (int s = 0; s < p; ++s) {
            CAPTURE(s);
            std::vector<int> forwards(static_cast<size_t>(m * v), 0), backwards(static_cast<size_t>(m * v), 0);
            for (const Action& a : stages[static_cast<size_t>(s)]) {
              if (a.kind == ActionKind::kForward) ++forwards[static_cast<size_t>(a.chunk * m + a.microbatch)];
              if (a.kind == ActionKind::kBackward) ++backwards[static_cast<size_t>(a.chunk * m + a.microbatch)];
            }
            CHECK(std::count(forwards.begin(), forwards.end(), 1) == m * v);
            CHECK(std::count(backwards.begin(), backwards.end(), 1) == m * v);
            // Chunks of equal time: the bubble is 1F1B's divided by v.
            CHECK(run.idle[static_cast<size_t>(s)] == doctest::Approx(static_cast<double>(p - 1) / (v * m + p - 1)));
            // What it costs: each stage holds its warmup's passes (each 1/v
            // of the stage's activations) plus one.
            const int peak = std::min(2 * (p - s - 1) + (v - 1) * p + 1, m * v);
            CHECK(run.peak_alive[static_cast<size_t>(s)] == peak);
            // And one slot more: the next forward's input arrives while the
            // backward before it still holds its pass.
            CHECK(plan_slots(stages[static_cast<size_t>(s)], m).slots == std::min(peak + 1, m * v));
          }
          for (const int forwards : {m, m - 1}) CHECK(simulate(all_stages(p, forwards, v, true)).completed);
          CHECK(forward_only(p, 0, 0, v).empty());
        }
      }
    }
  }

  TEST_CASE(
      "interleaved 1F1B hands the last stage's output to the first stage's next chunk and batches each step's "
      "transfers") {
    // Stage 0 of 2 with 2 chunks over 2 microbatches: chunk 0 embeds, chunk
    // 1 takes what stage 1's chunk 0 sends back round.
    const auto got = listing(one_f_one_b(2, 0, 2, 2));
    CHECK(got ==
          "F0; send act 0; F1; send act 1; recv act 0:1; F0:1; send act 0:1; recv act 1:1; F1:1; send act 1:1; "
          "recv grad 0:1; B0:1; send grad 0:1; recv grad 1:1; B1:1; send grad 1:1; recv grad 0; B0; recv grad 1; B1; ");
  }

  TEST_CASE("interleaved 1F1B sends each output on while the stage runs a backward") {
    // Stage 1 of 2 with 2 chunks over 4 microbatches: in the steady state
    // an activation leaves in its own exchange after its forward, and a
    // gradient after its backward, each with the next pass's input.
    const auto got = listing(one_f_one_b(2, 1, 4, 2));
    CHECK(got ==
          "recv act 0; F0; send act 0; recv act 1; F1; send act 1; recv act 0:1; F0:1; recv act 1:1; B0:1; "
          "send grad 0:1; F1:1; recv act 2; B1:1; send grad 1:1; recv grad 0; F2; send act 2; recv act 3; B0; "
          "send grad 0; recv grad 1; F3; send act 3; recv act 2:1; B1; send grad 1; F2:1; recv act 3:1; B2:1; "
          "send grad 2:1; F3:1; B3:1; send grad 3:1; recv grad 2; B2; send grad 2; recv grad 3; B3; send grad 3; ");
  }

  TEST_CASE("interleaved 1F1B hides its steady state's transfers behind compute so they cost the same for any m") {
    // Transfers that take a tenth of a forward lengthen the step only where
    // the pipeline fills and drains: the same for every m that has a
    // steady state (m >= 2p here). With each
    // stage's transfers done before its next pass, as in plain 1F1B's
    // lockstep, every microbatch would pay them.
    for (int p = 2; p <= 4; ++p) {
      for (int v = 2; v <= 3; ++v) {
        CAPTURE(p);
        CAPTURE(v);
        auto extra = [&](int m) {
          const ActionTimes instant{1.0 / v, 2.0 / v}, costly{1.0 / v, 2.0 / v, 1.0, 0.1};
          const auto fast = simulate(all_stages(p, m, v), instant), slow = simulate(all_stages(p, m, v), costly);
          REQUIRE(fast.completed);
          REQUIRE(slow.completed);
          return slow.makespan - fast.makespan;
        };
        const double base = extra(2 * p);
        CHECK(base > 0);
        for (const int m : {3 * p, 4 * p}) CHECK(extra(m) == doctest::Approx(base));
      }
    }
    // Plain 1F1B on two stages pays a transfer per microbatch.
    const ActionTimes costly{1, 2, 1, 0.1};
    CHECK(simulate(all_stages(2, 8), costly).makespan - simulate(all_stages(2, 8)).makespan == doctest::Approx(0.9));
  }

  TEST_CASE("the simulator finds two stages that each wait to receive before they send") {
    const std::vector<std::vector<Action>> stages = {
        {{ActionKind::kForward, 0}, {ActionKind::kRecvGradient, 0}, {ActionKind::kBackward, 0},
         {ActionKind::kSendActivation, 0}},
        {{ActionKind::kRecvActivation, 0}, {ActionKind::kForward, 0}, {ActionKind::kBackward, 0},
         {ActionKind::kSendGradient, 0}}};
    const auto run = simulate(stages);
    CHECK_FALSE(run.completed);
    CHECK(run.stuck == "stage 0 waits in [recv grad 0]");
  }

  TEST_CASE("the simulator refuses transfers that pair different microbatches") {
    const std::vector<std::vector<Action>> stages = {
        {{ActionKind::kForward, 0}, {ActionKind::kSendActivation, 0}},
        {{ActionKind::kRecvActivation, 1}, {ActionKind::kForward, 1}}};
    const auto run = simulate(stages);
    CHECK_FALSE(run.completed);
    CHECK(run.stuck.find("microbatch") != std::string::npos);
  }
}

TEST_SUITE("unit") {
  TEST_CASE("every stage of ZB-H1 runs each microbatch's F then B then W once and in order") {
    for (int p = 1; p <= 6; ++p) {
      for (int m = 1; m <= 12; ++m) {
        for (int s = 0; s < p; ++s) {
          CAPTURE(p);
          CAPTURE(m);
          CAPTURE(s);
          check_each_pass_once(zero_bubble_h1(p, s, m), m,
                               {ActionKind::kForward, ActionKind::kBackward, ActionKind::kWeight});
        }
      }
    }
  }

  TEST_CASE(
      "ZB-H1 keeps 1F1B's transfers and idles a third of its bubble with at most p passes alive per stage and p + 1 "
      "slots") {
    // F = B = W: 1F1B's backward is B + W. ZB-H1's idle on every stage is
    // (p - 1) / (3m + p - 1) once m >= p, Qi et al.'s (p - 1)(F + B - W).
    for (int p = 1; p <= 6; ++p) {
      for (int m = 1; m <= 12; ++m) {
        CAPTURE(p);
        CAPTURE(m);
        std::vector<std::vector<Action>> zb;
        for (int s = 0; s < p; ++s) {
          zb.push_back(zero_bubble_h1(p, s, m));
          std::vector<Action> transfers, plain;
          for (const Action& a : zb.back()) {
            if (a.transfer()) transfers.push_back(a);
          }
          for (const Action& a : one_f_one_b(p, s, m)) {
            if (a.transfer()) plain.push_back(a);
          }
          CHECK(transfers == plain);
        }
        const auto run = simulate(zb, {1, 1, 1});
        REQUIRE_MESSAGE(run.completed, run.stuck);
        const auto plain = simulate(all_stages(p, m), {1, 2});
        for (int s = 0; s < p; ++s) {
          CAPTURE(s);
          CHECK(run.peak_alive[static_cast<size_t>(s)] <= p);
          // A W overlaps the exchange before it, whose receive takes another slot.
          CHECK(plan_slots(zb[static_cast<size_t>(s)], m).slots == std::min(s == 0 ? p : p + 1, m));
          CHECK(run.idle[static_cast<size_t>(s)] <= plain.idle[static_cast<size_t>(s)] + 1e-12);
        }
        if (m >= p) {
          CHECK(run.makespan == doctest::Approx(3 * m + p - 1));
          CHECK(run.idle[0] == doctest::Approx(static_cast<double>(p - 1) / (3 * m + p - 1)));
        }
      }
    }
  }
}
