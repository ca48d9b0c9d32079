// The ranks keeld starts (daemon/rank_set.h), seen by a fake trainer that
// only writes down what it was given: on a node of a many-node job each
// rank is told its global rank in the generation's world, its local rank,
// the node's address and the generation's layout after the config's own
// overrides, and the detectors know it by its global rank; in a CUDA job
// each gets its own GPU.
#include "daemon/rank_set.h"

#include <doctest/doctest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <fstream>
#include <sstream>

#include "tests/support/temp_dir.h"

namespace {

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Options for two ranks of `trainer_script`, a shell script in `dir`.
keel::daemon::RankSetOptions two_fake_ranks(const keel::test::TempDir& dir, const std::string& trainer_script) {
  const auto trainer = dir.write("fake-trainer", "#!/bin/sh\n" + trainer_script + "\n");
  chmod(trainer.c_str(), 0755);
  std::filesystem::create_directories(dir / "run" / "logs");
  keel::daemon::RankSetOptions options;
  options.ranks = 2;
  options.trainer = trainer;
  options.config_path = dir / "job.toml";
  options.run_dir = dir / "run";
  options.pin_cpus = false;
  return options;
}

// Starts generation `generation` in `slice` and waits for every rank to exit.
void run_ranks(keel::daemon::RankSet& ranks, int64_t generation, const keel::daemon::RankSlice& slice) {
  REQUIRE_FALSE(ranks.spawn(generation, slice).has_value());
  for (const auto& rank : ranks.ranks()) {
    int status = 0;
    REQUIRE(waitpid(rank.pid, &status, 0) == rank.pid);
    ranks.reap(rank.pid, status);
  }
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("a node's ranks get their global ranks the node's address and the generation's layout") {
    keel::test::TempDir dir;
    auto options = two_fake_ranks(dir,
                                  "echo \"$KEEL_RANK $KEEL_WORLD_SIZE $KEEL_LOCAL_RANK $KEEL_LOCAL_WORLD_SIZE "
                                  "$KEEL_BIND_ADDRESS $KEEL_GENERATION $*\" > \"$KEEL_RUN_DIR/rank-$KEEL_LOCAL_RANK\"");
    options.overrides = {"train.lr=0.1"};
    options.bind_address = "10.0.0.7";
    keel::daemon::RankSet ranks(options);
    run_ranks(ranks, 5, {4, 6, {"parallel.dp=3", "parallel.micro_batches=2"}});
    const std::string args =
        (dir / "job.toml").string() + " --set train.lr=0.1 --set parallel.dp=3 --set parallel.micro_batches=2\n";
    CHECK(read_file(dir / "run" / "rank-0") == "4 6 0 2 10.0.0.7 5 --config " + args);
    CHECK(read_file(dir / "run" / "rank-1") == "5 6 1 2 10.0.0.7 5 --config " + args);
    // A rank's failure names it by its global rank, as the other nodes know it.
    CHECK(ranks.exit_cause(1, 137) == "rank 5 killed by SIGKILL");
    // Each rank's log is named by its global rank, as the events name it.
    CHECK(std::filesystem::exists(dir / "run" / "logs" / "rank-00004.log"));
    CHECK(std::filesystem::exists(dir / "run" / "logs" / "rank-00005.log"));
    CHECK_FALSE(std::filesystem::exists(dir / "run" / "logs" / "rank-00000.log"));
    // The detectors take each rank under the number its board says.
    const auto samples = ranks.samples();
    REQUIRE(samples.size() == 2);
    CHECK(samples[0].rank == 4);
    CHECK(samples[1].rank == 5);
  }

  TEST_CASE("each rank finds its own snapshot area on descriptor 3 and the same one in the next generation") {
    keel::test::TempDir dir;
    // What the rank sees: the variables, and the area's name and inode.
    auto options =
        two_fake_ranks(dir,
                       "echo \"$KEEL_SNAPSHOT_FD $KEEL_SNAPSHOT_BUDDY $(readlink /proc/self/fd/3) $(stat -L "
                       "-c %i /proc/self/fd/3)\" > \"$KEEL_RUN_DIR/area-$KEEL_LOCAL_RANK-$KEEL_GENERATION\"");
    options.snapshot_areas = true;
    options.snapshot_buddy = true;
    keel::daemon::RankSet ranks(options);
    run_ranks(ranks, 0, {0, 2, {}});
    run_ranks(ranks, 1, {0, 2, {}});
    std::vector<std::string> seen;
    for (int generation = 0; generation < 2; ++generation) {
      for (int rank = 0; rank < 2; ++rank) {
        seen.push_back(read_file(dir / "run" / ("area-" + std::to_string(rank) + "-" + std::to_string(generation))));
        CAPTURE(seen.back());
        CHECK(seen.back().starts_with("3 1 /memfd:keel-snapshot-rank-" + std::to_string(rank) + " "));
      }
    }
    CHECK(seen[0] == seen[2]);  // rank 0's area outlived its first process
    CHECK(seen[1] == seen[3]);
    CHECK(seen[0] != seen[1]);  // and is its own
  }

  TEST_CASE("every rank of a CUDA job is started with its own GPU as CUDA_VISIBLE_DEVICES") {
    keel::test::TempDir dir;
    auto options = two_fake_ranks(dir, "echo \"$CUDA_VISIBLE_DEVICES\" > \"$KEEL_RUN_DIR/gpu-$KEEL_RANK\"");
    options.gpus = {"3", "GPU-5e"};
    keel::daemon::RankSet ranks(options);
    run_ranks(ranks, 0, {0, 2, {}});
    CHECK(read_file(dir / "run" / "gpu-0") == "3\n");
    CHECK(read_file(dir / "run" / "gpu-1") == "GPU-5e\n");
  }
}
