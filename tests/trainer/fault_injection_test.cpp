// Fault injection on the trainer's side (docs/architecture.md "Health"),
// on real ranks: a slow rank's compute on its board, checkpoint files that
// fail or rot, keeld's `keelctl inject` requests taken from the board, and
// bad [faults] and [health] values refused with exit 2.
#include "checkpoint/catalog.h"
#include "checkpoint/manifest.h"
#include "checkpoint/paths.h"
#include "tests/support/checkpoint_fixture.h"
#include "tests/support/wait.h"
#include "tests/trainer/boarded_ranks.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>

namespace {

using keel::test::Boards;
using keel::test::Layout;
using keel::test::TrainerRuns;

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// The medians of compute and wait over the steps a board still holds.
std::pair<double, double> compute_and_wait_ms(const keel::health::BoardSnapshot& board) {
  std::vector<double> compute, wait;
  for (const auto& t : board.steps) {
    if (t.step < 2) continue;  // the first steps warm caches
    compute.push_back(t.compute_ms);
    wait.push_back(t.wait_ms);
  }
  REQUIRE(compute.size() >= 20);
  return {median(compute), median(wait)};
}

void request(keel::health::ProgressBoard& board, keel::health::FaultKind kind, int64_t step,
             const std::string& target = "", int bit = 22) {
  keel::health::FaultRequest r;
  r.kind = static_cast<uint32_t>(kind);
  r.step = step;
  r.bit = bit;
  std::strncpy(r.target, target.c_str(), sizeof r.target - 1);
  board.request_fault(r);
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("a slow rank's compute on its board is about slow_factor times its peer's while the peer waits") {
    TrainerRuns f;
    Boards boards(2);
    keel::test::run_ranks(f, Layout{2}, "slow",
                          {"train.steps=40", "train.val_every=0", "model.n_embd=64", "model.seq_len=64",
                           "faults.slow_rank=1", "faults.slow_factor=3"},
                          &boards);
    const auto [fast_compute, fast_wait] = compute_and_wait_ms(boards.read(0));
    const auto [slow_compute, slow_wait] = compute_and_wait_ms(boards.read(1));
    MESSAGE("median compute ms: rank 0 " << fast_compute << ", rank 1 " << slow_compute << "; wait ms: rank 0 "
                                         << fast_wait << ", rank 1 " << slow_wait);
    CHECK(slow_compute / fast_compute > 2.3);
    CHECK(slow_compute / fast_compute < 4.0);
    // The time rank 1 adds is time rank 0 spends waiting for it.
    CHECK(fast_wait > slow_wait + fast_compute);
  }

  TEST_CASE("a checkpoint file that fails or rots on one rank is abandoned or caught by verify and training goes on") {
    struct Row {
      const char* fault;
      int64_t fault_step;  // 0: the first checkpoint
      int64_t generation;  // the generation the ranks run in; faults fire in generation 0
      std::vector<int64_t> committed;
      int64_t abandoned;  // -1: none
      const char* cause;  // in the checkpoint_abandoned event
      int64_t rotten;     // the committed step whose rank-00001.h5 fails verify; -1: none
    };
    const std::vector<Row> rows = {
        {"write_error", 0, 0, {8, 12}, 4, "Input/output error", -1},
        {"write_error", 8, 0, {4, 12}, 8, "Input/output error", -1},
        {"disk_full", 0, 0, {8, 12}, 4, "No space left on device", -1},
        {"corrupt", 0, 0, {4, 8, 12}, -1, "", 4},
        {"corrupt", 0, 1, {4, 8, 12}, -1, "", -1},
    };
    TrainerRuns f;
    int index = 0;
    for (const Row& row : rows) {
      CAPTURE(row.fault);
      CAPTURE(row.fault_step);
      CAPTURE(row.generation);
      const std::string name = "ckpt-" + std::to_string(index++);
      const auto run =
          keel::test::run_ranks(f, Layout{2}, name,
                                {"train.steps=12", "train.val_every=0", "checkpoint.every_steps=4", "checkpoint.keep=5",
                                 std::string("faults.checkpoint_fault=") + row.fault, "faults.checkpoint_fault_rank=1",
                                 "faults.checkpoint_fault_step=" + std::to_string(row.fault_step)},
                                nullptr, 0, {{"SPDLOG_LEVEL", "warn"}}, row.generation);
      const auto root = run.run_dir / "checkpoints";
      CHECK(keel::test::committed_steps(root) == row.committed);
      std::vector<nlohmann::json> abandoned;
      for (const auto& e : keel::test::events(run.run_dir)) {
        if (e.at("kind") == "checkpoint_abandoned") abandoned.push_back(e);
      }
      CHECK(abandoned.size() == (row.abandoned >= 0 ? 1u : 0u));
      if (row.abandoned >= 0 && !abandoned.empty()) {
        CHECK(abandoned[0].at("step") == row.abandoned);
        CHECK(abandoned[0].at("cause").get<std::string>().find(row.cause) != std::string::npos);
        CHECK(abandoned[0].at("cause").get<std::string>().find("rank-00001.h5") != std::string::npos);
      }
      for (int64_t step : row.committed) {
        CAPTURE(step);
        const auto dir = keel::checkpoint::step_dir(root, step);
        const auto problems = keel::checkpoint::verify_files(dir, keel::checkpoint::read_manifest(dir));
        CHECK(problems.size() == (step == row.rotten ? 1u : 0u));
        if (!problems.empty()) CHECK(problems[0].find("rank-00001.h5") != std::string::npos);
      }
    }
  }

  TEST_CASE("keelctl inject requests on the board fire at the rank's next step and a bad one is ignored") {
    TrainerRuns f;
    Boards boards(1);
    keel::test::RankLauncher launcher(
        1,
        [&](int r) {
          return boards.wrap(r, f.argv("inject", {"train.steps=100000", "train.val_every=0"}));
        },
        {{"SPDLOG_LEVEL", "warn"}});
    // A read that races with the rank's write gives nothing (progress_board.h):
    // the last count seen stands, never 0 (which once failed this test on CI).
    int64_t seen_done = 0;
    auto steps_done = [&] {
      if (const auto seen = boards.board(0).read()) seen_done = seen->steps_done;
      return seen_done;
    };
    auto passes_two_steps = [&] {
      const int64_t from = steps_done();
      REQUIRE(keel::test::wait_until([&] { return steps_done() >= from + 2; }, 120));
    };
    passes_two_steps();
    request(boards.board(0), keel::health::FaultKind::kBitflip, -1, "param", 40);
    passes_two_steps();
    request(boards.board(0), keel::health::FaultKind::kBitflip, -1, "exp_avg", 22);
    passes_two_steps();
    const int64_t before_nan = steps_done();
    request(boards.board(0), keel::health::FaultKind::kNan, -1, "loss");
    const auto result = launcher.wait_all(120)[0];
    CAPTURE(result.output);
    CHECK(result.exit_code == 11);
    CHECK(result.output.find("ignoring keelctl inject request 1 (bitflip)") != std::string::npos);
    CHECK(result.output.find("faults.bitflip_bit") != std::string::npos);
    CHECK(result.output.find("keelctl inject request 2: bitflip") != std::string::npos);
    CHECK(result.output.find("flipped bit 22 of") != std::string::npos);
    CHECK(result.output.find("keelctl inject request 3: nan") != std::string::npos);
    CHECK(result.output.find("the update was not applied") != std::string::npos);
    // The NaN fired at the step the rank reached next.
    CHECK(keel::test::complete_lines(f.dir() / "inject" / "metrics.jsonl") >= before_nan);
    CHECK(keel::test::complete_lines(f.dir() / "inject" / "metrics.jsonl") <= before_nan + 2);
  }

  TEST_CASE("bad faults and health values exit 2 naming the key") {
    const std::vector<std::pair<std::string, std::string>> rows = {
        {"faults.bitflip_target=weights", "faults.bitflip_target"},
        {"faults.bitflip_bit=32", "faults.bitflip_bit"},
        {"faults.bitflip_rank=-2", "faults.bitflip_rank"},
        {"faults.bitflip_step=-1", "faults.bitflip_step"},
        {"faults.bitflip_tensor=h.9.attn.c_attn.weight", "faults.bitflip_tensor"},
        {"faults.slow_factor=0.5", "faults.slow_factor"},
        {"faults.slow_rank=-3", "faults.slow_rank"},
        {"faults.checkpoint_fault=full", "faults.checkpoint_fault"},
        {"faults.checkpoint_fault_step=-1", "faults.checkpoint_fault_step"},
        {"faults.fault_generation=-2", "faults.fault_generation"},
        {"health.sdc_anomaly_z=0", "health.sdc_anomaly_z"},
        {"health.sdc_anomaly_window=4", "health.sdc_anomaly_window"},
        {"health.sdc_digest_every=-1", "health.sdc_digest_every"},
        {"health.sdc_kat_every_s=-5", "health.sdc_kat_every_s"},
        {"health.sdc_rerun=maybe", "sdc_rerun"},
        {"health.sdc_policy=panic", "health.sdc_policy"},
        {"health.spike_policy=ignore", "health.spike_policy"},
        {"faults.loss_spike_factor=nan", "faults.loss_spike_factor"},
    };
    TrainerRuns f;
    for (const auto& [set, key] : rows) {
      CAPTURE(set);
      const auto result = keel::test::run_process(f.argv("bad", {"train.steps=2", "train.val_every=0", set}), {}, 120);
      CAPTURE(result.output);
      CHECK(result.exit_code == 2);
      CHECK(result.output.find(key) != std::string::npos);
      CHECK(result.output.find("internal error") == std::string::npos);
    }
    // The activation sites are not tensors, and the other way round.
    for (const auto& [target, tensor] :
         {std::pair{"grad", "logits"}, {"activation", "h.0.mlp.c_fc.weight"}, {"activation", "h.7.output"}}) {
      CAPTURE(target);
      const auto result =
          keel::test::run_process(f.argv("bad", {"train.steps=2", std::string("faults.bitflip_target=") + target,
                                                 std::string("faults.bitflip_tensor=") + tensor}),
                                  {}, 120);
      CHECK(result.exit_code == 2);
      CHECK(result.output.find("faults.bitflip_tensor") != std::string::npos);
    }
  }
}
