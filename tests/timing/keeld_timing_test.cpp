// keeld's detectors where they judge time (docs/architecture.md "Health"):
// the straggler monitor against a rank slowed from inside, stopped from
// outside and starved of its core by another process, and the hang
// detector: a frozen rank and a hung collective named within its ceiling,
// its phase budgets against a slowed checkpoint or validation pass.
// Each runs alone (RUN_SERIAL, tests/timing/CMakeLists.txt): beside another
// test on two cores, the other test's processes are host contention the
// monitor rightly reports, and load stretches what a budget must explain.
// Each states the margin it was measured with.
#include "tests/daemon/health_job.h"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace keel::test {
namespace {

// How often these tests ask keeld's status: each answer costs keeld and
// the test some CPU on a core a rank runs on, contention the monitor sees.
constexpr std::chrono::milliseconds kSlowPoll{250};

// Requires `rank` flagged as a straggler for `cause`, and no other rank ever.
void require_only_straggler(const KeeldJob& job, int rank, const std::string& cause = "compute") {
  const auto flags = job.events_of("straggler_flagged");
  REQUIRE_FALSE(flags.empty());
  for (const auto& f : flags) {
    INFO(f.dump());
    CHECK(f.at("rank") == rank);
  }
  CHECK(flags[0].at("cause") == cause);
  MESSAGE("rank " << flags[0].at("rank") << " flagged at step " << flags[0].at("step") << " with score "
                  << flags[0].at("score") << " for " << flags[0].at("cause"));
}

// `per_cpu` processes spinning on each CPU `pid` may run on, outside the
// job, until destroyed: CPU hogs, as another tenant's jobs on the node
// would be.
class CpuHogs {
 public:
  CpuHogs(pid_t pid, int per_cpu) {
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    REQUIRE(::sched_getaffinity(pid, sizeof(allowed), &allowed) == 0);
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (!CPU_ISSET(cpu, &allowed)) continue;
      for (int n = 0; n < per_cpu; ++n) spawn_on(cpu);
    }
  }
  ~CpuHogs() {
    for (const pid_t hog : hogs_) {
      ::kill(hog, SIGKILL);
      ::waitpid(hog, nullptr, 0);
    }
  }
  CpuHogs(const CpuHogs&) = delete;
  CpuHogs& operator=(const CpuHogs&) = delete;

 private:
  void spawn_on(int cpu) {
    const pid_t hog = ::fork();
    REQUIRE(hog >= 0);
    if (hog == 0) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      ::sched_setaffinity(0, sizeof(one), &one);
      for (volatile uint64_t spin = 0;;) spin = spin + 1;
    }
    hogs_.push_back(hog);
  }

  std::vector<pid_t> hogs_;
};

// The quickstart's model and layout (configs/quickstart.toml): DP2 x TP2,
// 4 ranks on the 2-core VM.
const std::vector<std::string> kQuickstartShape = {"model.n_layer=4", "model.n_embd=128", "model.seq_len=128",
                                                   "train.batch_size=16", "checkpoint.every_steps=100"};

}  // namespace

TEST_SUITE("timing") {
  TEST_CASE("a rank slowed by a tenth is flagged as the straggler and no other rank is") {
    // Alone on the 2-core VM it was flagged at steps 28, 32, 34 and 85
    // (2026-12-07), at 32 and 38 before (2026-11-29); beside another test
    // it once took past step 200, which running alone rules out. 150 steps
    // leave 65 to spare.
    KeeldJob job;
    job.run(with(kFourComputeRanks, {"train.steps=150", "faults.slow_rank=1", "faults.slow_factor=1.1"}));
    require_only_straggler(job, 1);
  }

  TEST_CASE("a rank stopped from outside is flagged as the straggler and no other rank is") {
    // SIGSTOP for `stop` of every `period` until keeld is done: a duty
    // cycle, as a throttled node would impose.
    struct Case {
      const char* what;
      std::vector<std::string> sets;
      std::chrono::milliseconds stop, period;
      int64_t from_step;  // the stops begin once the job has done this many steps
      int64_t within;     // steps after the stops begin by which the victim is flagged
    };
    const Case cases[] = {
        // Steps of about 37 ms, 16 of them compute: a stop begins in one
        // step in five or six, in its compute (a stall of about 20 ms, seen)
        // or in its collectives (wait, which no rank can tell from waiting
        // for it), and the two alternate in runs of several stops. Alone on
        // the 2-core VM (2026-12-07) it was flagged 5-25 steps after the
        // first stop in four runs of this test and 11-39 in eight of the
        // same job: 11 steps to spare.
        {"2 ranks with a core each - 20 ms of every 200", with(kTwoComputeRanks, {"train.steps=120"}),
         std::chrono::milliseconds(20), std::chrono::milliseconds(200), 20, 50},
        // The quickstart's model and layout, 4 ranks on 2 cores (no rank
        // pinned): flagged 9-37 steps after the first stop in four runs of
        // this test (2026-12-07): 13 steps to spare.
        {"4 ranks on 2 cores in DP2 x TP2 - 20 ms of every 200", with(kQuickstartShape, {"train.steps=120"}),
         std::chrono::milliseconds(20), std::chrono::milliseconds(200), 20, 50},
    };
    for (const auto& c : cases) {
      CAPTURE(c.what);
      KeeldJob job;
      auto keeld = job.start(c.sets);
      const auto status = job.wait_for(
          [&](const nlohmann::json& s) { return s.at("state") == "running" && step_of(s) >= c.from_step; }, 120,
          kSlowPoll);
      const pid_t victim = status.at("ranks").at(1).at("pid").get<pid_t>();
      const int64_t slowed_from = step_of(status);
      std::atomic<bool> done{false};
      std::thread duty([&] {
        while (!done.load() && ::kill(victim, SIGSTOP) == 0) {
          std::this_thread::sleep_for(c.stop);
          ::kill(victim, SIGCONT);
          std::this_thread::sleep_for(c.period - c.stop);
        }
      });
      const auto result = keeld->wait(300);
      done = true;
      duty.join();
      INFO(result.output);
      REQUIRE(result.exit_code == 0);
      require_only_straggler(job, 1, "stalled");
      const auto flag = job.events_of("straggler_flagged")[0];
      INFO(flag.dump());
      CHECK(flag.at("step").get<int64_t>() < slowed_from + c.within);
      MESSAGE("stops from step " << slowed_from);
      CHECK(flag.at("stalled_share").get<double>() > flag.at("peers_stalled_share").get<double>());
    }
  }

  TEST_CASE("a rank starved of its core by a process outside the job is flagged first and for host contention") {
    // Each of the two ranks has a core of its own (two cores); from step 25
    // (the noise is learned at step 20) three processes spin on rank 1's
    // until the rank is flagged. Its training thread, asleep in its
    // collectives half of each step, is woken ahead of them, so it waits
    // for its core about a fifth of its step time; its compute keeps pace,
    // and it is flagged for its host, not for its compute: 9-17 steps after
    // the hogs began in six runs on the 2-core VM (2026-12-07), against the
    // 50 allowed. One hog cost it only a tenth of its step time, as much as
    // a 1.10x rank of two, flagged 50-200 steps after. Its communication
    // threads, driven off its core, run on its peer's (common/shared_cpus.h)
    // and slowed the peer's compute enough to flag the peer first in one run
    // of five before a compute verdict waited for a rank that waits for a
    // CPU more (health/straggler_monitor.h). Its run-queue wait is above its
    // peer's, as the cause requires: 0.20-0.30 of its step time against
    // 0.01-0.03 in those six runs.
    KeeldJob job;
    auto keeld = job.start(with(kTwoComputeRanks, {"train.steps=100"}), /*service=*/true);
    const auto status = job.wait_for(
        [](const nlohmann::json& s) { return s.at("state") == "running" && step_of(s) >= 25; }, 120, kSlowPoll);
    const int64_t from = step_of(status);
    {
      const CpuHogs hogs(status.at("ranks").at(1).at("pid").get<pid_t>(), 3);
      job.wait_for([&](const nlohmann::json& s) {
        return s.at("state") != "running" || !job.events_of("straggler_flagged").empty();
      }, 600, kSlowPoll);
      // What an operator sees while the hog runs.
      const auto health = keelctl_json(job, {"health"});
      const auto reason = health.at("ranks").at(1).at("reason").get<std::string>();
      INFO(reason);
      CHECK(health.at("ranks").at(1).at("health") == "straggler");
      CHECK(reason.find("host contention") != std::string::npos);
    }
    job.wait_for([](const nlohmann::json& s) { return s.at("state") == "finished"; }, 600, kSlowPoll);
    const auto flags = job.events_of("straggler_flagged");
    REQUIRE_FALSE(flags.empty());
    INFO(flags[0].dump());
    MESSAGE("the hogs began at step " << from << "; rank " << flags[0].at("rank") << " flagged at step "
                                        << flags[0].at("step") << " for " << flags[0].at("cause") << ", CPU wait "
                                        << flags[0].at("cpu_wait_share") << " against "
                                        << flags[0].at("peers_cpu_wait_share"));
    CHECK(flags[0].at("rank") == 1);
    CHECK(flags[0].at("cause") == "host");
    CHECK(flags[0].at("step").get<int64_t>() < from + 50);
    CHECK(flags[0].at("cpu_wait_share").get<double>() > flags[0].at("peers_cpu_wait_share").get<double>());
    for (const auto& f : flags) CHECK_MESSAGE((f.at("cause") != "host" || f.at("rank") == 1), f.dump());
    CHECK(job.ask(daemon::Command::kStop).at("ok") == true);
    CHECK(keeld->wait(120).exit_code == 0);
  }

  TEST_CASE("a rank frozen with SIGSTOP is named within the hang ceiling and the job restarts and ends as an uninterrupted run") {
    KeeldJob reference;
    reference.run(kFastHealth);

    KeeldJob job;
    auto keeld = job.start(kFastHealth, /*service=*/true);
    const auto status =
        job.wait_for([](const nlohmann::json& s) { return s.at("state") == "running" && step_of(s) >= 8; });
    const int victim = static_cast<int>(std::random_device()() % 4);
    INFO("froze rank " << victim);
    REQUIRE(freeze(status.at("ranks").at(victim).at("pid").get<pid_t>()));

    const auto hangs = wait_for_hang(job);
    bool named = false;
    std::string events;  // for the message below: which ranks each event named
    for (const auto& hang : hangs) {
      INFO(hang.dump());
      events += hang.dump() + "\n";
      // Alone on the 2-core VM (2026-11-29): named after 1.99 s, and after
      // 6.02 s where only the ceiling named it; 2 s of margin past the ceiling.
      CHECK(hang.at("detect_s").get<double>() <= kCeilingS + 2);
      MESSAGE("named after " << hang.at("detect_s").get<double>() << " s");
      // Only the frozen rank is frozen; others may wait for it. It is named
      // by whichever comes first: its heartbeat older than 2 s (frozen), or
      // its phase past its budget, the 1 s floor (never began); a clean
      // clone on a loaded 2-core machine met the second at 1.17 s.
      for (const auto& frozen : hang.at("frozen_ranks")) CHECK(frozen == victim);
      named = named || contains(hang.at("culprit_ranks"), victim);
      CHECK(hang.at("flight") == "flight/0");
    }
    CHECK_MESSAGE(named, "no hang_detected named the frozen rank:\n" << events);
    for (int r = 0; r < 4; ++r) CHECK(std::filesystem::exists(job.run_dir() / "flight/0" / fmt::format("rank-{:05d}.json", r)));
    std::ifstream verdict_file(job.run_dir() / "flight/0/verdict.json");
    const auto verdict = nlohmann::json::parse(verdict_file);
    CHECK(verdict.at("generation") == 0);
    CHECK(contains(verdict.at("culprit_ranks"), victim));

    job.wait_for([](const nlohmann::json& s) { return s.at("state") == "finished"; }, 300);
    const auto diagnosis = keelctl_json(job, {"diagnose"});
    CHECK(contains(diagnosis.at("verdict").at("culprit_ranks"), victim));
    CHECK(diagnosis.at("flight") == "flight/0");
    CHECK(diagnosis.at("ranks").size() == 4);
    const auto table = keelctl(job, {"diagnose"});
    CHECK(table.exit_code == 0);
    CHECK(table.output.find("culprits:") != std::string::npos);
    CHECK(keelctl_json(job, {"health"}).at("detections").at("hang").get<int>() >= 1);
    CHECK(job.ask(daemon::Command::kStop).at("ok") == true);
    const auto result = keeld->wait(120);
    INFO(result.output);
    CHECK(result.exit_code == 0);

    const auto restarts = job.events_of("restart_scheduled");
    REQUIRE(restarts.size() == 1);
    CHECK(restarts[0].at("cause").get<std::string>().starts_with("hang detected: "));
    CHECK(job.events_of("rank_failed").empty());  // the ranks were stopped, none failed by itself
    CHECK(job.events_of("generation_started").size() == 2);
    CHECK(job.events_of("job_finished").size() == 1);
    require_identical(job.checkpoint_tensors(40), reference.checkpoint_tensors(40));
  }

  TEST_CASE("a hang injected in a dp or a tp collective is named within the ceiling and the run ends with the fault-free model") {
    KeeldJob reference;
    reference.run(kFastHealth);
    const auto expected = reference.checkpoint_tensors(40);
    for (const std::string group : {"dp", "tp"}) {
      INFO("hang in a " << group << " collective");
      KeeldJob job;
      job.run(with(kFastHealth, {"faults.hang_rank=1", "faults.hang_step=12", "faults.hang_group=" + group}));
      // The fault landed where it was aimed.
      CHECK(rank_log_holds(job, 1, "hang_group = " + group + "): this rank stops"));
      const auto hangs = job.events_of("hang_detected");
      REQUIRE_FALSE(hangs.empty());
      for (const auto& hang : hangs) {
        INFO(hang.dump());
        // Ranks of other groups wait for the hung one too (its DP peer in
        // the gradient sum when it hangs in tp), and whichever budget runs
        // out first may report: every finding names rank 1 alone.
        CHECK(hang.at("culprit_ranks") == nlohmann::json::array({1}));
        CHECK_FALSE(hang.at("waiting_ranks").empty());
        // Alone on the 2-core VM (2026-11-29): named after 1.00-1.17 s.
        CHECK(hang.at("detect_s").get<double>() <= kCeilingS + 2);
        MESSAGE("named after " << hang.at("detect_s").get<double>() << " s");
      }
      CHECK(std::filesystem::exists(job.run_dir() / "flight/0/verdict.json"));
      CHECK(job.events_of("rank_failed").empty());  // found by keeld, not by the collectives' own timeout
      CHECK(job.events_of("generation_started").size() == 2);
      require_identical(job.checkpoint_tensors(40), expected);
    }
  }

  TEST_CASE("checkpoints and validation slowed past the collectives' budget raise no hang") {
    // The stall is four hang floors: the peers' wait in their next
    // collective outlasts that group's budget, learned after five steps,
    // and only the slow rank's phase budget explains it. The stall is
    // absolute, so a loaded machine cannot stretch it past the phase's
    // budget: the ceiling until a phase is seen five times, then five times
    // the longest save or pass seen, this stall among them. The ceiling is
    // raised to 25 s (below parallel.timeout_s = 30) so that a save slowed
    // by load as well still fits it.
    const double stall_s = 4;  // kFastHealth's floor is 1 s
    struct Case {
      const char* phase;
      std::vector<std::string> sets;
    };
    const std::vector<Case> cases = {
        {"checkpoint", {"checkpoint.every_steps=10"}},
        {"validation", {"train.val_every=10", "train.val_batches=2"}},
    };
    for (const auto& c : cases) {
      INFO("slowed " << std::string(c.phase));
      KeeldJob job;
      write_pattern_shard(job.dir() / "val.bin", 5000);
      auto sets = with(with(kFastHealth, {"health.hang_timeout_ceiling_s=25"}), c.sets);
      if (std::string(c.phase) == "validation") sets.push_back("data.val=" + (job.dir() / "val.bin").string());
      sets = with(sets, {"faults.slow_rank=2", fmt::format("faults.slow_stall_s={}", stall_s),
                         fmt::format("faults.slow_phase={}", c.phase)});
      job.run(sets);
      CHECK(rank_log_holds(job, 2, fmt::format("{} stretched by", c.phase)));  // the fault landed
      std::string hangs;  // what the detector saw, should it fire
      for (const auto& hang : job.events_of("hang_detected")) hangs += hang.dump() + "\n";
      CHECK_MESSAGE(hangs.empty(), hangs);
      CHECK(job.events_of("generation_started").size() == 1);
      CHECK(job.events_of("job_finished").size() == 1);
    }
  }

}

}  // namespace keel::test
