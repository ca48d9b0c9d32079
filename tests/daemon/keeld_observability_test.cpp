// What an operator sees of a live keeld job (docs/architecture.md "Daemon"): the Prometheus
// page that its metrics port serves, scraped over HTTP with every
// documented metric, and the "stale" health that keelctl status shows for
// a rank whose progress board stops moving.
#include "tests/daemon/keeld_job.h"
#include "tests/daemon/prometheus_scrape.h"

#include <doctest/doctest.h>
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace keel::test {

TEST_SUITE("integration") {
  TEST_CASE("a live keeld serves every documented Prometheus metric with sane values") {
    KeeldJob job;  // daemon.metrics_port = 0: any free port, named in status
    auto keeld = job.start({"train.steps=1000000"});
    const auto status = job.wait_for([](const nlohmann::json& s) {
      return s.at("state") == "running" && s.at("checkpoint_step").get<int64_t>() >= 5;
    });
    const auto port = status.at("metrics_port").get<uint16_t>();
    REQUIRE(port != 0);
    // keeld reads the boards every 200 ms: the ranks' file sizes of the
    // committed checkpoint reach the page on a later tick than the commit.
    std::map<std::string, std::vector<Sample>> page;
    const bool written = wait_until(
        [&] {
          page = scrape(port);
          const auto bytes = by_rank(page, "keel_rank_checkpoint_bytes");
          return bytes.size() == 4 && std::all_of(bytes.begin(), bytes.end(), [](auto& b) { return b.second > 0; });
        },
        60);
    CHECK_MESSAGE(written, "the ranks' checkpoint bytes never reached the page");

    CHECK(value_of(page, "keel_step") >= 5);
    const double loss = value_of(page, "keel_loss");
    CHECK(std::isfinite(loss));
    CHECK(loss > 0);
    CHECK(loss < std::log(256.0) * 2);  // a byte-level model starts near ln 256
    CHECK(value_of(page, "keel_tokens_per_second") > 0);
    CHECK(value_of(page, "keel_generation") == 0);
    CHECK(value_of(page, "keel_restarts_total") == 0);
    const double checkpoint_step = value_of(page, "keel_checkpoint_step");
    CHECK(checkpoint_step >= 5);
    CHECK(std::fmod(checkpoint_step, 5) == 0);  // checkpoint.every_steps = 5

    // One keel_job_state sample per state, 1 for running only.
    std::set<std::string> states;
    for (const auto& s : page["keel_job_state"]) {
      CAPTURE(s.labels);
      const bool running = s.labels.find("state=\"running\"") != std::string::npos;
      CHECK(s.value == (running ? 1 : 0));
      states.insert(s.labels);
    }
    CHECK(states.size() == 7);

    // One counter per detector kind, none found in a healthy run.
    std::set<std::string> kinds;
    for (const auto& s : page["keel_detections_total"]) {
      CAPTURE(s.labels);
      CHECK(s.value == 0);
      kinds.insert(s.labels.substr(s.labels.find("kind=")));
    }
    CHECK(kinds == std::set<std::string>{"kind=\"hang\"", "kind=\"sdc\"", "kind=\"straggler\""});
    // Records, no alarms: none in a healthy run either.
    CHECK(value_of(page, "keel_loss_spikes_total") == 0);
    CHECK(value_of(page, "keel_steps_skipped_total") == 0);

    const std::vector<std::string> per_rank = {"keel_rank_step", "keel_rank_step_seconds", "keel_rank_board_age_seconds",
                                               "keel_rank_checkpoint_bytes", "keel_rank_checkpoint_write_seconds",
                                               "keel_rank_straggler_score"};
    for (const auto& name : per_rank) {
      CAPTURE(name);
      const auto values = by_rank(page, name);
      REQUIRE(values.size() == 4);
      for (const auto& [rank, value] : values) {
        CAPTURE(rank);
        CHECK(std::isfinite(value));
        if (name == "keel_rank_step") CHECK(value >= 5);
        if (name == "keel_rank_step_seconds" || name == "keel_rank_checkpoint_write_seconds") CHECK(value > 0);
        if (name == "keel_rank_board_age_seconds") CHECK(value >= 0);
        if (name == "keel_rank_checkpoint_bytes") CHECK(value > 0);
        CHECK(value < 1e9);
      }
    }

    CHECK(job.ask(daemon::Command::kStop).at("ok") == true);
    const auto result = keeld->wait(300);
    INFO(result.output);
    CHECK(result.exit_code == 0);
  }

  TEST_CASE("a rank whose board stops updating shows stale in keelctl status and ok again once it moves") {
    KeeldJob job;
    // Collectives wait for the frozen rank far longer than the test takes.
    auto keeld = job.start({"train.steps=1000000", "daemon.stale_after_s=2", "parallel.timeout_s=300"});
    const int victim = 2;
    auto health_of = [&](const nlohmann::json& s) { return s.at("ranks").at(victim).at("health").get<std::string>(); };
    const auto status =
        job.wait_for([&](const nlohmann::json& s) { return s.at("state") == "running" && health_of(s) == "ok"; });
    const auto pid = status.at("ranks").at(victim).at("pid").get<pid_t>();
    REQUIRE(freeze(pid));

    job.wait_for([&](const nlohmann::json& s) { return health_of(s) == "stale"; });
    const auto table = run_process({keel_binary("keelctl").string(), "--socket", job.socket(), "status"});
    CHECK(table.exit_code == 0);
    CHECK(table.output.find("stale") != std::string::npos);
    const auto json = run_process({keel_binary("keelctl").string(), "--socket", job.socket(), "status", "--json"});
    REQUIRE(json.exit_code == 0);
    const auto parsed = nlohmann::json::parse(json.output);
    CHECK(health_of(parsed) == "stale");
    CHECK(parsed.at("ranks").at(victim).at("board_age_s").get<double>() > 2);

    ::kill(pid, SIGCONT);
    job.wait_for([&](const nlohmann::json& s) { return health_of(s) == "ok"; });
    CHECK(job.ask(daemon::Command::kStop).at("ok") == true);
    const auto result = keeld->wait(300);
    INFO(result.output);
    CHECK(result.exit_code == 0);
    CHECK(job.events_of("rank_failed").empty());
  }
}

}  // namespace keel::test
