// keel-trainer's BLAS core at start (trainer/train/blas_core_start.h), on
// real processes: the operator's OPENBLAS_CORETYPE is respected, a core the
// config names is run by re-executing, "library" never re-executes, a core
// that fails the known-answer test gives way to the library's while
// training goes on, and "auto" never leaves this machine on kernels older
// than its CPU runs.
#include "common/blas_core.h"
#include "tests/support/process.h"
#include "tests/trainer/trainer_runs.h"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>

namespace {

using keel::test::TrainerRuns;

struct Start {
  std::string output;
  nlohmann::json summary;  // the --json summary (or the --blas-report object)
};

bool has(const std::string& output, const std::string& text) { return output.find(text) != std::string::npos; }

// keel-trainer for 2 steps with `sets`, `env` added to this process's; the
// logs at info, so the BLAS lines show.
Start start(const TrainerRuns& f, const std::string& name, const std::vector<std::string>& sets,
            std::map<std::string, std::string> env = {}, const std::vector<std::string>& args = {}) {
  std::vector<std::string> all = {"train.steps=2", "train.val_every=0"};
  all.insert(all.end(), sets.begin(), sets.end());
  env["SPDLOG_LEVEL"] = "info";
  const auto result = keel::test::run_process(f.argv(name, all, args), env);
  REQUIRE_MESSAGE(result.exit_code == 0, result.output);
  Start start{result.output, {}};
  std::istringstream lines(result.output);
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty() && line.front() == '{' && has(line, "\"blas\"")) start.summary = nlohmann::json::parse(line);
  }
  REQUIRE_MESSAGE(start.summary.is_object(), result.output);
  return start;
}

keel::common::KernelGeneration cpu_generation() {
  return keel::common::generation_of_cpu(keel::common::CpuFeatures::of_this_cpu());
}

// OpenBLAS's own choice on this machine.
std::string library_core(const TrainerRuns& f) {
  return start(f, "library", {"train.blas_core=library"}).summary.at("blas").at("core").get<std::string>();
}

// A core older than the CPU that OpenBLAS does not choose itself, so that
// naming it takes a re-execution: Prescott, or Sandybridge where OpenBLAS
// itself chooses Prescott (on a VM whose CPU it does not recognise, as the
// 2-core VM's).
std::string older_core_than(const std::string& library) {
  return keel::common::same_core(library, "Prescott") ? "Sandybridge" : "Prescott";
}

// The cases below need a CPU newer than Prescott's kernels and no
// OPENBLAS_CORETYPE of the operator's around the test.
bool can_run(bool needs_unset) {
  if (cpu_generation() == keel::common::KernelGeneration::kOlder) {
    MESSAGE("skipped: this CPU runs no kernel generation newer than Prescott's");
    return false;
  }
  if (needs_unset && std::getenv("OPENBLAS_CORETYPE") != nullptr) {
    MESSAGE("skipped: OPENBLAS_CORETYPE is set around the tests, and keel respects it");
    return false;
  }
  return true;
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("auto never leaves this machine on kernels older than its CPU runs") {
    if (!can_run(true)) return;
    TrainerRuns f;
    const auto s = start(f, "auto", {});
    const auto& blas = s.summary.at("blas");
    MESSAGE("BLAS core " << blas.dump());
    CHECK(keel::common::generation_of_core(blas.at("core").get<std::string>()) >= cpu_generation());
    const bool moved = !keel::common::same_core(blas.at("core").get<std::string>(), blas.at("library_core").get<std::string>());
    CHECK(blas.at("chosen_by") == (moved ? "auto" : "library"));
    CHECK(has(s.output, "re-executing with OPENBLAS_CORETYPE=") == moved);
    CHECK_FALSE(has(s.output, "older than"));
  }

  TEST_CASE("an operator's OPENBLAS_CORETYPE is respected - and an old core is said to be older than the CPU") {
    if (!can_run(false)) return;
    TrainerRuns f;
    const auto s = start(f, "operator", {}, {{"OPENBLAS_CORETYPE", "Prescott"}});
    const auto& blas = s.summary.at("blas");
    CHECK(keel::common::same_core(blas.at("core").get<std::string>(), "Prescott"));
    CHECK(blas.at("chosen_by") == "operator");
    CHECK_FALSE(has(s.output, "re-executing"));
    CHECK(has(s.output, "OPENBLAS_CORETYPE=Prescott chose them"));
    CHECK(has(s.output, "unset it to let train.blas_core = \"auto\" choose"));
  }

  TEST_CASE("a core the config names is run by re-executing - proved - and said to be older than the CPU") {
    if (!can_run(true)) return;
    TrainerRuns f;
    const std::string named = older_core_than(library_core(f));
    const auto s = start(f, "named", {"train.blas_core=" + named});
    const auto& blas = s.summary.at("blas");
    CHECK(keel::common::same_core(blas.at("core").get<std::string>(), named));
    CHECK(blas.at("chosen_by") == "config");
    CHECK(has(s.output, "re-executing with OPENBLAS_CORETYPE=" + named));
    CHECK(has(s.output, "train.blas_core = \"" + named + "\" chose them"));
    CHECK(has(s.output, "BLAS core " + named + " passed the known-answer kernel test"));
    CHECK(s.summary.at("steps") == 2);
  }

  TEST_CASE("library keeps OpenBLAS's own choice without re-executing") {
    if (!can_run(true)) return;
    TrainerRuns f;
    const auto s = start(f, "library", {"train.blas_core=library"});
    const auto& blas = s.summary.at("blas");
    CHECK(blas.at("chosen_by") == "library");
    CHECK(blas.at("core") == blas.at("library_core"));
    CHECK_FALSE(has(s.output, "re-executing"));
    CHECK_FALSE(has(s.output, "passed the known-answer kernel test"));
  }

  TEST_CASE("a core that fails the known-answer test gives way to the library's with an error - and training goes on") {
    if (!can_run(true)) return;
    TrainerRuns f;
    const std::string library = library_core(f), named = older_core_than(library);
    const auto s = start(f, "fallback",
                         {"train.blas_core=" + named, "faults.bitflip_rank=0", "faults.bitflip_target=blas_core"});
    const auto& blas = s.summary.at("blas");
    // The fault landed where meant: in the proof of the core keel chose.
    CHECK(has(s.output, "bitflip_target = blas_core): one GEMM output of the known-answer test"));
    CHECK(has(s.output, "BLAS core " + named + " gave a wrong result in the known-answer kernel test (matmul_forward); "
                        "falling back to OpenBLAS's own choice, " +
                            library));
    CHECK(blas.at("chosen_by") == "fallback");
    CHECK(blas.at("rejected_core") == named);
    CHECK(blas.at("core") == library);
    CHECK(s.summary.at("steps") == 2);
    CHECK(std::isfinite(s.summary.at("final_train_loss").get<double>()));
  }

  TEST_CASE("a core newer than the CPU runs is refused as a bad config") {
    if (cpu_generation() >= keel::common::KernelGeneration::kAvx512Bf16) {
      MESSAGE("skipped: this CPU runs every core keel knows, so none is too new");
      return;
    }
    // An operator's OPENBLAS_CORETYPE overrides the config's core, so the
    // config is never judged under one (a clean clone on an AVX2 machine
    // with OPENBLAS_CORETYPE=Haswell set ran the core it named and exited 0).
    if (!can_run(true)) return;
    TrainerRuns f;
    const auto result = keel::test::run_process(f.argv("newer", {"train.steps=2", "train.blas_core=SapphireRapids"}));
    CHECK(result.exit_code == 2);
    CHECK(has(result.output, "which this CPU does not run"));
  }

  TEST_CASE("--blas-report prints the core and the GEMM ceiling measured on it") {
    TrainerRuns f;
    const auto result = keel::test::run_process(
        {keel::test::keel_binary("keel-trainer").string(), "--config", (f.dir() / "run.toml").string(), "--blas-report"},
        {{"SPDLOG_LEVEL", "warn"}});
    REQUIRE_MESSAGE(result.exit_code == 0, result.output);
    const auto report = keel::test::last_json_line(result.output);
    MESSAGE(report.dump());
    CHECK(report.at("blas").at("core").is_string());
    CHECK(report.at("gemm").at("m") == 1024);
    CHECK(report.at("gemm").at("threads") == 1);
    CHECK(report.at("gemm").at("gflops").get<double>() > 0.1);
  }
}
