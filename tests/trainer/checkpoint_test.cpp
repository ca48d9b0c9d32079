// Checkpoints end to end with real keel-trainer processes (docs/architecture.md "Checkpoints"):
// bit-exact resume, resharding across DP, TP and ZeRO, interoperability
// with h5py and h5dump, corruption, crashes in the middle of saves and a
// full disk.
#include "checkpoint/catalog.h"
#include "checkpoint/manifest.h"
#include "checkpoint/paths.h"
#include "checkpoint/reader.h"
#include "tests/support/wait.h"
#include "trainer/kernels/dtype.h"
#include "tests/trainer/trainer_runs.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <csignal>
#include <fstream>
#include <random>
#include <thread>

namespace fs = std::filesystem;
using keel::test::Layout;
using keel::test::Run;
using keel::test::TrainerRuns;
using keel::test::all_tensors;
using keel::test::count_events;

namespace {

const std::vector<std::string> kEvery4 = {"train.steps=12", "train.val_every=0", "checkpoint.every_steps=4"};

fs::path checkpoint_of(const TrainerRuns& f, const std::string& run, int64_t step) {
  return keel::checkpoint::step_dir(f.dir() / run / "checkpoints", step);
}

std::vector<std::string> digests(const Run& run) {
  std::vector<std::string> out;
  for (const auto& output : run.outputs) out.push_back(keel::test::last_json_line(output).at("parameter_digest"));
  return out;
}

// How long the last committed save took, writing and committing, from
// events.jsonl (whose last line may be being written).
double last_save_seconds(const fs::path& run_dir) {
  double seconds = 0;
  std::ifstream in(run_dir / "events.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto e = nlohmann::json::parse(line, nullptr, false);
    if (!e.is_discarded() && e.value("kind", "") == "checkpoint_committed") {
      seconds = e.at("write_s").get<double>() + e.at("commit_s").get<double>();
    }
  }
  return seconds;
}

// The .partial directories under a checkpoint directory: saves in flight,
// or interrupted.
std::vector<fs::path> partial_dirs(const fs::path& root) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    if (entry.path().extension() == ".partial") out.push_back(entry.path());
  }
  return out;
}

struct Pair {
  Layout a, b;
};

// Each pair: a checkpoint layout a saved after 6 steps continues in layout
// b within 1e-5 of the single rank's steps 6 to 11, and A -> B -> A gives
// back the same bits.
void check_continuations(TrainerRuns& f, const std::vector<Pair>& pairs, const std::vector<std::string>& sets) {
  const Run single = f.run(Layout{}, "single", sets);
  for (const Pair& pair : pairs) {
    const std::string a = "a_" + pair.a.name() + "_" + pair.b.name(), b = "b_" + pair.a.name() + "_" + pair.b.name();
    CAPTURE(a);
    f.run(pair.a, a, sets, {"--stop-after", "6"}, 14);
    const fs::path saved = checkpoint_of(f, a, 6);
    const Run continued = f.run(pair.b, b, sets, {"--init-from", saved.string()});
    REQUIRE(continued.losses.size() == 6);  // steps 6 to 11
    for (size_t s = 0; s < 6; ++s) {
      CAPTURE(s);
      CHECK(std::fabs(continued.losses[s] - single.losses[6 + s]) <= 1e-5 * std::fabs(single.losses[6 + s]));
    }
    // A -> B -> A: B saves what it loaded, A loads that and saves again.
    f.run(pair.b, b + "_rt", sets, {"--init-from", saved.string(), "--stop-after", "6"});
    f.run(pair.a, a + "_rt", sets, {"--init-from", checkpoint_of(f, b + "_rt", 6).string(), "--stop-after", "6"});
    CHECK(all_tensors(checkpoint_of(f, a + "_rt", 6)) == all_tensors(saved));
  }
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("a run stopped and resumed is bit-identical to one that never stopped") {
    for (const Layout& layout : {Layout{}, Layout{2, 2, 1}, Layout{2, 1, 3}, Layout{2, 2, 3, 2},
                                 Layout{.dp = 2, .zero = 1, .micro_batches = 2, .pp = 2}}) {
      CAPTURE(layout.name());
      TrainerRuns f;
      const Run whole = f.run(layout, "whole", kEvery4);
      // Stopped after step 6 (a final checkpoint, exit 14), then started
      // again in the same run directory: it resumes by itself.
      f.run(layout, "resumed", kEvery4, {"--stop-after", "6"}, 14);
      const Run resumed = f.run(layout, "resumed", kEvery4);
      CHECK(keel::test::last_json_line(resumed.outputs[0]).at("first_step") == 6);
      CHECK(resumed.exact == whole.exact);
      CHECK(digests(resumed) == digests(whole));
    }
  }

  TEST_CASE("a checkpoint saved in one layout continues in another and round-trips bit-exactly") {
    const std::vector<Pair> pairs = {{Layout{}, Layout{2, 1, 1}},
                                     {Layout{2, 1, 0}, Layout{1, 2, 0}},
                                     {Layout{1, 2, 0}, Layout{2, 2, 3}},
                                     {Layout{2, 2, 1}, Layout{}},
                                     {Layout{4, 1, 3}, Layout{2, 1, 2}},
                                     {Layout{2, 1, 2}, Layout{1, 4, 0}},
                                     // Across pipeline stages: the tied embedding saved once, loaded by both ends.
                                     {Layout{.micro_batches = 2, .pp = 2}, Layout{}},
                                     {Layout{2, 1, 3}, Layout{.tp = 2, .micro_batches = 2, .pp = 2}},
                                     // Across context parallelism, whose ranks split the positions, not the state.
                                     {Layout{.zero = 2, .cp = 2}, Layout{.micro_batches = 2, .pp = 2}}};
    TrainerRuns f;
    check_continuations(f, pairs, kEvery4);
    // Interleaved, where a stage's blocks are not one range: blocks 0 and 2
    // on stage 0, 1 and 3 on stage 1.
    TrainerRuns four_blocks;
    std::vector<std::string> sets = kEvery4;
    sets.push_back("model.n_layer=4");
    check_continuations(four_blocks, {{Layout{.micro_batches = 2, .pp = 2, .pp_virtual = 2}, Layout{2, 1, 1}}}, sets);
    // keelctl names the layout a checkpoint was saved in.
    const std::string pipeline_run = "a_" + Layout{.micro_batches = 2, .pp = 2}.name() + "_" + Layout{}.name();
    const std::vector<std::string> inspect = {keel::test::keel_binary("keelctl").string(), "checkpoint", "inspect",
                                              "--run-dir", (f.dir() / pipeline_run).string(), "--step", "6"};
    const auto text = keel::test::run_process(inspect);
    CHECK(text.output.find("saved by dp1 tp1 pp2 zero0 (2 ranks)") != std::string::npos);
    auto as_json = inspect;
    as_json.push_back("--json");
    CHECK(keel::test::last_json_line(keel::test::run_process(as_json).output).at("layout").at("pp") == 2);
  }

  TEST_CASE("a Llama checkpoint continues from TP2 to DP2 and from PP2 to one rank and round-trips bit-exactly") {
    // Each TP rank saves its key/value head and its rows of the packed
    // gate and up under the global Hugging Face names.
    std::vector<std::string> sets = kEvery4;
    sets.insert(sets.end(),
                {"model.arch=llama", "model.n_kv_head=2", "model.ffn_hidden=64", "model.tie_embeddings=false"});
    TrainerRuns f;
    check_continuations(f, {{Layout{.tp = 2}, Layout{.dp = 2}}, {Layout{.micro_batches = 2, .pp = 2}, Layout{}}},
                        sets);
  }

  TEST_CASE("a MoE checkpoint continues across EP layouts and round-trips bit-exactly") {
    // Each EP rank saves its own experts (split over its expert-DP group)
    // under their global names, and any layout takes the experts it holds.
    std::vector<std::string> sets = kEvery4;
    sets.insert(sets.end(), {"model.n_expert=4", "model.top_k=2", "model.moe_every=2"});
    TrainerRuns f;
    check_continuations(f,
                        {{Layout{.dp = 2, .ep = 2}, Layout{}},
                         {Layout{.dp = 4, .zero = 3, .ep = 4}, Layout{.dp = 2, .tp = 2, .zero = 1, .ep = 2}},
                         {Layout{.dp = 2, .zero = 2, .cp = 2, .ep = 2}, Layout{.dp = 4, .zero = 1, .ep = 4}}},
                        sets);
    const std::string run = "a_" + Layout{.dp = 2, .ep = 2}.name() + "_" + Layout{}.name();
    const auto text = keel::test::run_process({keel::test::keel_binary("keelctl").string(), "checkpoint", "inspect",
                                               "--run-dir", (f.dir() / run).string(), "--step", "6"});
    CHECK(text.output.find("ep2") != std::string::npos);
  }

  TEST_CASE("a bf16 run saves float32 master weights beside their bf16 rounding and runs of either precision resume "
            "from them") {
    TrainerRuns f;
    auto with = [](std::vector<std::string> sets, const std::string& precision) {
      sets.push_back("train.precision=" + precision);
      return sets;
    };
    const Layout layout{2, 1, 1};
    const Run fp32 = f.run(layout, "fp32", with(kEvery4, "fp32"));
    const Run whole = f.run(layout, "whole", with(kEvery4, "bf16"));
    f.run(layout, "resumed", with(kEvery4, "bf16"), {"--stop-after", "6"}, 14);
    const Run resumed = f.run(layout, "resumed", with(kEvery4, "bf16"));
    CHECK(resumed.exact == whole.exact);
    CHECK(digests(resumed) == digests(whole));
    REQUIRE(whole.losses.size() == fp32.losses.size());
    for (size_t s = 0; s < whole.losses.size(); ++s) {
      CAPTURE(s);
      CHECK(std::fabs(whole.losses[s] - fp32.losses[s]) <= 2e-2 * std::fabs(fp32.losses[s]));
    }
    CHECK(whole.exact != fp32.exact);  // the GEMMs really took bf16

    const fs::path saved = checkpoint_of(f, "resumed", 6);
    const auto tensors = all_tensors(saved);
    size_t masters = 0, finer = 0;
    for (const auto& [name, master] : tensors) {
      if (!name.starts_with("/master/")) continue;
      ++masters;
      CAPTURE(name);
      const auto& model = tensors.at("/model/" + name.substr(std::string("/master/").size()));
      REQUIRE(model.size() == master.size());
      for (size_t i = 0; i < master.size(); ++i) {
        CHECK(model[i] == keel::trainer::bf16_rounded(master[i]));
        finer += model[i] != master[i];
      }
    }
    CHECK(masters == 28);
    CHECK(finer > 0);  // /master holds bits that bf16 drops

    // A float32 run takes /master, not the rounded /model, and saves what it loaded.
    f.run(layout, "to_fp32", with(kEvery4, "fp32"), {"--init-from", saved.string(), "--stop-after", "6"});
    const auto loaded = all_tensors(checkpoint_of(f, "to_fp32", 6));
    for (const auto& [name, values] : loaded) {
      CAPTURE(name);
      CHECK_FALSE(name.starts_with("/master/"));
      const std::string source = name.starts_with("/model/") ? "/master/" + name.substr(7) : name;
      CHECK(values == tensors.at(source));
    }
    CHECK(loaded.size() + masters == tensors.size());
  }

  TEST_CASE("h5py reads every global tensor of index.h5 as its pieces assemble it and h5dump lists every file") {
    TrainerRuns f;
    f.run(Layout{2, 2, 3}, "interop", kEvery4, {"--stop-after", "4"}, 14);
    const fs::path dir = checkpoint_of(f, "interop", 4);
    const auto result = keel::test::run_process(
        {KEEL_SYSTEM_PYTHON, std::string(KEEL_TESTS_DIR) + "/python/check_checkpoint_h5py.py", dir.string()});
    CAPTURE(result.output);
    REQUIRE(result.exit_code == 0);
    const auto summary = keel::test::last_json_line(result.output);
    CHECK(summary.at("tensors").get<int>() == 3 * 28);  // 28 tensors, each with two AdamW moments
    CHECK(summary.at("problems").empty());
    const auto manifest = keel::checkpoint::read_manifest(dir);
    CHECK(manifest.files.size() == 5);  // four ranks and the index
    for (const auto& file : manifest.files) {
      CAPTURE(file.name);
      const auto dump = keel::test::run_process({"h5dump", "-H", (dir / file.name).string()});
      CHECK(dump.exit_code == 0);
      CHECK(dump.output.find("DATASET \"") != std::string::npos);
    }
  }

  TEST_CASE("keel-trainer --eval gives one loss in every layout and PyTorch reading the checkpoint agrees") {
    TrainerRuns f;
    f.run(Layout{2, 2, 3}, "trained", kEvery4, {"--stop-after", "8"}, 14);
    const fs::path dir = checkpoint_of(f, "trained", 8);
    const std::string data = (f.dir() / "train.bin").string();
    std::vector<double> losses;
    for (const Layout& layout : {Layout{}, Layout{2, 1, 1}, Layout{1, 2, 0}, Layout{2, 2, 3}}) {
      CAPTURE(layout.name());
      const Run eval = f.run(layout, "eval_" + layout.name(), {},
                             {"--eval", dir.string(), "--eval-data", data, "--eval-sequences", "40"});
      const auto result = keel::test::last_json_line(eval.outputs[0]);
      CHECK(result.at("step") == 8);
      CHECK(result.at("sequences") == 40);
      CHECK(result.at("tokens") == 40 * 32);
      losses.push_back(result.at("loss").get<double>());
    }
    const auto torch = keel::test::run_process(
        {KEEL_SYSTEM_PYTHON, std::string(KEEL_TESTS_DIR) + "/python/eval_checkpoint_torch.py", dir.string(), data, "40"});
    CAPTURE(torch.output);
    REQUIRE(torch.exit_code == 0);
    const double reference = keel::test::last_json_line(torch.output).at("loss").get<double>();
    for (double loss : losses) CHECK(std::fabs(loss - reference) <= 1e-5 * reference);
    // Asking for more windows than the file holds is a data error.
    const Run too_many = f.run(Layout{}, "eval_too_many", {},
                               {"--eval", dir.string(), "--eval-data", data, "--eval-sequences", "100000"}, 3);
    CHECK(too_many.outputs[0].find("--eval-sequences between 1 and") != std::string::npos);
    // Fewer windows than DP ranks: rank 1 evaluates none and still joins the sums.
    std::vector<double> one_window;
    for (const Layout& layout : {Layout{}, Layout{2, 1, 1}}) {
      const Run eval = f.run(layout, "eval_one_" + layout.name(), {},
                             {"--eval", dir.string(), "--eval-data", data, "--eval-sequences", "1"});
      one_window.push_back(keel::test::last_json_line(eval.outputs[0]).at("loss").get<double>());
    }
    CHECK(std::fabs(one_window[1] - one_window[0]) <= 1e-5 * one_window[0]);
  }

  TEST_CASE(
      "keel-trainer --eval of a MoE model under EP agrees with one rank and refuses windows that leave DP ranks "
      "uneven") {
    // Every forward of a MoE block talks to the other dp x cp ranks, so they
    // must all run as many: an uneven split would hang, and is refused.
    TrainerRuns f;
    std::vector<std::string> moe = kEvery4;
    moe.insert(moe.end(), {"model.n_expert=4", "model.top_k=2", "model.moe_every=2"});
    f.run(Layout{.dp = 2, .ep = 2}, "trained", moe, {"--stop-after", "4"}, 14);
    const std::vector<std::string> eval = {"--eval", checkpoint_of(f, "trained", 4).string(), "--eval-data",
                                           (f.dir() / "train.bin").string(), "--eval-sequences"};
    auto with = [](std::vector<std::string> args, const std::string& sequences) {
      args.push_back(sequences);
      return args;
    };
    const Run single = f.run(Layout{}, "eval_single", moe, with(eval, "6"));
    const Run parallel = f.run(Layout{.dp = 2, .ep = 2}, "eval_ep", moe, with(eval, "6"));
    const double want = keel::test::last_json_line(single.outputs[0]).at("loss");
    CHECK(std::fabs(keel::test::last_json_line(parallel.outputs[0]).at("loss").get<double>() - want) <= 1e-5 * want);
    const Run uneven = f.run(Layout{.dp = 2, .ep = 2}, "eval_uneven", moe, with(eval, "5"), 3);
    CHECK(uneven.outputs[0].find("--eval-sequences 5 is not a multiple of 2: pass a multiple such as 4") !=
          std::string::npos);
  }

  TEST_CASE("a flipped bit or a truncated or missing file is caught and the previous checkpoint is loaded") {
    struct Damage {
      const char* what;
      std::function<void(const fs::path&)> apply;
    };
    const Damage damages[] = {
        {"flipped bit",
         [](const fs::path& file) {
           std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
           io.seekg(static_cast<std::streamoff>(fs::file_size(file) / 2));
           char byte = 0;
           io.read(&byte, 1);
           byte = static_cast<char>(byte ^ 0x10);
           io.seekp(static_cast<std::streamoff>(fs::file_size(file) / 2));
           io.write(&byte, 1);
         }},
        {"truncated file", [](const fs::path& file) { fs::resize_file(file, fs::file_size(file) - 4096); }},
        {"missing file", [](const fs::path& file) { fs::remove(file); }},
    };
    for (const Damage& damage : damages) {
      CAPTURE(damage.what);
      TrainerRuns f;
      f.run(Layout{2, 1, 1}, "run", kEvery4, {"--stop-after", "8"}, 14);
      const fs::path newest = checkpoint_of(f, "run", 8);
      const fs::path victim = newest / "rank-00001.h5";
      damage.apply(victim);
      const auto problems = keel::checkpoint::verify_files(newest, keel::checkpoint::read_manifest(newest));
      REQUIRE(problems.size() == 1);
      CHECK(problems[0].find("rank-00001.h5") != std::string::npos);
      const Run resumed = f.run(Layout{2, 1, 1}, "run", kEvery4);
      CHECK(keel::test::last_json_line(resumed.outputs[0]).at("first_step") == 4);
      CHECK(count_events(f.dir() / "run", "checkpoint_skipped") == 1);
    }
  }

  TEST_CASE("after kill -9 at random moments during saves the newest committed checkpoint always loads") {
    TrainerRuns f;
    std::mt19937 random(20261121);
    const std::vector<std::string> often = {"train.steps=1000000", "train.val_every=0", "checkpoint.every_steps=1",
                                            "checkpoint.keep=2"};
    const fs::path root = f.dir() / "crash" / "checkpoints";
    int64_t newest_step = -1;
    int mid_save = 0, mid_commit = 0;
    for (int trial = 0; trial < 20; ++trial) {
      CAPTURE(trial);
      keel::test::ChildProcess trainer(f.argv("crash", [&] {
        auto sets = Layout{}.sets();
        sets.insert(sets.end(), often.begin(), often.end());
        return sets;
      }()), {{"SPDLOG_LEVEL", "warn"}});
      // This trainer commits a checkpoint of its own first: so the run
      // makes progress, what the last kill left is gone, and a save in
      // flight after it is this trainer's.
      REQUIRE(keel::test::wait_until(
          [&] {
            const auto entries = keel::checkpoint::committed(root);
            return !entries.empty() && entries.back().step > newest_step;
          },
          120));
      const double save_s = last_save_seconds(f.dir() / "crash");
      // Then a random moment of a save in flight: while its rank file is
      // written or while it is committed.
      REQUIRE(keel::test::wait_until([&] { return !partial_dirs(root).empty(); }, 120));
      std::this_thread::sleep_for(std::chrono::duration<double>(save_s * std::uniform_real_distribution<>(0, 1)(random)));
      trainer.signal(SIGKILL);
      trainer.wait(30);
      // What the kill interrupted is still on disk: a .partial directory,
      // holding index.h5 once the commit had begun.
      const auto interrupted = partial_dirs(root);
      mid_save += interrupted.empty() ? 0 : 1;
      for (const auto& dir : interrupted) mid_commit += fs::exists(dir / keel::checkpoint::kIndexFile) ? 1 : 0;
      const auto newest = keel::checkpoint::choose_resume(
          root, {}, [](const fs::path& dir, const std::string& why) { FAIL_CHECK(dir.string() << ": " << why); });
      REQUIRE(newest);
      CHECK(newest->step >= newest_step);  // never lost one
      newest_step = newest->step;
      // Every committed checkpoint, not just the newest, verifies.
      for (const auto& entry : keel::checkpoint::committed(root)) {
        CHECK(keel::checkpoint::verify_files(entry.dir, keel::checkpoint::read_manifest(entry.dir)).empty());
      }
    }
    MESSAGE(mid_save << " of 20 kills landed while a save was in flight, " << mid_commit << " of them in its commit");
    CHECK(mid_save >= 10);
    CHECK(newest_step > 0);
    // And training resumes from it, or from the save after it when the
    // last kill landed between that save's manifest and its rename: rank 0
    // checks such a save in full and commits it at start.
    const int recovered_before = count_events(f.dir() / "crash", "checkpoint_recovered");
    const Run resumed = f.run(Layout{}, "crash", {"train.steps=1000000", "train.val_every=0", "checkpoint.every_steps=1"},
                              {"--stop-after", std::to_string(newest_step + 2)}, 14);
    const int64_t first = keel::test::last_json_line(resumed.outputs[0]).at("first_step");
    const int recovered = count_events(f.dir() / "crash", "checkpoint_recovered") - recovered_before;
    CHECK(first == newest_step + recovered);
  }

  TEST_CASE("a full disk abandons the save and training goes on with older checkpoints intact") {
    TrainerRuns f;
    f.run(Layout{}, "full", kEvery4, {"--stop-after", "4"}, 14);
    const fs::path kept = checkpoint_of(f, "full", 4);
    // A file-size limit below one rank file: every later save fails with
    // EFBIG, as on a full disk, while the small metrics still fit.
    auto args = f.argv("full", [] {
      auto sets = Layout{}.sets();
      sets.insert(sets.end(), kEvery4.begin(), kEvery4.end());
      return sets;
    }());
    args.insert(args.begin(), {"prlimit", "--fsize=200000", "--"});
    const auto result = keel::test::run_process(args, {{"SPDLOG_LEVEL", "warn"}});
    CAPTURE(result.output);
    CHECK(result.exit_code == 13);  // the final checkpoint could not be committed either
    CHECK(keel::test::last_json_line(result.output).at("steps") == 12);
    CHECK(count_events(f.dir() / "full", "checkpoint_abandoned") == 2);  // step 8, and the final save at 12
    CHECK(keel::checkpoint::committed(f.dir() / "full" / "checkpoints").size() == 1);
    CHECK(keel::checkpoint::verify_files(kept, keel::checkpoint::read_manifest(kept)).empty());
    for (const auto& entry : fs::directory_iterator(f.dir() / "full" / "checkpoints")) {
      CHECK(entry.path().filename().string().find("partial") == std::string::npos);
    }
  }
}
