// In-memory snapshots end to end (docs/architecture.md "In-memory
// snapshots"), with a real keeld and real ranks: a rank killed at a random
// step resumes from the snapshot of the step before, without storage; a
// snapshot corrupted or left half-written is found and passed over; keeld
// killed takes the snapshots with it and the run resumes from disk; and an
// SDC rollback lands on a snapshot from before the corruption. Each ends
// bit-identical to a run that never failed.
#include <doctest/doctest.h>
#include <signal.h>

#include <random>
#include <string>
#include <vector>

#include "tests/daemon/health_job.h"
#include "tests/daemon/keeld_job.h"
#include "tests/daemon/prometheus_scrape.h"

namespace keel::test {
namespace {

const std::vector<std::string> kEveryStep = {"checkpoint.memory_every_steps=1"};

// The state_restored record of `generation`: where rank 0 restored from.
nlohmann::json restored_in(const KeeldJob& job, int64_t generation) {
  for (const auto& e : job.events_of("state_restored")) {
    if (e.at("generation") == generation) return e;
  }
  FAIL("no state_restored event of generation " << generation);
  return nullptr;
}

// The job ran twice, ended as `reference` did, and its second generation
// restored from `from` at `step`; returns that record.
nlohmann::json require_second_generation_from(const KeeldJob& job, const KeeldJob& reference, const std::string& from,
                                              int64_t step) {
  CHECK(job.events_of("generation_started").size() == 2);
  const auto restored = restored_in(job, 1);
  INFO(restored.dump());
  CHECK(restored.at("from") == from);
  CHECK(restored.at("step") == step);
  const auto resumed = job.events_of("generation_resumed");
  REQUIRE(resumed.size() == 2);
  CHECK(resumed[1].at("from") == from);
  CHECK(resumed[1].at("step") == step);
  require_identical(job.checkpoint_tensors(40), reference.checkpoint_tensors(40));
  CHECK(job.losses().back() == reference.losses().back());
  return restored;
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE(
      "a rank killed at a random step resumes from the in-memory snapshot of the step before and ends bit-identical") {
    KeeldJob reference;
    reference.run();
    std::random_device seed_source;
    const unsigned seed = seed_source();
    std::mt19937 rng(seed);
    INFO("random seed " << seed);
    for (int trial = 0; trial < 3; ++trial) {
      const int64_t at_step = std::uniform_int_distribution<int64_t>(3, 34)(rng);
      INFO("trial " << trial << ": kill -9 of a random rank at step " << at_step);
      const auto run = check_resumes_after_kill(kEveryStep, at_step, rng, reference.checkpoint_tensors(40));
      const KeeldJob& job = *run.job;
      const auto failed = job.events_of("rank_failed");
      // The ranks step together: when the victim died the others were at
      // most one step ahead of it, and every rank held its last step.
      const int64_t died_at = failed[0].at("step");
      const auto restored = restored_in(job, 1);
      INFO(restored.dump());
      CHECK(restored.at("from") == "memory");
      CHECK(restored.at("step").get<int64_t>() >= died_at - 1);
      CHECK(restored.at("step").get<int64_t>() >= step_of(run.status) - 1);
      CHECK(job.events_of("generation_resumed").at(1).at("from") == "memory");
      CHECK(job.losses().back() == reference.losses().back());
    }
  }

  TEST_CASE("a snapshot with a flipped byte is found by its checksum and the run resumes from the one before it") {
    KeeldJob reference;
    reference.run();
    KeeldJob job;
    // Rank 1's snapshot of step 13 is corrupted after its checksum, and
    // rank 1 dies halfway through its copy of step 14: every rank holds 12,
    // and 13 is rank 1's newest complete one.
    job.run(with(kEveryStep, {"faults.checkpoint_fault=snapshot_corrupt", "faults.checkpoint_fault_rank=1",
                              "faults.checkpoint_fault_step=13", "faults.crash_rank=1", "faults.crash_step=14",
                              "faults.crash_in=snapshot"}));
    const auto restored = require_second_generation_from(job, reference, "memory", 12);
    const std::string why = restored.at("why");
    CHECK(why.find("rank 1") != std::string::npos);
    CHECK(why.find("does not match its checksum") != std::string::npos);
  }

  TEST_CASE("a rank killed halfway through its snapshot leaves it unfinished and the run resumes from the one before") {
    KeeldJob reference;
    reference.run();
    KeeldJob job;
    job.run(with(kEveryStep, {"faults.crash_rank=2", "faults.crash_step=17", "faults.crash_in=snapshot"}));
    require_second_generation_from(job, reference, "memory", 16);
  }

  TEST_CASE("a rank killed in its first snapshot leaves no step held by every rank and the run resumes from disk") {
    KeeldJob reference;
    reference.run();
    KeeldJob job;
    // Snapshots every 7 steps, checkpoints every 5: rank 3 dies in the
    // copy of step 7, so nothing in memory is newer than the disk's step 5.
    job.run(
        {"checkpoint.memory_every_steps=7", "faults.crash_rank=3", "faults.crash_step=7", "faults.crash_in=snapshot"});
    const auto restored = require_second_generation_from(job, reference, "disk", 5);
    CHECK(restored.at("why").get<std::string>().find("rank 3 holds no in-memory snapshot") != std::string::npos);
  }

  TEST_CASE("keeld killed takes the snapshots with it and keeld started again resumes from disk bit-identical") {
    KeeldJob reference;
    reference.run();
    KeeldJob job;
    auto keeld = job.start(kEveryStep);
    const auto status = job.wait_for([](const nlohmann::json& s) {
      return s.at("state") == "running" && s.at("checkpoint_step").get<int64_t>() >= 10 && !s.at("snapshots").empty();
    });
    // What an operator sees of them meanwhile: keelctl checkpoint list
    // beside the checkpoints, and the stall and bytes on /metrics.
    const auto listed = keelctl_json(job, {"checkpoint", "list", "--run-dir", job.run_dir().string()});
    REQUIRE(listed.at("snapshots").is_array());
    REQUIRE_FALSE(listed.at("snapshots").empty());
    // Some step is held by every rank. Not necessarily the oldest listed:
    // a rank that began its next snapshot has taken that one's slot.
    bool on_every_rank = false;
    for (const auto& row : listed.at("snapshots")) {
      CHECK(row.at("bytes").get<uint64_t>() > 0);
      on_every_rank = on_every_rank || row.at("ranks") == 4;
    }
    CHECK(on_every_rank);
    const auto text = keelctl(job, {"checkpoint", "list", "--run-dir", job.run_dir().string()});
    CHECK(text.output.find("in memory on 4 of 4 ranks") != std::string::npos);
    const auto page = scrape(status.at("metrics_port").get<uint16_t>());
    REQUIRE(page.count("keel_snapshot_stall_seconds") == 1);
    CHECK(page.at("keel_snapshot_stall_seconds").size() == 4);
    for (const auto& sample : page.at("keel_snapshot_bytes")) CHECK(sample.value > 0);
    keeld->signal(SIGKILL);
    keeld->wait(60);
    // The ranks die with keeld (their parent-death signal); the newest
    // committed checkpoint is what the next keeld finds.
    const auto committed = job.events_of("checkpoint_committed");
    REQUIRE_FALSE(committed.empty());
    job.run(kEveryStep);
    const auto restored = restored_in(job, 1);
    INFO(restored.dump());
    CHECK(restored.at("from") == "disk");
    CHECK(restored.at("step").get<int64_t>() >= committed.back().at("step").get<int64_t>());
    CHECK(restored.at("why").get<std::string>().find("holds no in-memory snapshot") != std::string::npos);
    require_identical(job.checkpoint_tensors(40), reference.checkpoint_tensors(40));
  }

  TEST_CASE(
      "an SDC rollback with snapshots on lands on the snapshot of the last agreed step and ends as the fault-free "
      "run") {
    // As keeld_health_test's replica-digest case. Forty snapshots reach
    // back past the last agreed step, 10, however far the ranks ran before
    // keeld stopped them.
    const auto layout = with(kDigestRollback, {"checkpoint.memory_every_steps=1", "checkpoint.memory_keep=40"});
    KeeldJob reference;
    reference.run(layout);
    KeeldJob job;
    job.run(with(layout, kSilentFlipAtStep12));
    const auto found = job.events_of("sdc_detected");
    REQUIRE(found.size() == 1);
    CHECK(found[0].at("last_good_step") == 10);
    const auto moved = job.events_of("checkpoint_quarantined");
    REQUIRE(moved.size() == 1);
    // Every rank's snapshots of steps 11 to 14 at least: the digests of
    // step 15 tell, and a rank stopped then may not have committed that
    // step's snapshot yet (its hash runs beside training; a run left 13).
    CHECK(moved[0].at("snapshots").get<int>() >= 3 * 4);
    require_second_generation_from(job, reference, "memory", 10);
  }
}

}  // namespace keel::test
