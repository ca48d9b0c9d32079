// The job's state machine on its own (daemon/job_state.h): every
// transition driven with plain inputs and the time as a number, checked
// against the actions it asks for. No process, no file, no clock.
#include "daemon/job_state.h"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <csignal>
#include <functional>
#include <string>
#include <vector>

namespace keel::daemon {
namespace {

constexpr int64_t kSecond = 1'000'000'000;

common::DaemonConfig daemon_config() {
  common::DaemonConfig d;
  d.grace_s = 10;
  d.stop_timeout_s = 900;
  d.restart_backoff_s = 1;
  d.restart_backoff_max_s = 4;
  d.crash_loop_generations = 3;
  return d;
}

// The actions that are not log lines, one word each: "start:1",
// "signal:9", "terminate:10", "tell:0", "record:rank_failed",
// "end:stopped!" (! when a stop was asked for).
std::string summary(const JobActions& actions) {
  std::string out;
  for (const auto& a : actions) {
    std::string word;
    switch (a.kind) {
      case JobAction::Kind::kStartGeneration: word = fmt::format("start:{}", a.generation); break;
      case JobAction::Kind::kSignal: word = fmt::format("signal:{}", a.signal); break;
      case JobAction::Kind::kTerminate: word = fmt::format("terminate:{:g}", a.grace_s); break;
      case JobAction::Kind::kTellRanks:
        word = fmt::format("tell:{}", a.generation);
        if (!a.nodes.empty()) word += fmt::format("[{}]", fmt::join(a.nodes, ","));
        break;
      case JobAction::Kind::kRecord: word = "record:" + a.text; break;
      case JobAction::Kind::kLog: continue;
      case JobAction::Kind::kEnd: word = std::string("end:") + job_state_name(a.state) + (a.stop_requested ? "!" : ""); break;
    }
    out += (out.empty() ? "" : " ") + word;
  }
  return out;
}

RankExit exit_of(int rank, int code) { return {rank, 100 + rank, code, 7, fmt::format("rank {} exited {}", rank, code)}; }

GenerationOutcome outcome(std::vector<int> codes, bool progressed = false, std::string abandoned = "") {
  return {std::move(codes), progressed, 5, std::move(abandoned), 7};
}

struct Step {
  const char* input;
  std::function<Transition(JobMachine&)> apply;
  std::string actions;  // summary() of what it asked for
  JobState state;       // the state after it
  std::string reply = "";  // "ok", or a part of the refusal; empty: no reply
};

const Step start = {"start", [](JobMachine& m) { return m.start(0); }, "start:0", JobState::kStarting};
const Step up = {"ranks up", [](JobMachine& m) { return m.ranks_up(); }, "", JobState::kRunning};

Step rank_exits(int rank, int code, std::string actions, JobState state) {
  return {"rank exits", [=](JobMachine& m) { return m.rank_exited(exit_of(rank, code)); }, std::move(actions), state};
}

Step over(GenerationOutcome o, int64_t now_ns, std::string actions, JobState state) {
  return {"generation over", [=](JobMachine& m) { return m.generation_over(o, now_ns); }, std::move(actions), state};
}

Step tick(int64_t now_ns, std::string actions, JobState state) {
  return {"tick", [=](JobMachine& m) { return m.tick(now_ns); }, std::move(actions), state};
}

Step stop(bool checkpoint, std::string actions, JobState state, std::string reply) {
  return {"stop", [=](JobMachine& m) { return m.stop(checkpoint, "test", 5); }, std::move(actions), state,
          std::move(reply)};
}

Step restart(std::string actions, JobState state, std::string reply) {
  return {"restart", [](JobMachine& m) { return m.restart("test"); }, std::move(actions), state, std::move(reply)};
}

Step verdict(std::string actions, JobState state) {
  return {"verdict", [](JobMachine& m) { return m.verdict("hang detected: rank 1 never began g0.dp.0 #7"); },
          std::move(actions), state};
}

Step ended_elsewhere(std::string actions, JobState state) {
  return {"ended elsewhere", [](JobMachine& m) { return m.ended_elsewhere("node 'b' lost its lease"); },
          std::move(actions), state};
}

Step verdict_on_nodes(std::string actions, JobState state) {
  return {"verdict naming node b",
          [](JobMachine& m) { return m.verdict("hang detected: rank 2 never began g0.dp.0 #7 [on node b]", {"b"}); },
          std::move(actions), state};
}

Step ended_by_verdict_naming_this_node(std::string actions, JobState state) {
  return {"ended elsewhere by a verdict naming this node",
          [](JobMachine& m) {
            return m.ended_elsewhere("hang detected: rank 2 never began g0.dp.0 #7 [on node b]", /*named_here=*/true);
          },
          std::move(actions), state};
}

Step joined(int64_t generation) {
  return {"joined", [=](JobMachine& m) {
            m.joined(generation);
            return Transition{};
          },
          "", JobState::kStarting};
}

Step join_failed(int64_t now_ns) {
  return {"join failed",
          [=](JobMachine& m) { return m.join_failed("the rendezvous did not complete: 1 node joined", now_ns); },
          "record:join_failed", JobState::kRestarting};
}

const std::string kFailed = "record:rank_failed tell:0 terminate:10";

struct Case {
  const char* name;
  std::vector<Step> steps;
};

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("the job's state machine takes each input to the documented state and actions") {
    const std::vector<Case> cases = {
        {"every rank exits 0",
         {start, up, rank_exits(0, 0, "", JobState::kRunning), rank_exits(1, 0, "", JobState::kRunning),
          over(outcome({0, 0}), 0, "record:generation_ended record:job_finished end:finished", JobState::kFinished)}},
        {"a rank that dies fails the generation and the next starts after the back-off",
         {start, up, rank_exits(1, 137, kFailed, JobState::kRestarting),
          rank_exits(0, 12, "", JobState::kRestarting),
          over(outcome({12, 137}), 10 * kSecond, "record:generation_ended record:restart_scheduled",
               JobState::kRestarting),
          tick(10 * kSecond + kSecond / 2, "", JobState::kRestarting),
          // A clock that jumps back starts nothing early.
          tick(kSecond, "", JobState::kRestarting), tick(12 * kSecond, "start:1", JobState::kStarting),
          tick(20 * kSecond, "", JobState::kStarting)}},
        {"a rank that refused its config fails the job at once",
         {start, rank_exits(0, 2, kFailed, JobState::kRestarting),
          over(outcome({2, 143}), 0, "record:generation_ended record:job_failed end:failed", JobState::kFailed)}},
        {"generations that commit nothing in a row fail the job as a crash loop",
         {start, rank_exits(1, 137, kFailed, JobState::kRestarting),
          over(outcome({-1, 137}), 0, "record:generation_ended record:restart_scheduled", JobState::kRestarting),
          tick(60 * kSecond, "start:1", JobState::kStarting),
          {"rank exits", [](JobMachine& m) { return m.rank_exited(exit_of(1, 137)); },
           "record:rank_failed tell:1 terminate:10", JobState::kRestarting},
          over(outcome({-1, 137}), 60 * kSecond, "record:generation_ended record:restart_scheduled",
               JobState::kRestarting),
          tick(120 * kSecond, "start:2", JobState::kStarting),
          {"rank exits", [](JobMachine& m) { return m.rank_exited(exit_of(1, 137)); },
           "record:rank_failed tell:2 terminate:10", JobState::kRestarting},
          over(outcome({-1, 137}), 120 * kSecond, "record:generation_ended record:job_failed end:failed",
               JobState::kFailed)}},
        {"a detector's verdict kills the ranks at once and restarts the generation",
         {start, up, verdict("tell:0 signal:9", JobState::kRestarting),
          rank_exits(0, 137, "", JobState::kRestarting), rank_exits(1, 137, "", JobState::kRestarting),
          over(outcome({137, 137}), 0, "record:generation_ended record:restart_scheduled", JobState::kRestarting)}},
        {"a verdict after every rank exited 0 still restarts the generation",
         {start, up, verdict("tell:0 signal:9", JobState::kRestarting), rank_exits(0, 0, "", JobState::kRestarting),
          over(outcome({0}), 0, "record:generation_ended record:restart_scheduled", JobState::kRestarting)}},
        {"a verdict while the job stops or restarts changes nothing",
         {start, up, stop(true, "record:stop_requested terminate:900", JobState::kStopping, "ok"),
          verdict("", JobState::kStopping)}},
        {"a stop with a checkpoint ends the job stopped once the ranks exit",
         {start, up, stop(true, "record:stop_requested terminate:900", JobState::kStopping, "ok"),
          rank_exits(0, 14, "", JobState::kStopping), rank_exits(1, 14, "", JobState::kStopping),
          over(outcome({14, 14}), 0, "record:generation_ended record:job_stopped end:stopped!", JobState::kStopped)}},
        {"a rank that exits 13 during a stop fails the job with rank 0's cause",
         {start, up, stop(true, "record:stop_requested terminate:900", JobState::kStopping, "ok"),
          rank_exits(1, 13, "", JobState::kStopping),
          over(outcome({14, 13}, false, "rank-00001.h5: File too large"), 0,
               "record:generation_ended record:final_checkpoint_failed record:job_failed end:failed!",
               JobState::kFailed)}},
        {"a second stop without a checkpoint kills at once and a third is refused",
         {start, up, stop(true, "record:stop_requested terminate:900", JobState::kStopping, "ok"),
          stop(false, "signal:9", JobState::kStopping, "ok"),
          stop(false, "", JobState::kStopping, "already stopping")}},
        {"a stop without a checkpoint kills at once",
         {start, stop(false, "record:stop_requested signal:9", JobState::kStopping, "ok")}},
        {"a stop while a failed generation is torn down ends it instead of restarting",
         {start, rank_exits(1, 137, kFailed, JobState::kRestarting),
          stop(true, "record:stop_requested", JobState::kStopping, "ok"),
          over(outcome({12, 137}), 0, "record:generation_ended record:job_stopped end:stopped!", JobState::kStopped)}},
        {"a stop during the back-off cancels the restart",
         {start, rank_exits(1, 137, kFailed, JobState::kRestarting),
          over(outcome({12, 137}), 0, "record:generation_ended record:restart_scheduled", JobState::kRestarting),
          stop(true, "record:stop_requested record:job_stopped end:stopped!", JobState::kStopped, "cancelled"),
          tick(100 * kSecond, "", JobState::kStopped)}},
        {"a restart of a running job saves first and then starts the next generation",
         {start, up, restart("record:restart_requested terminate:900", JobState::kStopping, "ok"),
          over(outcome({14, 14}), 0, "record:generation_ended start:1", JobState::kStarting)}},
        {"a restart while a failed generation is torn down is refused",
         {start, rank_exits(1, 137, kFailed, JobState::kRestarting),
          restart("record:restart_requested", JobState::kRestarting, "already under way")}},
        {"a restart during the back-off starts the next generation at once",
         {start, rank_exits(1, 137, kFailed, JobState::kRestarting),
          over(outcome({12, 137}), 0, "record:generation_ended record:restart_scheduled", JobState::kRestarting),
          restart("record:restart_requested start:1", JobState::kStarting, "ok"),
          tick(100 * kSecond, "", JobState::kStarting)}},
        {"a finished job can be restarted or stopped",
         {start, over(outcome({0, 0}), 0, "record:generation_ended record:job_finished end:finished",
                      JobState::kFinished),
          restart("record:restart_requested start:1", JobState::kStarting, "ok"),
          over(outcome({0, 0}), 0, "record:generation_ended record:job_finished end:finished", JobState::kFinished),
          stop(true, "record:stop_requested end:stopped!", JobState::kStopped, "the job had finished")}},
        {"a generation another node ended stops this node's ranks with a grace and restarts",
         {start, up, ended_elsewhere("record:generation_ended_elsewhere tell:0 terminate:10", JobState::kRestarting),
          rank_exits(0, 12, "", JobState::kRestarting),
          over(outcome({12, 143}), 0, "record:generation_ended record:restart_scheduled", JobState::kRestarting)}},
        {"a verdict on many nodes tells etcd the nodes of the ranks it names and kills this node's ranks",
         {start, up, verdict_on_nodes("tell:0[b] signal:9", JobState::kRestarting)}},
        {"a generation another node ended on a verdict naming this node's ranks kills them at once",
         {start, up,
          ended_by_verdict_naming_this_node("record:generation_ended_elsewhere tell:0 signal:9", JobState::kRestarting),
          over(outcome({137, 137}), 0, "record:generation_ended record:restart_scheduled", JobState::kRestarting)}},
        {"an end elsewhere while this node stops changes nothing",
         {start, up, restart("record:restart_requested terminate:900", JobState::kStopping, "ok"),
          ended_elsewhere("", JobState::kStopping)}},
        {"the rendezvous numbers the generation being started and the next follows it",
         {start, joined(7), rank_exits(1, 137, "record:rank_failed tell:7 terminate:10", JobState::kRestarting),
          over(outcome({12, 137}), 0, "record:generation_ended record:restart_scheduled", JobState::kRestarting),
          tick(10 * kSecond, "start:8", JobState::kStarting)}},
        {"a join that seals no generation waits and joins again and never fails the job as a crash loop",
         {start, join_failed(0), tick(kSecond / 2, "", JobState::kRestarting),
          tick(kSecond, "start:1", JobState::kStarting), join_failed(kSecond),
          tick(2 * kSecond, "start:2", JobState::kStarting), join_failed(2 * kSecond),
          tick(3 * kSecond, "start:3", JobState::kStarting), join_failed(3 * kSecond),
          tick(4 * kSecond, "start:4", JobState::kStarting), joined(9), up}},
        {"a node that joins after the job finished elsewhere ends finished and starts nothing",
         {start, {"finished elsewhere",
                  [](JobMachine& m) { return m.finished_elsewhere("on nodes a, b in generation 3", 40); },
                  "record:job_finished end:finished", JobState::kFinished}}},
        {"a finish elsewhere means nothing to a running generation",
         {start, up, {"finished elsewhere",
                      [](JobMachine& m) { return m.finished_elsewhere("on nodes a, b in generation 3", 40); }, "",
                      JobState::kRunning}}},
        {"a stopping job refuses a restart",
         {start, stop(true, "record:stop_requested terminate:900", JobState::kStopping, "ok"),
          restart("record:restart_requested", JobState::kStopping, "is stopping")}},
    };
    for (const auto& c : cases) {
      CAPTURE(c.name);
      JobMachine machine("test", daemon_config());
      int index = 0;
      for (const auto& step : c.steps) {
        CAPTURE(index++);
        CAPTURE(step.input);
        const Transition t = step.apply(machine);
        CHECK(summary(t.actions) == step.actions);
        CHECK(job_state_name(machine.state()) == std::string(job_state_name(step.state)));
        if (step.reply.empty()) {
          CHECK(t.reply.is_null());
        } else if (step.reply == "ok") {
          CHECK(t.reply.at("ok") == true);
        } else {
          CAPTURE(t.reply.dump());
          const bool refused = t.reply.at("ok") == false;
          const std::string text = refused ? t.reply.at("error") : t.reply.at("message");
          CHECK(text.find(step.reply) != std::string::npos);
        }
      }
    }
  }

  TEST_CASE("the cause of a failed generation is its first failure or the verdict") {
    JobMachine machine("test", daemon_config());
    machine.start(3);
    machine.rank_exited(exit_of(1, 137));
    machine.rank_exited(exit_of(0, 12));
    CHECK(machine.reason() == "rank 1 exited 137");
    const auto over = machine.generation_over(outcome({12, 137}), 0);
    bool scheduled = false;
    for (const auto& a : over.actions) {
      if (a.kind != JobAction::Kind::kRecord) continue;
      CHECK(a.generation == 3);
      if (a.text == "restart_scheduled") {
        scheduled = true;
        CHECK(a.fields.at("cause") == "rank 1 exited 137");
        CHECK(a.fields.at("delay_s") == 2.0);  // restart_backoff_s x 2^1
        CHECK(a.fields.at("checkpoint_step") == 5);
      }
    }
    CHECK(scheduled);
    machine.tick(3 * kSecond);
    CHECK(machine.generation() == 4);
    CHECK(machine.restarts() == 1);
    CHECK(machine.reason().empty());
    machine.verdict("hang detected: rank 1 is frozen");
    CHECK(machine.reason() == "hang detected: rank 1 is frozen");
  }

  TEST_CASE("events recorded before a restart carry the generation they belong to") {
    JobMachine machine("test", daemon_config());
    machine.start(0);
    machine.restart("test");
    const auto over = machine.generation_over(outcome({14, 14}), 0);
    REQUIRE(summary(over.actions) == "record:generation_ended start:1");
    CHECK(over.actions.front().generation == 0);
    CHECK(over.actions.back().generation == 1);
  }
}

}  // namespace keel::daemon
