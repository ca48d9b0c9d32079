// SDC detection on real ranks (docs/architecture.md "Health": SDC), with
// bits flipped through [faults]: the rerun catches an exponent flip in a
// gradient or an activation (by the loss, the norm or the activations'
// squares), names the rank it happened on and applies the clean result, so
// the run ends exactly where a fault-free run ends; replica digests agree
// across DP replicas until a parameter flips; a fault-free run re-runs
// nothing.
#include "tests/trainer/boarded_ranks.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <iostream>
#include <map>
#include <random>
#include <set>

namespace {

using keel::test::Boards;
using keel::test::Layout;
using keel::test::RankResults;
using keel::test::TrainerRuns;

std::vector<nlohmann::json> sdc_events(const std::filesystem::path& run_dir) {
  std::vector<nlohmann::json> found;
  for (const auto& e : keel::test::events(run_dir)) {
    if (e.at("kind") == "sdc_detected") found.push_back(e);
  }
  return found;
}

std::vector<std::string> bitflip(int rank, int64_t step, const std::string& target, int bit,
                                 const std::string& tensor = "") {
  return {"faults.bitflip_rank=" + std::to_string(rank), "faults.bitflip_step=" + std::to_string(step),
          "faults.bitflip_target=" + target, "faults.bitflip_bit=" + std::to_string(bit),
          "faults.bitflip_tensor=" + tensor};
}

// The smallest anomaly window: with warm-up's 2 steps it is full by step
// 10, the first step a flip lands in; the default would score none of a
// 20-step run.
constexpr const char* kWindowBeforeFlips = "health.sdc_anomaly_window=8";

// A fault-free DP2 run of `steps` steps: no step is suspicious.
void check_no_rerun(int steps) {
  TrainerRuns f;
  const auto run =
      keel::test::run_ranks(f, Layout{2, 1, 1}, "clean", {"train.steps=" + std::to_string(steps), "train.val_every=0"});
  CHECK(sdc_events(run.run_dir).empty());
  CHECK(keel::test::count_events(run.run_dir, "step_skipped") == 0);
  CHECK(keel::test::count_events(run.run_dir, "loss_spike") == 0);
  for (const auto& rank : run.ranks) CHECK(rank.output.find("rerun") == std::string::npos);
}

// Trials of one bit flip each at a random rank and step of a DP3 ZeRO-1
// run of 20 steps (seeded, so a failure can be replayed), held against
// the fault-free run.
struct FlipTrials {
  struct Trial {
    bool named = false;      // the flipped rank, at the flipped step
    bool identical = false;  // final parameters equal the fault-free run's
    std::string flip;        // the injector's log line
  };
  TrainerRuns f;
  const Layout layout{3, 1, 1};
  const std::vector<std::string> common = {"train.steps=20", "train.val_every=0", "train.batch_size=12",
                                           kWindowBeforeFlips};
  const std::vector<std::string> clean = keel::test::run_ranks(f, layout, "clean", common).digests();
  std::mt19937 rng;
  int index = 0;

  explicit FlipTrials(unsigned seed) : rng(seed) {}

  Trial run(const std::string& target, int bit, const std::string& tensor = "") {
    const int rank = std::uniform_int_distribution<int>(0, layout.world() - 1)(rng);
    const int64_t step = std::uniform_int_distribution<int64_t>(10, 18)(rng);
    auto sets = common;
    const auto flip = bitflip(rank, step, target, bit, tensor);
    sets.insert(sets.end(), flip.begin(), flip.end());
    const auto result = keel::test::run_ranks(f, layout, "trial-" + std::to_string(index++), sets);
    const auto found = sdc_events(result.run_dir);
    Trial t;
    t.named = std::any_of(found.begin(), found.end(),
                          [&](const auto& e) { return e.at("rank") == rank && e.at("step") == step; });
    t.identical = result.digests() == clean;
    const std::string& out = result.ranks[static_cast<size_t>(rank)].output;
    const size_t at = out.find("flipped bit");
    if (at != std::string::npos) t.flip = out.substr(at, out.find('\n', at) - at);
    return t;
  }
};

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE(
      "an exponent bit flipped in a gradient or an activation is re-run "
      "and named on its rank") {
    // Activation flips in the logits and in the residual stream. A huge
    // value in the residual stream is absorbed by the next LayerNorm (its
    // variance overflows and the row's output is plain bias) and a huge
    // negative logit only takes one class out of one position's softmax:
    // neither moves the loss or the norm much, so the activations' squares
    // (StepSignals) are what the rerun sees them by.
    struct Row {
      Layout layout;
      const char* target;
      int rank;
      int64_t step;
      const char* tensor;
      std::vector<std::string> model = {};  // sets of the model (default: the fixture's GPT-2)
      std::string key() const { return layout.name() + (model.empty() ? "" : "-" + model.front().substr(11)); }
    };
    // A Llama with a key/value head per TP rank: the rerun and its naming
    // know nothing of the model.
    const std::vector<std::string> llama = {"model.arch=llama", "model.n_kv_head=2", "model.ffn_hidden=64"};
    const std::vector<Row> rows = {
        {Layout{2, 1, 0}, "grad", 1, 15, ""},
        {Layout{3, 1, 2}, "grad", 2, 12, ""},
        {Layout{2, 2, 1}, "grad", 3, 14, ""},
        {Layout{2, 1, 1}, "activation", 1, 15, "logits"},
        {Layout{3, 1, 0}, "activation", 2, 12, "logits"},
        {Layout{2, 2, 0}, "activation", 2, 13, "logits"},
        {Layout{2, 1, 1}, "activation", 0, 14, "h.1.output"},
        {Layout{3, 1, 0}, "activation", 1, 11, "h.0.output"},
        {Layout{2, 2, 1}, "activation", 1, 16, "h.1.output"},
        {Layout{2, 2, 1}, "grad", 3, 14, "", llama},
        {Layout{2, 1, 1}, "activation", 1, 14, "h.1.output", llama},
    };
    TrainerRuns f;
    const std::vector<std::string> common = {"train.steps=20", "train.val_every=0", "train.batch_size=12",
                                             kWindowBeforeFlips};
    std::map<std::string, RankResults> clean;
    for (const Row& row : rows) {
      CAPTURE(row.key());
      CAPTURE(std::string(row.target));
      const std::string name = row.key() + "-" + row.target + "-" + std::to_string(row.step);
      auto sets = common;
      sets.insert(sets.end(), row.model.begin(), row.model.end());
      if (!clean.contains(row.key())) {
        clean.emplace(row.key(), keel::test::run_ranks(f, row.layout, row.key() + "-clean", sets));
      }
      const auto flip = bitflip(row.rank, row.step, row.target, 30, row.tensor);
      sets.insert(sets.end(), flip.begin(), flip.end());
      Boards boards(row.layout.world());
      const auto run = keel::test::run_ranks(f, row.layout, name, sets, &boards);
      const std::string& flipped = run.ranks[static_cast<size_t>(row.rank)].output;
      REQUIRE(flipped.find("flipped bit 30 of") != std::string::npos);

      // Named: the flipped rank and, for an activation under TP, the TP
      // ranks its forward reached; never a rank of another DP replica.
      const auto found = sdc_events(run.run_dir);
      INFO(flipped);
      REQUIRE(!found.empty());
      std::set<int> named;
      for (const auto& e : found) {
        CHECK(e.at("step") == row.step);
        CHECK(e.at("method") == "rerun");
        CHECK(e.at("verdict") == "transient");
        named.insert(e.at("rank").get<int>());
      }
      CHECK(named.contains(row.rank));
      for (int r : named) CHECK(r / row.layout.tp == row.rank / row.layout.tp);
      if (std::string(row.target) == "grad" || row.layout.tp == 1) CHECK(named == std::set<int>{row.rank});
      for (int r = 0; r < row.layout.world(); ++r) {
        CAPTURE(r);
        const auto board = boards.read(r);
        CHECK(board.sdc.count == (named.contains(r) ? 1u : 0u));
        if (named.contains(r)) {
          CHECK(board.sdc.rank == r);
          CHECK(board.sdc.step == row.step);
          CHECK(std::string(keel::health::sdc_method_name(board.sdc.method)) == "rerun");
          CHECK(std::string(keel::health::sdc_verdict_name(board.sdc.verdict)) == "transient");
        }
      }
      // The corrupted result was never applied.
      CHECK(run.losses() == clean.at(row.key()).losses());
      CHECK(run.digests() == clean.at(row.key()).digests());
    }
  }

  TEST_CASE(
      "replica digests agree across DP replicas until a parameter or "
      "moment flips on one rank") {
    // Digests every 4 steps. Under ZeRO-0 every rank updates its whole copy,
    // so a flip stays on its rank; under ZeRO-1 the next step's all-gather
    // overwrites the flipped copy with the owner's shard (or, when the rank
    // owns the element, spreads the flip to every replica): only a digest
    // taken after the flip and before that all-gather sees it.
    struct Row {
      Layout layout;
      std::vector<std::string> fault;
      int flipped;                // -1: none
      std::set<int64_t> differs;  // the digest steps that show it
    };
    const std::vector<Row> rows = {
        {Layout{3, 1, 0}, {}, -1, {}},
        {Layout{2, 2, 1}, {}, -1, {}},
        {Layout{3, 1, 0}, bitflip(2, 6, "param", 22), 2, {8, 12, 16}},
        {Layout{3, 1, 0}, bitflip(1, 9, "exp_avg", 22), 1, {12, 16}},
        {Layout{3, 1, 0}, bitflip(0, 3, "exp_avg_sq", 22), 0, {4, 8, 12, 16}},
        {Layout{3, 1, 1}, bitflip(2, 7, "param", 22), 2, {8}},
    };
    TrainerRuns f;
    int index = 0;
    for (const Row& row : rows) {
      CAPTURE(row.layout.name());
      CAPTURE(row.flipped);
      std::vector<std::string> sets = {"train.steps=16", "train.val_every=0", "train.batch_size=12",
                                       "health.sdc_digest_every=4"};
      sets.insert(sets.end(), row.fault.begin(), row.fault.end());
      Boards boards(row.layout.world());
      keel::test::run_ranks(f, row.layout, "digests-" + std::to_string(index++), sets, &boards);
      std::vector<keel::health::BoardSnapshot> seen;
      for (int r = 0; r < row.layout.world(); ++r) seen.push_back(boards.read(r));
      for (int64_t step : {4, 8, 12, 16}) {
        CAPTURE(step);
        const size_t slot = static_cast<size_t>(step / 4 - 1) % keel::health::kDigestSlots;
        for (int r = 0; r < row.layout.world(); ++r) {
          CAPTURE(r);
          REQUIRE(seen[r].digest_count == 4);
          const auto& mine = seen[r].digests[slot];
          REQUIRE(mine.step == step);
          // A replica: the same TP rank of another DP rank.
          for (int other = 0; other < row.layout.world(); ++other) {
            const auto& theirs = seen[other].digests[slot];
            const bool replica = other % row.layout.tp == r % row.layout.tp;
            CHECK((theirs.replica_set == mine.replica_set) == replica);
            if (!replica || other == r) continue;
            const bool differs = row.differs.contains(step) && (r == row.flipped || other == row.flipped);
            CHECK((theirs.digest != mine.digest) == differs);
          }
        }
      }
    }
  }

  TEST_CASE("under ZeRO-3 no rank publishes a replica digest and the log says why") {
    TrainerRuns f;
    Boards boards(2);
    const auto run = keel::test::run_ranks(f, Layout{2, 1, 3}, "z3", {"train.steps=8", "health.sdc_digest_every=2"},
                                           &boards, 0, {{"SPDLOG_LEVEL", "info"}});
    for (int r = 0; r < 2; ++r) {
      CHECK(boards.read(r).digest_count == 0);
      CHECK(run.ranks[r].output.find("no replica digests: ZeRO-3 shards") != std::string::npos);
    }
  }

  TEST_CASE("a fault-free run of 300 steps re-runs no step") { check_no_rerun(300); }

  TEST_CASE(
      "every rank runs the known-answer test at start and again whenever "
      "sdc_kat_every_s has passed") {
    // Ranks vote on it, so they test at the same steps although only one
    // clock may have run out; a period of 1 ns makes every step a test.
    TrainerRuns f;
    const auto run = keel::test::run_ranks(f, Layout{2, 2, 1}, "kat",
                                           {"train.steps=6", "train.val_every=0", "health.sdc_kat_every_s=1e-9"},
                                           nullptr, 0, {{"SPDLOG_LEVEL", "info"}});
    for (const auto& rank : run.ranks) {
      size_t tests = 0;
      for (size_t at = 0; (at = rank.output.find("known-answer kernel test passed", at)) != std::string::npos; ++at) {
        ++tests;
      }
      CHECK(tests == 7);
    }
  }
}

TEST_SUITE("chaos") {
  TEST_CASE("a fault-free run of 2000 steps re-runs no step") { check_no_rerun(2000); }

  TEST_CASE(
      "exponent flips in gradients and activations at random ranks and "
      "steps are named in 29 of 30 trials") {
    // The bar: at least 95% of 30. Top exponent bit (a value below
    // 2 in magnitude grows by 2^128), alternately a gradient and an
    // activation, the element drawn by the injector; caught is the flipped
    // rank named at the flipped step, and then the rerun's clean result
    // must have been applied.
    FlipTrials trials(20261124);
    constexpr int kTrials = 30;
    int caught = 0, identical = 0;
    nlohmann::json missed = nlohmann::json::array();
    for (int trial = 0; trial < kTrials; ++trial) {
      const auto t = trials.run(trial % 2 == 0 ? "grad" : "activation", 30);
      caught += t.named ? 1 : 0;
      identical += t.identical ? 1 : 0;
      if (!t.named) missed.push_back({{"trial", trial}, {"flip", t.flip}});
      if (t.named) CHECK(t.identical);
    }
    std::cout << nlohmann::json{{"trials", "sdc exponent flips, gradients and activations"},
                                {"layout", trials.layout.name()},
                                {"of", kTrials},
                                {"caught_and_named", caught},
                                {"final_model_identical", identical},
                                {"missed", missed}}
                     .dump()
              << std::endl;
    CHECK(caught >= 29);
  }

  TEST_CASE("how often the rerun catches a flipped bit by bit and target") {
    // Random rank and step per trial (seeded, so a failure can be replayed);
    // a trial is caught when the flipped rank is named, and "applied" when
    // it was not and the final parameters differ from the fault-free run's.
    FlipTrials trials(20261123);
    constexpr int kTrials = 10;
    nlohmann::json table = nlohmann::json::array();
    const std::vector<std::pair<std::string, std::string>> sites = {
        {"grad", ""}, {"activation", ""}, {"activation", "h.1.output"}, {"activation", "logits"}};
    for (const auto& [target, tensor] : sites) {
      for (int bit : {22, 26, 28, 30}) {
        int caught = 0, applied = 0;
        for (int trial = 0; trial < kTrials; ++trial) {
          const auto t = trials.run(target, bit, tensor);
          caught += t.named ? 1 : 0;
          applied += !t.named && !t.identical ? 1 : 0;
        }
        table.push_back({{"target", target},
                         {"tensor", tensor.empty() ? "any" : tensor},
                         {"bit", bit},
                         {"trials", kTrials},
                         {"caught", caught},
                         {"silent_applied", applied}});
      }
    }
    std::cout << nlohmann::json{{"test", "sdc_rerun_detection_rate"},
                                {"layout", trials.layout.name()},
                                {"rates", table}}
                     .dump()
              << std::endl;
    // Below 2 in magnitude only the exponent's top bit grows a value (by
    // 2^128), the lower ones of a typical value are set and shrink it;
    // a grown gradient shows in the norm, a grown activation in the
    // activations' squares.
    for (const auto& row : table) {
      if (row.at("bit") == 30) CHECK(row.at("caught").get<int>() >= kTrials - 1);
    }
  }
}
