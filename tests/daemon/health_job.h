// What the end-to-end tests of keeld's detectors share
// (tests/daemon/keeld_health_test.cpp, keeld_chaos_test.cpp): health
// settings that find a hang in seconds, the layouts the detectors need, and
// keelctl run as an operator runs it.
#pragma once

#include "tests/daemon/keeld_job.h"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace keel::test {

// Small hang budgets, so that a hang is found in seconds; the collectives'
// own timeout (parallel.timeout_s = 30) stays far above them.
inline constexpr double kCeilingS = 6;
inline const std::vector<std::string> kFastHealth = {
    "health.heartbeat_timeout_s=2", "health.hang_timeout_floor_s=1",
    "health.hang_timeout_ceiling_s=6", "health.hang_warmup_steps=5"};

inline std::vector<std::string> with(std::vector<std::string> sets,
                                     const std::vector<std::string> &more) {
  sets.insert(sets.end(), more.begin(), more.end());
  return sets;
}

inline ProcessResult keelctl(const KeeldJob &job,
                             std::vector<std::string> args) {
  args.insert(args.begin(),
              {keel_binary("keelctl").string(), "--socket", job.socket()});
  return run_process(args);
}

inline nlohmann::json keelctl_json(const KeeldJob &job,
                                   std::vector<std::string> args) {
  args.push_back("--json");
  const auto result = keelctl(job, args);
  INFO(result.output);
  REQUIRE(result.exit_code == 0);
  return nlohmann::json::parse(result.output);
}

// Whether rank `rank`'s log of the run holds `text`.
inline bool rank_log_holds(const KeeldJob &job, int rank, const std::string &text) {
  std::ifstream in(job.run_dir() / "logs" / fmt::format("rank-{:05d}.log", rank));
  const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return log.find(text) != std::string::npos;
}

inline bool contains(const nlohmann::json &list, int rank) {
  return std::find(list.begin(), list.end(), nlohmann::json(rank)) !=
         list.end();
}

inline int64_t step_of(const nlohmann::json &status) {
  return status.at("step").get<int64_t>();
}

// The hang_detected events once there is one.
inline std::vector<nlohmann::json> wait_for_hang(const KeeldJob &job) {
  REQUIRE_MESSAGE(wait_until([&] { return !job.events_of("hang_detected").empty(); }, 300), "no hang was detected");
  return job.events_of("hang_detected");
}

// An anomaly window that a 40-step job (warm-up 2) fills by step 18, so
// that the SDC rerun judges the steps where the tests flip a bit or spike
// the loss; the default window (50 steps after warm-up) would judge none.
inline const std::vector<std::string> kShortAnomalyWindow = {"health.sdc_anomaly_window=16"};

// Three DP replicas holding parameters and moments alike (ZeRO-0), so that
// a majority of replica digests can name the odd one.
inline const std::vector<std::string> kThreeReplicas = {
    "parallel.dp=3", "parallel.tp=1", "parallel.zero=0", "train.batch_size=6"};

// Three replicas whose digests and checkpoints come every 5 steps, rolled
// back on a mismatch the digests alone find (no rerun): a silent flip at
// step 12 is found at step 15, whose last agreed step is 10.
inline const std::vector<std::string> kDigestRollback = {
    "parallel.dp=3",      "parallel.tp=1",      "parallel.zero=0",           "train.batch_size=6",
    "checkpoint.keep=20", "health.sdc_digest_every=5", "health.sdc_policy=restart", "health.sdc_rerun=false"};
// That flip: a high mantissa bit of a parameter of rank 2, which moves no loss.
inline const std::vector<std::string> kSilentFlipAtStep12 = {"faults.bitflip_rank=2", "faults.bitflip_step=12",
                                                             "faults.bitflip_target=param", "faults.bitflip_bit=22"};

// Four single-threaded ranks with enough compute per step (tens of ms)
// that a 10% slowdown stands out of the scheduler's noise on a small
// machine; the straggler monitor at its defaults.
inline const std::vector<std::string> kFourComputeRanks = {
    "parallel.dp=4",
    "parallel.tp=1",
    "model.n_layer=4",
    "model.n_embd=128",
    "model.seq_len=64",
    "train.threads=1",
    "checkpoint.every_steps=50"};
// The same ranks, two of them: on a two-core machine keeld pins each to a
// core of its own. Four share the cores, and the two on the busier core ran
// 5-8% slower than the others for whole runs with no fault at all (each rank
// measured against the step's median over 200 steps, 2026-11-28), which the
// monitor rightly flags; with a core each they stayed within 1.5%.
inline const std::vector<std::string> kTwoComputeRanks = with(kFourComputeRanks, {"parallel.dp=2"});

} // namespace keel::test
