// keeld's detectors end to end, with a real keeld and real ranks
// (docs/architecture.md "Daemon"): a hang injected with keelctl is named,
// written to the flight dump and restarted past; keelctl health,
// diagnose, stragglers and inject answer on a live job and refuse bad
// requests with a sentence; a replica that silently diverges rolls the run
// back to its last good checkpoint; and a healthy run raises no alarm: a
// loss spike is a record, never SDC, trained on or skipped as
// health.spike_policy says. The hangs that must be named within the
// ceiling run alone, in tests/timing.
//
// What each needs beyond keeld: the injected hang the trainer's fault
// requests (a hung rank never begins the collective); the rollback the
// trainer's replica digests and bit flips and the replica digest
// comparison.
#include "tests/daemon/health_job.h"
#include "tests/daemon/prometheus_scrape.h"
#include "tests/support/fortunes.h"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

namespace keel::test {
namespace {

// The quickstart job as it ships (configs/quickstart.toml) with its files
// in `job`'s directory, the corpus prepared there, and no fault.
std::vector<std::string> quickstart_sets(const KeeldJob& job, const PreparedCorpus& corpus) {
  return {"job.run_dir=" + job.run_dir().string(), "daemon.socket=" + job.socket(), "data.train=" + corpus.train_glob,
          "data.val=" + corpus.val_glob, "faults.crash_rank=-1"};
}

std::string quickstart_config() {
  std::ifstream in(std::filesystem::path(KEEL_SOURCE_DIR) / "configs" / "quickstart.toml");
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// keel_detections_total{kind="sdc"} on keeld's page.
double sdc_detections_on_page(const nlohmann::json& status) {
  const auto page = scrape(status.at("metrics_port").get<uint16_t>());
  for (const auto& s : page.at("keel_detections_total")) {
    if (s.labels.find("kind=\"sdc\"") != std::string::npos) return s.value;
  }
  FAIL("no keel_detections_total{kind=\"sdc\"} on the page");
  return -1;
}


}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("an exponent bit flipped in a gradient is caught by the rerun and never applied and its rank is suspect") {
    const auto layout = with(with(kFastHealth, kThreeReplicas), kShortAnomalyWindow);
    KeeldJob reference;
    reference.run(layout);
    KeeldJob job;
    auto keeld = job.start(with(layout, {"faults.bitflip_rank=1", "faults.bitflip_step=25", "faults.bitflip_target=grad",
                                         "faults.bitflip_bit=30"}),
                           /*service=*/true);
    job.wait_for([](const nlohmann::json& s) { return s.at("state") == "finished"; }, 300);
    const auto found = job.events_of("sdc_detected");
    REQUIRE(found.size() == 1);  // the trainer's record, not doubled by keeld
    INFO(found[0].dump());
    CHECK(found[0].at("rank") == 1);
    CHECK(found[0].at("method") == "rerun");
    CHECK(found[0].at("verdict") == "transient");
    CHECK(found[0].at("step") == 25);
    const auto health = keelctl_json(job, {"health"});
    CHECK(health.at("ranks").at(1).at("health") == "suspect");
    // Only the rank that flipped is blamed. Whether rank 0 is also a
    // straggler is not this test's business: this job runs beside other
    // tests on two cores, and a rank slowed by them is rightly flagged with
    // cause "host" (issue 45: only tests that run alone judge speed).
    CHECK(health.at("ranks").at(0).at("health") != "suspect");
    CHECK(health.at("detections").at("sdc") == 1);
    CHECK(job.ask(daemon::Command::kStop).at("ok") == true);
    CHECK(keeld->wait(120).exit_code == 0);
    CHECK(job.events_of("generation_started").size() == 1);  // nothing to roll back
    require_identical(job.checkpoint_tensors(40), reference.checkpoint_tensors(40));
  }

  TEST_CASE("keelctl inject hang names the rank as the culprit and keelctl diagnose shows it") {
    KeeldJob job;
    auto keeld = job.start(with(kFastHealth, {"train.steps=1000000"}), /*service=*/true);
    job.wait_for([](const nlohmann::json& s) { return s.at("state") == "running" && step_of(s) >= 8; });
    const auto injected = keelctl(job, {"inject", "hang", "--rank", "1"});
    INFO(injected.output);
    REQUIRE(injected.exit_code == 0);
    const auto recorded = job.events_of("fault_injected");
    REQUIRE(recorded.size() == 1);
    CHECK(recorded[0].at("fault") == "hang");
    CHECK(recorded[0].at("rank") == 1);

    const auto hangs = wait_for_hang(job);
    bool named = false;
    for (const auto& hang : hangs) {
      INFO(hang.dump());
      CHECK(hang.at("detect_s").get<double>() <= kCeilingS + 2);
      CHECK(hang.at("frozen_ranks").empty());  // a hung rank's heartbeat still beats
      named = named || hang.at("culprit_ranks") == nlohmann::json::array({1});
    }
    CHECK_MESSAGE(named, "no hang_detected named rank 1 alone");
    const auto diagnosis = keelctl_json(job, {"diagnose"});
    CHECK(contains(diagnosis.at("verdict").at("culprit_ranks"), 1));
    CHECK(diagnosis.at("ranks").at(1).at("published") == true);
    const auto table = keelctl(job, {"diagnose"});
    CHECK(table.output.find("NOT BEGUN") != std::string::npos);
    // The next generation runs clean.
    job.wait_for([](const nlohmann::json& s) { return s.at("generation") == 1 && s.at("state") == "running"; });
    CHECK(job.ask(daemon::Command::kStop).at("ok") == true);
    CHECK(keeld->wait(300).exit_code == 0);
  }

  TEST_CASE("keelctl health diagnose stragglers and inject answer a live job and bad faults get a sentence") {
    KeeldJob job;
    auto keeld = job.start({"train.steps=1000000"}, /*service=*/true);
    job.wait_for([](const nlohmann::json& s) { return s.at("state") == "running" && step_of(s) >= 3; });

    const auto health = keelctl_json(job, {"health"});
    REQUIRE(health.at("ranks").size() == 4);
    for (const auto& r : health.at("ranks")) CHECK(r.at("health") == "healthy");
    CHECK(health.at("detections") == nlohmann::json{{"hang", 0}, {"sdc", 0}, {"straggler", 0}});
    const auto diagnosis = keelctl_json(job, {"diagnose"});
    CHECK(diagnosis.at("verdict").is_null());
    CHECK(diagnosis.at("ranks").size() == 4);
    for (const char* key : {"window", "threshold", "false_alarm_steps", "sync_tax", "noise", "decision_interval", "ranks",
                            "steps", "compute_ms"}) {
      CAPTURE(key);
      CHECK(keelctl_json(job, {"stragglers"}).contains(key));
    }
    for (const char* command : {"health", "diagnose", "stragglers"}) {
      CAPTURE(command);
      const auto readable = keelctl(job, {command});
      CHECK(readable.exit_code == 0);
      CHECK(!readable.output.empty());
    }
    const auto status = keelctl(job, {"status"});
    CHECK(status.output.find("verdict") != std::string::npos);
    CHECK(status.output.find("healthy") != std::string::npos);

    struct Bad {
      std::vector<std::string> args;
      int exit_code;      // 2: keelctl refuses it; 1: keeld does
      std::string says;
    };
    const std::vector<Bad> bad = {
        {{"inject", "meteor"}, 2, "unknown fault \"meteor\""},
        {{"inject"}, 2, "kind is required"},
        {{"inject", "crash", "--rank", "one"}, 2, "--rank"},
        {{"inject", "crash", "--rank", "-1"}, 2, "--rank must be a rank"},
        {{"inject", "hang", "--rank", "4"}, 1, "rank 4 is not a rank of this job: it has 4 ranks, 0-3"},
        {{"inject", "crash", "--step", "-3"}, 2, "--step must be 0 or more"},
        {{"inject", "crash", "--step", "1"}, 1, "step 1 has passed"},
        {{"inject", "hang", "--factor", "2"}, 2, "--factor applies to slow only"},
        {{"inject", "slow", "--rank", "1"}, 2, "slow needs --factor"},
        {{"inject", "slow", "--factor", "0.5"}, 2, "--factor must be a number more than 1"},
        {{"inject", "bitflip", "--bit", "40"}, 2, "--bit must be a bit of a float32"},
        {{"inject", "bitflip", "--target", "loss"}, 2, "--target of bitflip must be one of"},
        {{"inject", "hang", "--group", "pp"}, 1, "no \"pp\" group of more than one rank"},
    };
    for (const auto& b : bad) {
      CAPTURE(fmt::format("{}", fmt::join(b.args, " ")));
      const auto result = keelctl(job, b.args);
      CAPTURE(result.output);
      CHECK(result.exit_code == b.exit_code);
      CHECK(result.output.find(b.says) != std::string::npos);
    }
    CHECK(job.events_of("fault_injected").empty());

    // A fault that harms nothing reaches the board and the event log.
    const auto slow = keelctl(job, {"inject", "slow", "--rank", "1", "--factor", "1.5"});
    INFO(slow.output);
    CHECK(slow.exit_code == 0);
    const auto injected = job.events_of("fault_injected");
    REQUIRE(injected.size() == 1);
    CHECK(injected[0].at("fault") == "slow");
    CHECK(injected[0].at("rank") == 1);
    CHECK(injected[0].at("factor") == 1.5);
    CHECK(injected[0].at("by") == "keelctl inject");

    CHECK(job.ask(daemon::Command::kStop).at("ok") == true);
    CHECK(keeld->wait(300).exit_code == 0);
    CHECK(job.events_of("hang_detected").empty());
    CHECK(job.events_of("sdc_detected").empty());
  }

  TEST_CASE("a bit flipped in the last step of a run is found in the ranks' last boards and rolled back") {
    // The flip lands in the last step's update: its digest is published,
    // the final checkpoint saved and the ranks gone before keeld's next
    // poll (seen to finish the job on the corrupted state without the
    // last boards' check).
    const auto layout = with(with(kFastHealth, kThreeReplicas),
                             {"health.sdc_digest_every=1", "health.sdc_policy=restart", "checkpoint.keep=100"});
    KeeldJob reference;
    reference.run(layout);
    KeeldJob job;
    job.run(with(layout, {"faults.bitflip_rank=1", "faults.bitflip_step=39", "faults.bitflip_target=param"}));
    const auto found = job.events_of("sdc_detected");
    REQUIRE_FALSE(found.empty());
    INFO(found[0].dump());
    CHECK(found[0].at("rank") == 1);
    CHECK(job.events_of("generation_started").size() == 2);
    require_identical(job.checkpoint_tensors(40), reference.checkpoint_tensors(40));
  }

  TEST_CASE("a silently flipped bit in one replica is named by the digests and the run rolls back to its last agreed step") {
    // Three DP replicas, so that a majority names the odd one.
    KeeldJob reference;
    reference.run(kDigestRollback);

    KeeldJob job;
    job.run(with(kDigestRollback, kSilentFlipAtStep12));
    const auto found = job.events_of("sdc_detected");
    REQUIRE(found.size() == 1);
    CHECK(found[0].at("rank") == 2);
    CHECK(found[0].at("method") == "replica_digest");
    CHECK(found[0].at("replicas") == 3);
    CHECK(found[0].at("step") == 15);
    CHECK(found[0].at("last_good_step") == 10);
    const auto moved = job.events_of("checkpoint_quarantined");
    REQUIRE(moved.size() == 1);
    CHECK(moved[0].at("last_good_step") == 10);
    for (const auto& name : moved[0].at("moved")) {
      CHECK(std::filesystem::exists(job.run_dir() / "checkpoints" / name.get<std::string>()));
    }
    // The checkpoint of step 15 may or may not have committed before the
    // ranks were stopped; whatever newer than step 10 did is moved aside.
    for (const auto& step : moved[0].at("steps")) CHECK(step.get<int64_t>() > 10);
    const auto resumed = job.events_of("generation_resumed");
    REQUIRE(resumed.size() == 2);
    CHECK(resumed[1].at("step") == 10);
    require_identical(job.checkpoint_tensors(40), reference.checkpoint_tensors(40));
  }

  TEST_CASE("the quickstart job with a warm-up of five steps raises no SDC alarm and trains as it would without the rerun") {
    // Seen before: the gradient norm jumped 30-fold at step 11, the rerun
    // reproduced it, and the step was reported as SDC and skipped.
    TempDir data;
    const auto corpus = prepare_fortunes(data.path());
    const std::vector<std::string> short_warmup = {"train.warmup_steps=5", "train.steps=120"};
    KeeldJob reference(quickstart_config());
    reference.run(with(with(quickstart_sets(reference, corpus), short_warmup), {"health.sdc_rerun=false"}));

    KeeldJob job(quickstart_config());
    auto keeld = job.start(with(quickstart_sets(job, corpus), short_warmup), /*service=*/true);
    const auto status = job.wait_for([](const nlohmann::json& s) { return s.at("state") == "finished"; }, 600);
    CHECK(job.events_of("sdc_detected").empty());
    CHECK(job.events_of("step_skipped").empty());
    CHECK(status.at("skipped_steps").at("count") == 0);
    const auto health = keelctl_json(job, {"health"});
    CHECK(health.at("detections").at("sdc") == 0);
    // No rank is suspect of SDC. Whether one is a straggler is the straggler
    // monitor's matter, held to its false-alarm bound by false_alarms_short:
    // here four ranks share the CI machine's two cores, and on 2026-11-28 a
    // rank of this run was flagged in 2 of 2 runs, where every suite before
    // had passed.
    for (const auto& rank : health.at("ranks")) {
      INFO(rank.dump());
      CHECK(rank.at("health") != "suspect");
    }
    CHECK(sdc_detections_on_page(status) == 0);
    CHECK(job.ask(daemon::Command::kStop).at("ok") == true);
    CHECK(keeld->wait(120).exit_code == 0);
    require_identical(job.checkpoint_tensors(120), reference.checkpoint_tensors(120));
  }

  TEST_CASE("a loss spike made on purpose is a record and no SDC and is trained on or skipped as spike_policy says") {
    struct Row {
      const char* policy;
      bool skipped;
    };
    for (const Row row : {Row{"apply", false}, Row{"skip", true}}) {
      CAPTURE(row.policy);
      KeeldJob job;
      auto keeld = job.start(with(with(kFastHealth, kShortAnomalyWindow),
                                  {"faults.loss_spike_step=30", "faults.loss_spike_factor=1000",
                                   std::string("health.spike_policy=") + row.policy}),
                             /*service=*/true);
      const auto status = job.wait_for([](const nlohmann::json& s) { return s.at("state") == "finished"; }, 300);
      const auto spikes = job.events_of("loss_spike");
      REQUIRE(spikes.size() == 1);
      INFO(spikes[0].dump());
      CHECK(spikes[0].at("step") == 30);
      CHECK(spikes[0].at("rank") == -1);
      CHECK(spikes[0].at("rerun_equal") == true);
      CHECK(spikes[0].at("score").get<double>() > spikes[0].at("threshold").get<double>());
      CHECK(spikes[0].at("action") == (row.skipped ? "skipped" : "applied"));
      CHECK(job.events_of("sdc_detected").empty());
      CHECK(job.events_of("step_skipped").size() == (row.skipped ? 1u : 0u));

      // Shown as a record, counted as no detection, blaming no rank.
      CHECK(status.at("loss_spikes") == nlohmann::json{{"count", 1}, {"last_step", 30}});
      CHECK(status.at("skipped_steps") ==
            nlohmann::json{{"count", row.skipped ? 1 : 0}, {"last_step", row.skipped ? 30 : -1}});
      const auto table = keelctl(job, {"status"});
      CHECK(table.exit_code == 0);
      CHECK((table.output.find("1 step skipped (the last at step 30)") != std::string::npos) == row.skipped);
      CHECK(table.output.find("1 loss spike (the last at step 30)") != std::string::npos);
      const auto health = keelctl_json(job, {"health"});
      CHECK(health.at("detections").at("sdc") == 0);
      CHECK(health.at("records") == nlohmann::json{{"loss_spikes", 1}, {"skipped_steps", row.skipped ? 1 : 0}});
      for (const auto& rank : health.at("ranks")) CHECK(rank.at("health") != "suspect");  // speed: not judged here
      const auto page = scrape(status.at("metrics_port").get<uint16_t>());
      CHECK(value_of(page, "keel_loss_spikes_total") == 1);
      CHECK(value_of(page, "keel_steps_skipped_total") == (row.skipped ? 1 : 0));
      CHECK(sdc_detections_on_page(status) == 0);

      // metrics.jsonl marks the step; the run went on to its end.
      std::ifstream metrics(job.run_dir() / "metrics.jsonl");
      int64_t steps = 0;
      for (std::string line; std::getline(metrics, line); ++steps) {
        const auto record = nlohmann::json::parse(line);
        if (record.at("step") != 30) continue;
        CHECK(record.value("loss_spike", false));
        CHECK(record.value("skipped", false) == row.skipped);
      }
      CHECK(steps == 40);
      CHECK(job.ask(daemon::Command::kStop).at("ok") == true);
      CHECK(keeld->wait(120).exit_code == 0);
    }
  }
}

}  // namespace keel::test
