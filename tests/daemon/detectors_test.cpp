// The detectors end to end (docs/architecture.md "Health"): a real keeld, real
// ranks, faults injected through [faults] or from outside (SIGSTOP), the
// verdicts read back from events.jsonl, and the final model held against a
// fault-free run of the same job.
#include "tests/daemon/keeld_job.h"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

namespace keel::test {
namespace {

int64_t step_of(const nlohmann::json& status) { return status.at("step").get<int64_t>(); }

// Budgets small enough for a test, floors high enough for a loaded 2-core
// machine: a fault-free step here takes well under the floor.
const std::vector<std::string> kFastHealth = {
    "health.hang_timeout_floor_s=2", "health.hang_timeout_ceiling_s=8", "health.heartbeat_timeout_s=3",
    "health.hang_warmup_steps=5",    "daemon.grace_s=5",                "health.sdc_digest_every=1"};
constexpr double kCeilingS = 8;

std::vector<std::string> plus(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Three DP replicas (ZeRO-0: parameters and moments replicated), so a
// majority of digests can name the odd one.
const std::vector<std::string> kThreeReplicas = {"parallel.dp=3", "parallel.tp=1", "parallel.zero=0",
                                                 "train.batch_size=6"};

std::vector<int> ints(const nlohmann::json& array) { return array.get<std::vector<int>>(); }

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("a rank that never begins its collective is named and the run ends with the fault-free model") {
    const std::vector<std::string> health = kFastHealth;
    KeeldJob reference;
    reference.run(health);
    const auto expected = reference.checkpoint_tensors(40);
    for (const std::string group : {"dp", "tp"}) {
      INFO("hang in group " << group);
      KeeldJob job;
      job.run(plus(health, {"faults.hang_rank=1", "faults.hang_step=12", "faults.hang_group=" + group}));
      const auto hangs = job.events_of("hang_detected");
      REQUIRE(hangs.size() == 1);
      INFO(hangs[0].dump());
      CHECK(ints(hangs[0].at("culprit_ranks")) == std::vector<int>{1});
      CHECK(hangs[0].at("group").get<std::string>().find("." + group + ".") != std::string::npos);
      CHECK_FALSE(hangs[0].at("waiting_ranks").empty());
      CHECK(hangs[0].at("detect_s").get<double>() <= kCeilingS + 2);
      CHECK(std::filesystem::exists(job.run_dir() / "flight" / "0"));
      CHECK(job.events_of("generation_started").size() == 2);
      require_identical(job.checkpoint_tensors(40), expected);
    }
  }

  TEST_CASE("a rank frozen from outside is named as frozen and the run ends with the fault-free model") {
    KeeldJob reference;
    reference.run(kFastHealth);
    KeeldJob job;
    auto keeld = job.start(kFastHealth);
    const auto status = job.wait_for(
        [](const nlohmann::json& s) { return s.at("state") == "running" && s.at("generation") == 0 && step_of(s) >= 8; });
    const pid_t victim = status.at("ranks").at(2).at("pid").get<pid_t>();
    REQUIRE(freeze(victim));
    const auto result = keeld->wait(300);
    INFO(result.output);
    REQUIRE(result.exit_code == 0);
    const auto hangs = job.events_of("hang_detected");
    REQUIRE(hangs.size() == 1);
    INFO(hangs[0].dump());
    const auto culprits = ints(hangs[0].at("culprit_ranks"));
    CHECK(std::find(culprits.begin(), culprits.end(), 2) != culprits.end());
    CHECK(ints(hangs[0].at("frozen_ranks")) == std::vector<int>{2});
    CHECK(hangs[0].at("detect_s").get<double>() <= kCeilingS + 2);
    require_identical(job.checkpoint_tensors(40), reference.checkpoint_tensors(40));
  }

  TEST_CASE("slow validation and slow checkpoints raise no hang") {
    // Validation of 40 batches takes over 10 steps; rank 0's checkpoints are
    // slowed to 5 steps while the others wait for it in the next collective.
    KeeldJob job;
    write_pattern_shard(job.dir() / "val.bin", 20000);
    job.run(plus(kFastHealth, {"data.val=" + (job.dir() / "val.bin").string(), "train.val_every=10",
                               "train.val_batches=40", "faults.slow_rank=0", "faults.slow_phase=checkpoint",
                               "faults.slow_factor=5", "train.steps=40"}));
    CHECK(job.events_of("hang_detected").empty());
    CHECK(job.events_of("generation_started").size() == 1);
    CHECK(job.events_of("job_finished").size() == 1);
  }

  TEST_CASE("a bit flipped in one replica's state is attributed by the digests and rolled back") {
    const auto layout = plus(kFastHealth, kThreeReplicas);
    KeeldJob reference;
    reference.run(layout);
    const auto expected = reference.checkpoint_tensors(40);
    struct Flip {
      const char* target;
      int rank;
      int64_t step;
    };
    for (const Flip flip : {Flip{"param", 2, 13}, Flip{"exp_avg", 1, 17}}) {
      INFO("bit flip in " << flip.target << " of rank " << flip.rank << " at step " << flip.step);
      KeeldJob job;
      job.run(plus(layout, {fmt::format("faults.bitflip_rank={}", flip.rank),
                            fmt::format("faults.bitflip_step={}", flip.step),
                            fmt::format("faults.bitflip_target={}", flip.target)}));
      const auto found = job.events_of("sdc_detected");
      REQUIRE_FALSE(found.empty());
      INFO(found[0].dump());
      CHECK(found[0].at("rank") == flip.rank);
      CHECK(found[0].at("method") == "replica_digest");
      CHECK(found[0].at("step").get<int64_t>() <= flip.step + 3);
      require_identical(job.checkpoint_tensors(40), expected);
    }
  }

  TEST_CASE("an exponent bit flipped in a gradient is caught by the rerun and never applied") {
    const auto layout = plus(kFastHealth, kThreeReplicas);
    KeeldJob reference;
    reference.run(layout);
    KeeldJob job;
    job.run(plus(layout, {"faults.bitflip_rank=1", "faults.bitflip_step=25", "faults.bitflip_target=grad",
                          "faults.bitflip_bit=30"}));
    const auto found = job.events_of("sdc_detected");
    REQUIRE_FALSE(found.empty());
    INFO(found[0].dump());
    CHECK(found[0].at("rank") == 1);
    CHECK(found[0].at("method") == "rerun");
    CHECK(found[0].at("verdict") == "transient");
    CHECK(found[0].at("step") == 25);
    require_identical(job.checkpoint_tensors(40), reference.checkpoint_tensors(40));
  }

  TEST_CASE("a rank slowed by a tenth is flagged within fifty steps and no other rank is") {
    KeeldJob job;
    job.run(plus(plus(kFastHealth, kThreeReplicas),
                 {"faults.slow_rank=1", "faults.slow_factor=1.1", "train.steps=80", "checkpoint.every_steps=20"}));
    const auto flags = job.events_of("straggler_flagged");
    REQUIRE_FALSE(flags.empty());
    for (const auto& f : flags) {
      INFO(f.dump());
      CHECK(f.at("rank") == 1);
    }
    CHECK(flags[0].at("step").get<int64_t>() < 50);
  }
}

}  // namespace keel::test
