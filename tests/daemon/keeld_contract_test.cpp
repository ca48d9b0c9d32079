// keeld's contracts with systemd and with its operators' input: the
// sd_notify messages a Type=notify unit relies on, exit 2 with a sentence
// for a bad configuration, exit 3 from keelctl when no keeld answers.
#include "tests/daemon/keeld_job.h"
#include "tests/daemon/notify_socket.h"

#include <doctest/doctest.h>

#include <map>
#include <string>
#include <vector>

namespace keel::test {

TEST_SUITE("integration") {
  TEST_CASE("keeld tells a notify socket READY STATUS WATCHDOG and STOPPING") {
    KeeldJob job;
    NotifySocket notify(job.dir() / "notify.sock");
    auto keeld = job.start({"train.steps=20"}, false, {{"NOTIFY_SOCKET", notify.path()}, {"WATCHDOG_USEC", "100000"}});
    const auto result = keeld->wait(120);
    notify.stop();
    INFO(result.output);
    REQUIRE(result.exit_code == 0);
    const auto seen = notify.seen();
    std::string statuses;
    for (const auto& line : notify.statuses()) statuses += line + "\n";
    INFO(statuses);
    CHECK(seen.count("READY") == 1);
    CHECK(seen.count("STATUS") == 1);
    CHECK(seen.count("WATCHDOG") == 1);
    CHECK(seen.count("STOPPING") == 1);
    CHECK(statuses.find("keeld-test: running") != std::string::npos);
    CHECK(statuses.find("loss") != std::string::npos);
  }

  TEST_CASE("keeld refuses a bad configuration with exit 2 and a sentence that says what to change") {
    KeeldJob job;
    struct Case {
      std::vector<std::string> sets;
      std::string says;
      std::map<std::string, std::string> env = {};
    };
    const std::vector<Case> cases = {
        {{"daemon.metrics_port=70000"}, "daemon.metrics_port"},
        {{"daemon.crash_loop_generations=0"}, "daemon.crash_loop_generations"},
        {{"daemon.grace_s=-1"}, "daemon.grace_s"},
        {{"daemon.ranks=3"}, "daemon.ranks"},
        {{"daemon.restart_backoff_max_s=0.01"}, "restart_backoff_max_s"},
        {{"daemon.socket=/" + std::string(120, 's')}, "under 108"},
        {{"daemon.trainer=/nonexistent/keel-trainer"}, "not an executable"},
        {{"daemon.control_group=no-such-group-keel"}, "not a group"},
        {{"daemon.no_such_key=1"}, "unknown key"},
        {{"faults.crash_rank=-2"}, "faults.crash_rank"},
        // Layouts the ranks refuse: keeld runs their check and starts none.
        {{"parallel.dp=2", "parallel.ep=2", "parallel.tp=1"}, "ep=2 needs a MoE model but n_expert=0"},
        {{"parallel.tp=3"}, "tp=3 does not divide n_head=4"},
        {{"train.device=tpu"}, "train.device"},
        // One GPU per rank: the job's 4 ranks do not fit the node's one.
        {{"train.device=cuda"}, "has 1 GPU (keeld's CUDA_VISIBLE_DEVICES=\"7\": 7)", {{"CUDA_VISIBLE_DEVICES", "7"}}},
    };
    for (const auto& c : cases) {
      INFO("--set " << c.sets.at(0) << (c.sets.size() > 1 ? " ..." : ""));
      std::vector<std::string> argv = {keel_binary("keeld").string(), "--config", (job.dir() / "job.toml").string(),
                                       "--foreground"};
      for (const auto& s : c.sets) {
        argv.push_back("--set");
        argv.push_back(s);
      }
      const auto result = run_process(argv, c.env, 60);
      INFO(result.output);
      CHECK(result.exit_code == 2);
      CHECK(result.output.find(c.says) != std::string::npos);
      CHECK_FALSE(std::filesystem::exists(job.run_dir() / "logs"));  // no rank was started
    }
    const auto missing = run_process({keel_binary("keeld").string(), "--config", (job.dir() / "nope.toml").string()});
    CHECK(missing.exit_code == 2);
    CHECK(missing.output.find("cannot open the config file") != std::string::npos);
    CHECK(run_process({keel_binary("keeld").string()}).exit_code == 2);
  }

  TEST_CASE("a second keeld on the same socket exits 2 and leaves the first one serving") {
    KeeldJob job;
    auto first = job.start({"train.steps=400"}, /*service=*/true);
    job.wait_for([](const nlohmann::json& s) { return s.at("state") == "running"; });
    const auto second = run_process(
        {keel_binary("keeld").string(), "--config", (job.dir() / "job.toml").string(), "--foreground"}, {}, 60);
    INFO(second.output);
    CHECK(second.exit_code == 2);
    CHECK(second.output.find("another keeld already serves") != std::string::npos);
    CHECK(job.ask(daemon::Command::kStatus).at("ok") == true);
    CHECK(job.ask(daemon::Command::kStop).at("ok") == true);
    CHECK(first->wait(120).exit_code == 0);
  }

  TEST_CASE("keelctl says keeld is not running with exit 3 and answers every command through a live keeld") {
    KeeldJob job;
    const std::string keelctl = keel_binary("keelctl").string();
    for (const std::vector<std::string>& command :
         {std::vector<std::string>{"status"}, {"events"}, {"stop"}, {"restart"}, {"checkpoint", "now"}}) {
      std::vector<std::string> argv = {keelctl, "--socket", job.socket()};
      argv.insert(argv.end(), command.begin(), command.end());
      const auto result = run_process(argv);
      INFO(result.output);
      CHECK(result.exit_code == 3);
      CHECK(result.output.find("keeld is not answering") != std::string::npos);
    }

    // No scheduled saves: every checkpoint before the last one was asked for.
    auto keeld = job.start({"train.steps=1000000", "checkpoint.every_steps=1000000"}, /*service=*/true);
    job.wait_for([](const nlohmann::json& s) { return s.at("state") == "running" && s.at("step") >= 3; });
    const auto status = run_process({keelctl, "--socket", job.socket(), "status", "--json"});
    REQUIRE(status.exit_code == 0);
    const auto parsed = nlohmann::json::parse(status.output);
    CHECK(parsed.at("ranks").size() == 4);
    CHECK(parsed.at("ranks").at(0).contains("phase"));
    CHECK(parsed.at("ranks").at(0).at("blas_core").get<std::string>().size() > 0);
    const auto table = run_process({keelctl, "--socket", job.socket(), "status"});
    CHECK(table.output.find("last collective") != std::string::npos);
    CHECK(table.output.find("ETA") != std::string::npos);
    CHECK(table.output.find("BLAS core ") != std::string::npos);

    const auto now = run_process({keelctl, "--socket", job.socket(), "checkpoint", "now"});
    CHECK(now.exit_code == 0);
    job.wait_for([&](const nlohmann::json&) { return !job.events_of("checkpoint_committed").empty(); });

    CHECK(run_process({keelctl, "--socket", job.socket(), "restart"}).exit_code == 0);
    job.wait_for([](const nlohmann::json& s) { return s.at("generation") == 1 && s.at("state") == "running"; });
    const auto events = run_process({keelctl, "--socket", job.socket(), "events", "--limit", "50"});
    CHECK(events.output.find("restart_requested") != std::string::npos);
    CHECK(job.events_of("rank_failed").empty());

    const auto stop = run_process({keelctl, "--socket", job.socket(), "stop", "--no-checkpoint"});
    CHECK(stop.exit_code == 0);
    CHECK(keeld->wait(120).exit_code == 0);
  }
}

}  // namespace keel::test
