// The trainer learns real text: a small model on the default corpus (the
// fortunes files that scripts/setup installs) ends well below the corpus's
// byte-unigram entropy, the loss of a model that knows only byte
// frequencies. A short version of what scripts/quickstart checks.
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <algorithm>

namespace fs = std::filesystem;

namespace {

// The plain-text fortune files, as scripts/quickstart selects them.
std::vector<std::string> fortune_files() {
  std::vector<std::string> files;
  const fs::path dir = "/usr/share/games/fortunes";
  if (!fs::is_directory(dir)) return files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const auto ext = entry.path().extension();
    if (entry.is_regular_file() && !entry.is_symlink() && ext != ".dat" && ext != ".u8") {
      files.push_back(entry.path().string());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("a small model trained on the fortunes corpus ends well below its unigram entropy") {
    auto files = fortune_files();
    REQUIRE_MESSAGE(!files.empty(), "the fortunes corpus is missing: run scripts/setup (it installs Debian's fortunes)");
    keel::test::TempDir dir;

    std::vector<std::string> prepare = {keel::test::keel_binary("keel-prepare-data").string(), "--out",
                                        (dir / "data").string(), "--name", "fortunes", "--json"};
    prepare.insert(prepare.end(), files.begin(), files.end());
    auto prepared = keel::test::run_process(prepare, {}, 120);
    REQUIRE_MESSAGE(prepared.exit_code == 0, prepared.output);
    const double entropy = keel::test::last_json_line(prepared.output).at("train_unigram_entropy_nats").get<double>();

    dir.write("run.toml", R"(
[model]
seq_len = 64
n_layer = 2
n_head = 2
n_embd = 64
[data]
train = "data/fortunes_train_*.bin"
val = "data/fortunes_val_*.bin"
[train]
steps = 400
batch_size = 8
lr = 3e-3
warmup_steps = 20
val_every = 400
val_batches = 8
threads = 2
)");
    auto trained = keel::test::run_process({keel::test::keel_binary("keel-trainer").string(), "--config",
                                            (dir / "run.toml").string(), "--set",
                                            "job.run_dir=" + (dir / "run").string(), "--json"},
                                           {}, 300);
    REQUIRE_MESSAGE(trained.exit_code == 0, trained.output);
    const double val_loss = keel::test::last_json_line(trained.output).at("final_val_loss").get<double>();
    MESSAGE("validation loss " << val_loss << " nats/byte, unigram entropy " << entropy << " nats/byte");
    CHECK(entropy > 3.0);  // English text in bytes: about 4.8 bits
    CHECK(val_loss < entropy - 0.5);
  }
}
