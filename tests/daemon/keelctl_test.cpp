// keelctl's checkpoint commands as an operator runs them: the real binary
// on a run directory, tables and --json, and bad input with exit 2.
#include "checkpoint/paths.h"
#include "tests/support/checkpoint_fixture.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <fstream>

namespace fs = std::filesystem;

namespace {

keel::test::ProcessResult keelctl(std::vector<std::string> args) {
  args.insert(args.begin(), keel::test::keel_binary("keelctl").string());
  return keel::test::run_process(args);
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("keelctl lists verifies inspects and prunes the checkpoints of a run directory") {
    keel::test::TempDir run;
    keel::test::write_fixture_checkpoints(run / "checkpoints", {4, 8, 12});
    fs::create_directories(run / "checkpoints" / "step_00000016.partial");
    const std::string dir = run.path().string();

    auto list = keelctl({"checkpoint", "list", "--run-dir", dir, "--json"});
    REQUIRE(list.exit_code == 0);
    const auto rows = nlohmann::json::parse(list.output).at("checkpoints");
    REQUIRE(rows.size() == 4);
    CHECK(rows[0].at("step") == 4);
    CHECK(rows[0].at("status") == "committed");
    CHECK(rows[3].at("status").get<std::string>().find("incomplete") != std::string::npos);
    // No keeld runs this job: no in-memory snapshots, and a sentence why.
    const auto listed = nlohmann::json::parse(list.output);
    CHECK(listed.at("snapshots").is_null());
    CHECK(listed.at("snapshots_absent").get<std::string>().find("no keeld answers at") != std::string::npos);
    const auto table = keelctl({"checkpoint", "list", "--run-dir", dir});
    CHECK(table.output.find("STEP") != std::string::npos);
    CHECK(table.output.find("dp1 tp1 zero0") != std::string::npos);

    CHECK(keelctl({"checkpoint", "verify", "--run-dir", dir, "--all"}).exit_code == 0);

    auto inspect = keelctl({"checkpoint", "inspect", "--run-dir", dir, "--step", "8", "--tensor", "model/w", "--limit",
                            "0", "--json"});
    REQUIRE(inspect.exit_code == 0);
    const auto tensor = nlohmann::json::parse(inspect.output);
    CHECK(tensor.at("shape") == nlohmann::json::array({6, 5}));
    CHECK(tensor.at("dtype") == "float32");
    const auto values = tensor.at("values").get<std::vector<float>>();
    REQUIRE(values.size() == 30);
    CHECK(values[7] == keel::test::fixture_value(0, 1, 2, 8));
    auto names = keelctl({"checkpoint", "inspect", "--run-dir", dir});
    CHECK(names.output.find("model/b") != std::string::npos);

    // A flipped bit: verify exits 1 and names the file.
    const fs::path victim = keel::checkpoint::step_dir(run / "checkpoints", 12) / "rank-00000.h5";
    {
      std::fstream io(victim, std::ios::in | std::ios::out | std::ios::binary);
      io.seekp(static_cast<std::streamoff>(fs::file_size(victim) - 10));
      io.put('\x55');
    }
    auto verify = keelctl({"checkpoint", "verify", "--run-dir", dir});
    CHECK(verify.exit_code == 1);
    CHECK(verify.output.find("rank-00000.h5") != std::string::npos);

    auto dry = keelctl({"checkpoint", "prune", "--run-dir", dir, "--keep", "1", "--dry-run", "--json"});
    CHECK(nlohmann::json::parse(dry.output).at("removed_steps") == nlohmann::json::array({4, 8}));
    CHECK(fs::exists(keel::checkpoint::step_dir(run / "checkpoints", 4)));
    CHECK(keelctl({"checkpoint", "prune", "--run-dir", dir, "--keep", "1"}).exit_code == 0);
    CHECK_FALSE(fs::exists(keel::checkpoint::step_dir(run / "checkpoints", 4)));
    CHECK(fs::exists(keel::checkpoint::step_dir(run / "checkpoints", 12)));
  }

  TEST_CASE("keelctl answers bad input with exit 2 and a sentence") {
    keel::test::TempDir run;
    keel::test::write_fixture_checkpoints(run / "checkpoints", {4});
    const std::string dir = run.path().string();
    struct Row {
      std::vector<std::string> args;
      const char* expected;
    };
    const Row rows[] = {
        {{"checkpoint", "list"}, "exactly one of --run-dir and --checkpoints"},
        {{"checkpoint", "list", "--run-dir", dir, "--checkpoints", dir}, "exactly one of"},
        {{"checkpoint", "list", "--run-dir", dir + "/nowhere"}, "is not a directory"},
        {{"checkpoint", "verify", "--run-dir", dir, "--step", "99"}, "no committed checkpoint of step 99"},
        {{"checkpoint", "inspect", "--run-dir", dir, "--tensor", "model/nope"}, "has no tensor model/nope"},
        {{"checkpoint", "prune", "--run-dir", dir, "--keep", "0"}, "--keep must be at least 1"},
        {{"checkpoint", "frobnicate"}, ""},
        {{"nonsense"}, ""},
        {{"checkpoint", "verify", "--run-dir", dir, "--step", "x"}, ""},
    };
    for (const Row& row : rows) {
      CAPTURE(row.args.back());
      const auto result = keelctl(row.args);
      CAPTURE(result.output);
      CHECK(result.exit_code == 2);
      CHECK(result.output.find(row.expected) != std::string::npos);
    }
  }
}
