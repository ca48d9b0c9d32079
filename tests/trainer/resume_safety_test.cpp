// A run's state is never lost or forged on resume (docs/architecture.md
// "Resume and retention"), with real keel-trainer processes: no silent
// start from step 0, no fallback past a read error, no update or
// checkpoint from non-finite numbers, no load of a model of another shape,
// a history that survives a crash while it is rewritten, ranks that agree
// on the final commit, and a peer failure that never leaves rank 0 waiting.
#include "checkpoint/catalog.h"
#include "checkpoint/paths.h"
#include "store/store.h"
#include "tests/support/checkpoint_fixture.h"
#include "tests/support/process.h"
#include "tests/trainer/trainer_runs.h"

#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <map>
#include <sstream>

namespace fs = std::filesystem;
using keel::test::Layout;
using keel::test::TrainerRuns;

namespace {

const std::vector<std::string> kEvery4 = {"train.steps=8", "train.val_every=0", "checkpoint.every_steps=4"};

fs::path checkpoint_dir(const TrainerRuns& f, const std::string& run) { return f.dir() / run / "checkpoints"; }

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void flip_a_byte(const fs::path& file) {
  std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
  io.seekp(static_cast<std::streamoff>(fs::file_size(file) / 2));
  io.put('\x5a');
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("a run whose checkpoints all fail to load exits 13 naming each and keeps its history") {
    TrainerRuns f;
    f.run(Layout{}, "run", kEvery4);
    for (int64_t step : {4, 8}) flip_a_byte(keel::checkpoint::step_dir(checkpoint_dir(f, "run"), step) / "rank-00000.h5");
    const std::string history = read_file(f.dir() / "run" / "metrics.jsonl");

    const auto refused = keel::test::run_process(f.argv("run", {"train.steps=12", "checkpoint.every_steps=4"}),
                                                 {{"SPDLOG_LEVEL", "warn"}});
    CAPTURE(refused.output);
    CHECK(refused.exit_code == 13);
    CHECK(refused.output.find("step_00000004") != std::string::npos);
    CHECK(refused.output.find("step_00000008") != std::string::npos);
    CHECK(refused.output.find("init_from") != std::string::npos);
    CHECK(read_file(f.dir() / "run" / "metrics.jsonl") == history);
    CHECK(keel::test::committed_steps(checkpoint_dir(f, "run")) == std::vector<int64_t>{4, 8});

    // Starting over is an explicit choice, and it is recorded.
    const auto over = f.run(Layout{}, "run", {"train.steps=4", "train.val_every=0", "checkpoint.every_steps=4"},
                            {"--init-from", "none"});
    CHECK(over.records.front().at("step") == 0);
    CHECK(keel::test::count_events(f.dir() / "run", "resume_overridden") == 1);
  }

  TEST_CASE("a checkpoint that cannot be read is not skipped and nothing is trained over it") {
    if (geteuid() != 0) {
      MESSAGE("skipped: needs root to run a rank as another user, for whom a file can be unreadable");
      return;
    }
    TrainerRuns f;
    f.run(Layout{}, "run", kEvery4);
    const fs::path newest = keel::checkpoint::step_dir(checkpoint_dir(f, "run"), 8);
    // The rank runs as nobody: the run directory is its own, but the newest
    // checkpoint's rank file is mode 000, so reading it fails with EACCES.
    fs::permissions(f.dir(), fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                                 fs::perms::others_read | fs::perms::others_exec);
    for (const auto& entry : fs::recursive_directory_iterator(f.dir() / "run")) {
      REQUIRE(::chown(entry.path().c_str(), 65534, 65534) == 0);
    }
    REQUIRE(::chown((f.dir() / "run").c_str(), 65534, 65534) == 0);
    fs::permissions(newest / "rank-00000.h5", fs::perms::none);
    const std::string history = read_file(f.dir() / "run" / "metrics.jsonl");

    auto argv = f.argv("run", {"train.steps=12", "checkpoint.every_steps=4"});
    argv.insert(argv.begin(), {"setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"});
    const auto result = keel::test::run_process(argv, {{"SPDLOG_LEVEL", "warn"}});
    CAPTURE(result.output);
    CHECK(result.exit_code == 13);
    CHECK(result.output.find("cannot read checkpoint") != std::string::npos);
    CHECK(result.output.find("step_00000008") != std::string::npos);
    CHECK(read_file(f.dir() / "run" / "metrics.jsonl") == history);
    CHECK(keel::test::count_events(f.dir() / "run", "checkpoint_skipped") == 0);
  }

  TEST_CASE("a non-finite loss or gradient is never applied nor checkpointed and every rank exits 11") {
    for (const char* target : {"gradient", "loss"}) {
      CAPTURE(target);
      TrainerRuns f;
      // Rank 1's step 5 turns NaN; saves come every 2 steps.
      const auto run = f.run(Layout{2}, "run",
                             {"train.steps=12", "train.val_every=0", "checkpoint.every_steps=2", "faults.nan_rank=1",
                              "faults.nan_step=5", std::string("faults.nan_target=") + target},
                             {}, 11);
      for (const auto& output : run.outputs) CHECK(output.find("not applied") != std::string::npos);
      CHECK(run.records.size() == 5);  // steps 0-4; step 5 never completed
      CHECK(keel::test::committed_steps(checkpoint_dir(f, "run")) == std::vector<int64_t>{2, 4});
      for (const auto& entry : keel::checkpoint::committed(checkpoint_dir(f, "run"))) {
        for (const auto& [name, values] : keel::test::all_tensors(entry.dir)) {
          CAPTURE(name);
          CHECK(std::all_of(values.begin(), values.end(), [](float v) { return std::isfinite(v); }));
        }
      }
    }
  }

  TEST_CASE("a checkpoint of another model shape is refused with exit 2 naming the tensor and the key") {
    TrainerRuns f;
    f.run(Layout{}, "base", {"train.steps=4", "train.val_every=0", "checkpoint.every_steps=4"});
    const std::string saved = keel::checkpoint::step_dir(checkpoint_dir(f, "base"), 4).string();
    struct Change {
      const char* set;
      const char* key;
    };
    const Change changes[] = {{"model.n_embd=16", "model.n_embd"},      {"model.seq_len=16", "model.seq_len"},
                              {"model.vocab_size=512", "model.vocab_size"}, {"model.n_layer=1", "model.n_layer"},
                              {"model.n_layer=3", "model.n_layer"}};
    int i = 0;
    for (const Change& c : changes) {
      CAPTURE(c.set);
      const std::string run = "changed" + std::to_string(i++);
      const auto resumed = keel::test::run_process(
          f.argv(run, {c.set, "train.steps=8", "checkpoint.every_steps=4"}, {"--init-from", saved}),
          {{"SPDLOG_LEVEL", "warn"}});
      CAPTURE(resumed.output);
      CHECK(resumed.exit_code == 2);
      CHECK(resumed.output.find("does not fit this model") != std::string::npos);
      CHECK(resumed.output.find(c.key) != std::string::npos);
      CHECK(resumed.output.find("/model/") != std::string::npos);
      const auto evaluated = keel::test::run_process(
          f.argv(run, {c.set}, {"--eval", saved, "--eval-data", (f.dir() / "train.bin").string()}),
          {{"SPDLOG_LEVEL", "warn"}});
      CAPTURE(evaluated.output);
      CHECK(evaluated.exit_code == 2);
      CHECK(evaluated.output.find(c.key) != std::string::npos);
    }
  }

  TEST_CASE("a GPT-2 checkpoint met by a Llama run and the reverse are refused with exit 2 naming the tensor") {
    // Resuming in place: the run directory holds the other family's
    // checkpoint, and after the refusal it holds exactly what it held.
    TrainerRuns f;
    const std::vector<std::string> saved = {"train.steps=4", "train.val_every=0", "checkpoint.every_steps=4"};
    const std::vector<std::string> llama = {"model.arch=llama", "model.n_kv_head=2", "model.ffn_hidden=64"};
    std::vector<std::string> llama_saved = saved;
    llama_saved.insert(llama_saved.end(), llama.begin(), llama.end());
    f.run(Layout{}, "gpt2", saved);
    f.run(Layout{}, "llama", llama_saved);
    auto listing = [&](const std::string& run) {
      std::map<std::string, std::string> files;
      for (const auto& entry : fs::recursive_directory_iterator(f.dir() / run)) {
        if (entry.is_regular_file()) files[entry.path().string()] = read_file(entry.path());
      }
      return files;
    };
    struct Case {
      std::string run;
      std::vector<std::string> sets;
      const char* first_missing;  // the first tensor of the new model the checkpoint lacks
    };
    std::vector<std::string> as_llama = llama, as_gpt2 = {"model.arch=gpt2"};
    as_llama.push_back("train.steps=8");
    as_gpt2.push_back("train.steps=8");
    for (const Case& c : {Case{"gpt2", as_llama, "model.embed_tokens.weight"},
                          Case{"llama", as_gpt2, "/model/wte is missing"}}) {
      CAPTURE(c.run);
      const auto before = listing(c.run);
      const auto resumed = keel::test::run_process(f.argv(c.run, c.sets), {{"SPDLOG_LEVEL", "warn"}});
      CAPTURE(resumed.output);
      CHECK(resumed.exit_code == 2);
      CHECK(resumed.output.find(c.first_missing) != std::string::npos);
      CHECK(resumed.output.find("model.arch is") != std::string::npos);
      CHECK(listing(c.run) == before);
    }
  }

  TEST_CASE("metrics.jsonl is replaced by a new file on resume and never rewritten in place") {
    TrainerRuns f;
    f.run(Layout{}, "run", {"train.steps=12", "train.val_every=0", "checkpoint.every_steps=4"}, {"--stop-after", "6"},
          14);
    const fs::path metrics = f.dir() / "run" / "metrics.jsonl";
    // A hard link keeps the old file's inode: had the resume rewritten it in
    // place, a crash halfway would have lost the history this link shows.
    fs::create_hard_link(metrics, f.dir() / "old-metrics.jsonl");
    const std::string before = read_file(metrics);
    const auto resumed = f.run(Layout{}, "run", {"train.steps=12", "train.val_every=0", "checkpoint.every_steps=4"});
    CHECK(read_file(f.dir() / "old-metrics.jsonl") == before);
    CHECK(fs::hard_link_count(metrics) == 1);
    REQUIRE(resumed.records.size() == 12);
    for (size_t s = 0; s < resumed.records.size(); ++s) CHECK(resumed.records[s].at("step") == static_cast<int>(s));
  }

  TEST_CASE("when the final checkpoint cannot be committed every rank exits 13") {
    TrainerRuns f;
    auto argv = f.argv("run", [] {
      auto sets = Layout{2}.sets();
      sets.insert(sets.end(), {"train.steps=6", "train.val_every=0", "checkpoint.every_steps=100"});
      return sets;
    }());
    // The gradient dump would meet the limit first.
    const auto dump = std::find(argv.begin(), argv.end(), "--dump-gradients");
    argv.erase(dump, dump + 2);
    // Only rank 0's file cannot be written (a file-size limit below it): rank
    // 1 wrote its own and learns the outcome from rank 0 alone.
    keel::test::RankLauncher ranks(
        2,
        [&](int rank) {
          auto limited = argv;
          if (rank == 0) limited.insert(limited.begin(), {"prlimit", "--fsize=60000", "--"});
          return limited;
        },
        {{"SPDLOG_LEVEL", "warn"}});
    for (const auto& result : ranks.wait_all(300)) {
      CAPTURE(result.output);
      CHECK(result.exit_code == 13);
    }
    CHECK(keel::test::count_events(f.dir() / "run", "checkpoint_abandoned") == 1);
    CHECK(keel::checkpoint::committed(checkpoint_dir(f, "run")).empty());
  }

  TEST_CASE("a peer that dies during a save makes rank 0 abandon the commit at once and exit 12") {
    TrainerRuns f;
    // Rank 1 is killed after writing its file of step 4 and before
    // reporting it; rank 0 would otherwise wait checkpoint.timeout_s.
    keel::test::RankLauncher ranks(
        2,
        f.argv("run", [] {
          auto sets = Layout{2}.sets();
          sets.insert(sets.end(), {"train.steps=12", "train.val_every=0", "checkpoint.every_steps=4",
                                   "checkpoint.timeout_s=3600", "faults.crash_rank=1", "faults.crash_step=4",
                                   "faults.crash_in=save"});
          return sets;
        }()),
        {{"SPDLOG_LEVEL", "warn"}});
    // keeld's part: it reaps the dead rank and tells the Store.
    const auto victim = ranks.rank(1).wait(600);
    CHECK(victim.output.find("saving the checkpoint of step 4") != std::string::npos);
    ranks.connect_store()->set(keel::store::rank_failed_key(0), "rank 1 killed by SIGKILL");
    const auto survivor = ranks.rank(0).wait(600);
    CAPTURE(survivor.output);
    CHECK(survivor.exit_code == 12);
    CHECK(fs::exists(f.dir() / "run" / "flight" / "rank-00000.json"));
    CHECK(keel::test::committed_steps(checkpoint_dir(f, "run")).empty());
    bool cancelled = false;
    for (const auto& e : keel::test::events(f.dir() / "run")) {
      if (e.at("kind") == "checkpoint_abandoned") cancelled = e.at("cause").get<std::string>().find("cancelled") != std::string::npos;
    }
    CHECK(cancelled);
  }

  TEST_CASE("a save that cannot fit on its filesystem fails before HDF5 writes and training goes on") {
    TrainerRuns f;
    const fs::path small = f.dir() / "small";
    keel::test::SmallTmpfs tmpfs(small, "128k");
    if (!tmpfs.mounted()) {
      MESSAGE("skipped: " << tmpfs.why());
      return;
    }
    const auto result = keel::test::run_process(
        f.argv("run", {"train.steps=12", "train.val_every=0", "checkpoint.every_steps=4",
                       "checkpoint.dir=" + small.string()}),
        {{"SPDLOG_LEVEL", "warn"}});
    CAPTURE(result.output);
    CHECK(result.exit_code == 13);  // every save, the final one included, failed
    CHECK(keel::test::last_json_line(result.output).at("steps") == 12);
    int no_room = 0;
    for (const auto& e : keel::test::events(f.dir() / "run")) {
      if (e.at("kind") == "checkpoint_abandoned") no_room += e.at("cause").get<std::string>().find("no room") != std::string::npos;
    }
    CHECK(no_room == 3);
    CHECK(fs::is_empty(small));
  }
}
