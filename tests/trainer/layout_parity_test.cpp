// Data and tensor parallelism end to end with real processes: N
// keel-trainer ranks rendezvous through an embedded Store and run their
// collectives over Gloo, and every layout must reproduce the single-rank
// run (docs/architecture.md "Parallel layout and communication": the single-rank run of the same config is the oracle
// for every layout). The same runs are held against the closed-form byte
// counts and memory of each ZeRO stage and of TP.
#include "tests/support/process.h"
#include "tests/support/rank_launcher.h"
#include "tests/support/temp_dir.h"
#include "tests/support/wait.h"
#include "common/config.h"
#include "tests/trainer/comm_formulas.h"
#include "tests/trainer/trainer_runs.h"
#include "trainer/model/parameters.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <csignal>
#include <fstream>
#include <map>

namespace fs = std::filesystem;

namespace {

using keel::test::Layout;
using keel::test::Run;
using Fixture = keel::test::TrainerRuns;

// Every global tensor of a gradient dump, assembled from the ranks' pieces.
using Tensors = std::map<std::string, std::vector<double>>;

Tensors read_gradients(const fs::path& dir) {
  Tensors tensors;
  std::map<std::string, std::vector<int>> covered;
  for (const auto& file : fs::directory_iterator(dir)) {
    std::ifstream in(file.path());
    const auto dump = nlohmann::json::parse(in);
    for (const auto& piece : dump.at("pieces")) {
      const std::string name = piece.at("name");
      const auto shape = piece.at("global_shape").get<std::vector<int64_t>>();
      const int64_t cols = shape.size() == 2 ? shape[1] : 1;
      auto& tensor = tensors[name];
      auto& hits = covered[name];
      tensor.resize(static_cast<size_t>(shape[0] * cols));
      hits.resize(tensor.size());
      const auto values = piece.at("values").get<std::vector<double>>();
      const int64_t rows = piece.at("rows"), piece_cols = piece.at("cols");
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < piece_cols; ++c) {
          const size_t at = static_cast<size_t>((piece.at("row").get<int64_t>() + r) * cols + piece.at("col").get<int64_t>() + c);
          const double value = values[static_cast<size_t>(r * piece_cols + c)];
          // Ranks holding the same element (replicas) must hold the same bits.
          if (hits[at] != 0 && tensor[at] != value) {
            FAIL_CHECK(name << "[" << at << "] is " << tensor[at] << " on one rank and " << value << " on another");
          }
          tensor[at] = value;
          hits[at] = 1;
        }
      }
    }
  }
  for (const auto& [name, hits] : covered) {
    CAPTURE(name);
    CHECK(std::count(hits.begin(), hits.end(), 0) == 0);  // some rank holds every element
  }
  return tensors;
}

double relative(double got, double want) { return std::fabs(got - want) / std::fabs(want); }

void check_parity(const Fixture& f, const Run& reference, const std::string& reference_name, const Run& parallel,
                  const std::string& parallel_name) {
  REQUIRE(parallel.losses.size() == reference.losses.size());
  for (size_t s = 0; s < reference.losses.size(); ++s) {
    CAPTURE(s);
    CHECK(relative(parallel.losses[s], reference.losses[s]) <= 1e-5);
    CHECK(relative(parallel.grad_norms[s], reference.grad_norms[s]) <= 1e-4);
  }
  CHECK(relative(parallel.val_loss, reference.val_loss) <= 1e-5);
  // Every gradient of step 1, tensor by tensor: |g - g_ref| / |g_ref| in
  // the 2-norm, since single elements near zero have no useful relative error.
  const Tensors want = read_gradients(f.dir() / reference_name / "grads");
  const Tensors got = read_gradients(f.dir() / parallel_name / "grads");
  REQUIRE(got.size() == want.size());
  for (const auto& [name, w] : want) {
    CAPTURE(name);
    const auto& g = got.at(name);
    REQUIRE(g.size() == w.size());
    double diff = 0, norm = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      diff += (g[i] - w[i]) * (g[i] - w[i]);
      norm += w[i] * w[i];
    }
    CHECK(std::sqrt(diff) <= 1e-5 * std::sqrt(norm) + 1e-12);
  }
}

// Bytes each rank holds for parameters, gradients and AdamW state, within
// 5% of the fp32 ZeRO formulas over the P parameters of its TP slice:
// parameters 4P (4P/dp at ZeRO-3), gradients 4P (4P/dp from ZeRO-2),
// moments 8P (8P/dp from ZeRO-1).
void check_memory(const Fixture& f, const Layout& layout, const Run& run, const std::vector<std::string>& sets) {
  const auto config = f.config(sets);
  for (int r = 0; r < layout.world(); ++r) {
    CAPTURE(r);
    const double P = static_cast<double>(keel::trainer::ParameterTable(config.model, r % layout.tp, layout.tp).parameter_count());
    const double dp = layout.dp;
    const double params = layout.zero >= 3 ? 4 * P / dp : 4 * P;
    const double grads = layout.zero >= 2 ? 4 * P / dp : 4 * P;
    const double optimizer = layout.zero >= 1 ? 8 * P / dp : 8 * P;
    const auto memory = keel::test::last_json_line(run.outputs[static_cast<size_t>(r)]).at("memory");
    CHECK(relative(memory.at("params_bytes").get<double>(), params) <= 0.05);
    CHECK(relative(memory.at("grads_bytes").get<double>(), grads) <= 0.05);
    CHECK(relative(memory.at("optimizer_bytes").get<double>(), optimizer) <= 0.05);
    // The one allocation holds all three and the activations.
    CHECK(memory.at("total_bytes").get<double>() > params + grads + optimizer);
  }
}

// Every meaningful ZeRO stage of a layout (ZeRO needs a DP group), plus
// runs with two microbatches unless the model's loss depends on how a batch
// is split, against the reference layout (the single rank unless said
// otherwise); `extra` overrides apply to every run.
void check_layout(int dp, int tp, const std::vector<std::string>& extra = {}, Layout reference_layout = {},
                  bool microbatches_change_the_loss = false) {
  Fixture f;
  const Run reference = f.run(reference_layout, "reference", extra);
  REQUIRE(reference.losses.size() == 20);
  std::vector<Layout> layouts;
  for (int zero = 0; zero <= (dp > 1 ? 3 : 0); ++zero) layouts.push_back(Layout{dp, tp, zero, 1});
  if (!microbatches_change_the_loss) {
    layouts.push_back(Layout{dp, tp, 0, 2});
    if (dp > 1) layouts.push_back(Layout{dp, tp, 3, 2});
  }
  for (const Layout& layout : layouts) {
    if (layout.name() == reference_layout.name()) continue;
    CAPTURE(layout.name());
    const Run run = f.run(layout, layout.name(), extra);
    check_parity(f, reference, "reference", run, layout.name());
    check_memory(f, layout, run, extra);
  }
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("DP2 with ZeRO 0 to 3 reproduces the single-rank losses and gradients and holds the ZeRO memory") {
    check_layout(2, 1);
  }
  TEST_CASE("DP4 with ZeRO 0 to 3 reproduces the single-rank losses and gradients and holds the ZeRO memory") {
    check_layout(4, 1);
  }
  TEST_CASE("DP3 with ZeRO 0 to 3 on shards of uneven rows reproduces the single-rank losses and gradients") {
    // 32-row tensors split 11 + 11 + 10.
    check_layout(3, 1, {"train.batch_size=6"});
  }
  TEST_CASE("a MoE model under DP2 with ZeRO 1 to 3 reproduces its ZeRO-0 run") {
    // The load-balancing loss is computed per rank and microbatch, so the
    // DP2 run at ZeRO-0 is the reference here, not the single rank. The
    // router has 4 rows, so a DP4 rank would own 1; block units differ.
    check_layout(2, 1, {"model.n_expert=4", "model.top_k=2", "model.moe_every=2"}, Layout{2, 1, 0, 1}, true);
  }
  TEST_CASE("TP2 with sequence parallelism reproduces the single-rank losses and gradients") { check_layout(1, 2); }
  TEST_CASE("TP4 with sequence parallelism reproduces the single-rank losses and gradients") { check_layout(1, 4); }
  TEST_CASE("DP2 x TP2 with ZeRO 0 to 3 reproduces the single-rank losses and gradients and holds the memory") {
    check_layout(2, 2);
  }

  TEST_CASE("two runs of DP2 x TP2 with ZeRO-3 are bit-identical") {
    Fixture f;
    const Layout layout{2, 2, 3, 2};
    CHECK(f.run(layout, "a").exact == f.run(layout, "b").exact);
  }

  TEST_CASE("overlapping the DP collectives with compute changes no bit at any ZeRO stage") {
    // The same collectives in the same order, only waited for later: the
    // same sums. Two microbatches, so that ZeRO-2 and 3 reduce-scatter
    // every microbatch and stages 0 and 1 sum only in the last.
    Fixture f;
    for (int zero = 0; zero <= 3; ++zero) {
      CAPTURE(zero);
      const Layout layout{3, 1, zero, 2};
      const std::vector<std::string> sets = {"train.steps=6", "train.batch_size=6"};
      auto serial = sets;
      serial.push_back("parallel.overlap_comm=false");
      const Run overlapped = f.run(layout, layout.name() + "-overlapped", sets);
      const Run waited = f.run(layout, layout.name() + "-waited", serial);
      REQUIRE(overlapped.losses.size() == 6);
      CHECK(overlapped.exact == waited.exact);
      for (const auto& record : overlapped.records) {
        const auto& dp = record.at("comm_ms").at("dp");
        CHECK(dp.at("exposed").get<double>() >= 0);
        CHECK(dp.at("busy").get<double>() > 0);
      }
    }
  }

  TEST_CASE("a step's byte counters equal the formulas of every ZeRO stage and of TP") {
    Fixture f;
    for (const Layout& layout : {Layout{2, 1, 0}, Layout{2, 1, 1}, Layout{2, 1, 2}, Layout{2, 1, 3}, Layout{4, 1, 3},
                                 Layout{1, 2, 0}, Layout{1, 4, 0}, Layout{2, 2, 1}, Layout{2, 2, 3}}) {
      CAPTURE(layout.name());
      const auto formula = keel::test::step_comm_formula(f.config(), layout.dp, layout.tp, layout.zero);
      const Run run = f.run(layout, layout.name(), {"train.steps=3", "train.val_every=0"});
      REQUIRE(run.records.size() == 3);
      for (const auto& record : run.records) {
        CAPTURE(record.dump());
        CAPTURE(formula.dump());
        CHECK(record.at("comm") == formula);
      }
    }
  }

  TEST_CASE("a rank killed mid-step makes every survivor exit 12 within the timeout and dump its flight recorder") {
    // DP3, and DP2 x TP2, where the rank diagonal to the killed one shares
    // no group with it and learns of the failure from the ranks that do.
    for (const Layout& layout : {Layout{3, 1, 0}, Layout{2, 2, 3}}) {
      CAPTURE(layout.name());
      Fixture f;
      const double timeout_s = 5;
      auto sets = layout.sets();
      sets.insert(sets.end(), {"train.batch_size=" + std::to_string(2 * layout.dp), "train.steps=1000000",
                               "train.val_every=0", "parallel.timeout_s=" + std::to_string(timeout_s)});
      keel::test::RankLauncher ranks(layout.world(), f.argv("killed", sets), {{"SPDLOG_LEVEL", "warn"}});
      const fs::path metrics = f.dir() / "killed" / "metrics.jsonl";
      REQUIRE(keel::test::wait_until([&] { return keel::test::complete_lines(metrics) >= 3; }, 120));
      const int victim = 1;
      const auto killed_at = std::chrono::steady_clock::now();
      ranks.rank(victim).signal(SIGKILL);
      for (int r = 0; r < layout.world(); ++r) {
        if (r == victim) continue;
        CAPTURE(r);
        auto result = ranks.rank(r).wait(timeout_s + 30);
        const double after = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
        CAPTURE(result.output);
        CHECK(result.exit_code == 12);
        CHECK(after <= timeout_s + 5);
        const fs::path dump = f.dir() / "killed" / "flight" / ("rank-0000" + std::to_string(r) + ".json");
        REQUIRE(fs::exists(dump));
        std::ifstream in(dump);
        auto flight = nlohmann::json::parse(in);
        CHECK_FALSE(flight.dump().find("failed") == std::string::npos);
      }
      CHECK(ranks.rank(victim).wait(5).exit_code == 128 + SIGKILL);
    }
  }
}
