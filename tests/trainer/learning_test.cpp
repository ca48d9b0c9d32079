// The trainer learns real text: a small model on the default corpus (the
// fortunes files that scripts/setup installs) ends well below the corpus's
// byte-unigram entropy, the loss of a model that knows only byte
// frequencies. A short version of what scripts/quickstart checks.
#include "tests/support/fortunes.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

TEST_SUITE("integration") {
  TEST_CASE("a small model trained on the fortunes corpus ends well below its unigram entropy") {
    keel::test::TempDir dir;
    const double entropy = keel::test::prepare_fortunes(dir / "data").unigram_entropy_nats;

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
