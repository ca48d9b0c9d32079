// The layout check keel-trainer and keeld both run before anything starts:
// a table of bad layouts, each named by a sentence; the geometry of valid
// ones; and the layouts this build refuses although they are valid.
#include "common/error.h"
#include "common/layout_check.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

namespace {

using namespace keel::common;

// A config every check accepts on one rank; bad layouts change a few fields.
Config valid_config() {
  Config c;
  c.model.vocab_size = 256;
  c.model.seq_len = 256;
  c.model.n_layer = 4;
  c.model.n_head = 4;
  c.model.n_embd = 256;
  c.train.batch_size = 8;
  return c;
}

bool any_contains(const std::vector<std::string>& problems, const std::string& needle) {
  return std::any_of(problems.begin(), problems.end(),
                     [&](const std::string& p) { return p.find(needle) != std::string::npos; });
}

// A change to valid_config() and a sentence its problems must hold.
struct LayoutCase {
  const char* what;
  int world_size;
  std::function<void(Config&)> change;
  std::string expected;
};

std::string joined(const std::vector<std::string>& problems) {
  std::string out;
  for (const auto& p : problems) out += "\n  " + p;
  return out;
}

// Applies `c` to a valid config: `problems_of` must name it, and
// validate_layout must refuse it with that sentence.
void check_refused(const LayoutCase& c,
                   const std::function<std::vector<std::string>(const Config&, int64_t)>& problems_of) {
  CAPTURE(c.what);
  Config config = valid_config();
  c.change(config);
  const auto problems = problems_of(config, c.world_size);
  CAPTURE(joined(problems));
  CHECK(any_contains(problems, c.expected));
  // validate_layout joins problems with "; ", so a sentence must not hold one.
  CHECK_FALSE(any_contains(problems, ";"));
  try {
    validate_layout(config, c.world_size);
    FAIL("expected validate_layout to throw");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kBadConfig);
    CHECK(std::string(e.what()).find(c.expected) != std::string::npos);
  }
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("each bad layout produces a sentence naming its values") {
    const std::vector<LayoutCase> cases = {
        {"dp below one", 1, [](Config& c) { c.parallel.dp = 0; }, "dp=0 must be at least 1"},
        {"negative micro_batches", 1, [](Config& c) { c.parallel.micro_batches = -2; },
         "micro_batches=-2 must be at least 1"},
        {"ep below one", 1, [](Config& c) { c.parallel.ep = 0; }, "ep=0 must be at least 1"},
        {"absurd degree", 1, [](Config& c) { c.parallel.cp = 100000000; }, "cp=100000000 exceeds 32768"},
        {"zero stage four", 1, [](Config& c) { c.parallel.zero = 4; }, "zero=4 is not a ZeRO stage"},
        {"negative zero stage", 1, [](Config& c) { c.parallel.zero = -1; }, "zero=-1 is not a ZeRO stage"},
        {"world too small", 3, [](Config& c) { c.parallel.dp = c.parallel.tp = 2; },
         "dp*tp*pp*cp = 2*2*1*1 = 4 but the world has 3 ranks"},
        {"world too large", 16, [](Config& c) { c.parallel.pp = c.parallel.micro_batches = 2; },
         "dp*tp*pp*cp = 1*1*2*1 = 2 but the world has 16 ranks"},
        {"tp against heads", 3, [](Config& c) { c.parallel.tp = 3; }, "tp=3 does not divide n_head=4"},
        {"tp against key/value heads", 4,
         [](Config& c) {
           c.model.arch = "llama";
           c.model.n_kv_head = 2;
           c.parallel.tp = 4;
         },
         "tp=4 does not divide n_kv_head=2"},
        {"tp against the SwiGLU width", 4,
         [](Config& c) {
           c.model.arch = "llama";
           c.model.ffn_hidden = 690;
           c.parallel.tp = 4;
         },
         "tp=4 does not divide the SwiGLU width 690 (model.ffn_hidden)"},
        {"tp against width", 4,
         [](Config& c) {
           c.parallel.tp = 4;
           c.model.n_embd = 258;
         },
         "tp=4 does not divide n_embd=258"},
        {"tp against vocabulary", 3,
         [](Config& c) {
           c.parallel.tp = 3;
           c.model.n_head = 6;
           c.model.n_embd = 384;
         },
         "tp=3 does not divide the padded vocabulary 256 (vocab_size=256"},
        {"more stages than blocks", 5,
         [](Config& c) {
           c.parallel.pp = 5;
           c.parallel.micro_batches = 8;
         },
         "pp=5 exceeds n_layer=4"},
        {"too few microbatches for 1F1B", 4, [](Config& c) { c.parallel.pp = 4; },
         "micro_batches=1 is fewer than pp=4"},
        {"pp_layers not numbers", 2,
         [](Config& c) {
           c.parallel.pp = c.parallel.micro_batches = 2;
           c.parallel.pp_layers = "3/1";
         },
         "pp_layers=\"3/1\" is not a comma-separated list of positive block counts: write one count per stage, "
         "such as \"2,2\""},
        {"pp_layers with an empty stage", 2,
         [](Config& c) {
           c.parallel.pp = c.parallel.micro_batches = 2;
           c.parallel.pp_layers = "4,0";
         },
         "pp_layers=\"4,0\" is not a comma-separated list of positive block counts"},
        {"pp_layers for other stages", 2,
         [](Config& c) {
           c.parallel.pp = c.parallel.micro_batches = 2;
           c.parallel.pp_layers = "1,1,2";
         },
         "pp_layers=\"1,1,2\" gives 3 stages 4 blocks but the layout has pp=2 stages"},
        {"pp_layers for another model", 2,
         [](Config& c) {
           c.parallel.pp = c.parallel.micro_batches = 2;
           c.parallel.pp_layers = "2,3";
         },
         "gives 2 stages 5 blocks but the layout has pp=2 stages and the model n_layer=4 blocks: write 2 counts that "
         "add up to 4"},
        {"interleaving without a pipeline", 1, [](Config& c) { c.parallel.pp_virtual = 2; },
         "pp_virtual=2 needs a pipeline: interleaving splits each of pp >= 2 stages into chunks"},
        {"interleaving over microbatches that are not groups of pp", 2,
         [](Config& c) {
           c.parallel.pp = 2;
           c.parallel.micro_batches = 3;
           c.parallel.pp_virtual = 2;
         },
         "micro_batches=3 is not a multiple of pp=2: interleaved 1F1B runs microbatches in groups of pp"},
        {"more virtual stages than blocks", 2,
         [](Config& c) {
           c.parallel.pp = c.parallel.micro_batches = 2;
           c.parallel.pp_virtual = 3;
         },
         "pp*pp_virtual = 6 exceeds n_layer=4: every virtual stage needs at least one block, so use a pp_virtual of at "
         "most 2"},
        {"pp_layers counting stages where interleaving counts virtual ones", 2,
         [](Config& c) {
           c.parallel.pp = c.parallel.micro_batches = c.parallel.pp_virtual = 2;
           c.parallel.pp_layers = "2,2";
         },
         "pp_layers=\"2,2\" gives 2 stages 4 blocks but the layout has pp*pp_virtual = 4 virtual stages and the model "
         "n_layer=4 blocks: write 4 counts that add up to 4"},
        {"pp_virtual below one", 1, [](Config& c) { c.parallel.pp_virtual = 0; }, "pp_virtual=0 must be at least 1"},
        {"an unknown pipeline schedule", 2,
         [](Config& c) {
           c.parallel.pp = 2;
           c.parallel.pp_schedule = "gpipe";
         },
         "pp_schedule=\"gpipe\" is not a schedule: use \"1f1b\" or \"zb-h1\""},
        {"zero bubble without a pipeline", 1, [](Config& c) { c.parallel.pp_schedule = "zb-h1"; },
         "pp_schedule=\"zb-h1\" needs a pipeline: with one stage there is no bubble to fill"},
        {"zero bubble interleaved", 2,
         [](Config& c) {
           c.parallel.pp = c.parallel.micro_batches = c.parallel.pp_virtual = 2;
           c.parallel.pp_schedule = "zb-h1";
         },
         "pp_schedule=\"zb-h1\" splits plain 1F1B's backwards, not interleaved ones: set pp_virtual=1"},
        {"cp chunks against sequence", 3, [](Config& c) { c.parallel.cp = 3; },
         "2*cp = 6 does not divide seq_len=256 (cp=3)"},
        {"cp halves against odd chunks", 2,
         [](Config& c) {
           c.parallel.cp = 2;
           c.model.seq_len = 6;
         },
         "2*cp = 4 does not divide seq_len=6"},
        {"ep against dp and cp", 4,
         [](Config& c) {
           c.parallel.dp = 4;
           c.parallel.ep = 3;
           c.model.n_expert = 6;
         },
         "ep=3 does not divide dp*cp = 4*1 = 4"},
        {"ep without experts", 2,
         [](Config& c) {
           c.parallel.dp = 2;
           c.parallel.ep = 2;
         },
         "ep=2 needs a MoE model but n_expert=0"},
        {"experts against ep", 4,
         [](Config& c) {
           c.parallel.dp = 4;
           c.parallel.ep = 4;
           c.model.n_expert = 6;
         },
         "n_expert=6 is not divisible by ep=4"},
        {"batch against dp and microbatches", 4,
         [](Config& c) {
           c.parallel.dp = 4;
           c.parallel.micro_batches = 3;
         },
         "batch_size=8 is not divisible by dp*micro_batches = 4*3 = 12"},
        {"tp against the positions of a microbatch", 4,
         [](Config& c) {
           c.parallel.tp = 4;
           c.train.batch_size = 1;
           c.model.seq_len = 6;
         },
         "tp=4 does not divide the 6 positions a rank holds of a microbatch"},
    };
    for (const LayoutCase& bad : cases) check_refused(bad, layout_problems);
  }

  TEST_CASE("valid layouts produce no problems") {
    struct GoodLayout {
      const char* what;
      int world_size;
      std::function<void(Config&)> change;
    };
    const std::vector<GoodLayout> cases = {
        {"a single rank", 1, [](Config&) {}},
        {"all four grid axes", 16,
         [](Config& c) {
           c.parallel.dp = c.parallel.tp = c.parallel.pp = c.parallel.cp = 2;
           c.parallel.micro_batches = 2;
         }},
        {"experts over dp and cp", 8,
         [](Config& c) {
           c.parallel.dp = 4;
           c.parallel.cp = 2;
           c.parallel.ep = 8;
           c.model.n_expert = 8;
           c.parallel.zero = 3;
         }},
        {"an interleaved pipeline of one block per virtual stage", 2,
         [](Config& c) {
           c.parallel.pp = c.parallel.pp_virtual = 2;
           c.parallel.micro_batches = 4;
         }},
        {"one block per stage", 4,
         [](Config& c) {
           c.parallel.pp = 4;
           c.parallel.micro_batches = 8;
         }},
        // Pointless, since there is nothing to shard across, but harmless.
        {"zero without data parallelism", 1, [](Config& c) { c.parallel.zero = 2; }},
    };
    for (const GoodLayout& good : cases) {
      CAPTURE(good.what);
      Config config = valid_config();
      good.change(config);
      const auto problems = layout_problems(config, good.world_size);
      CAPTURE(joined(problems));
      CHECK(problems.empty());
    }
  }

  TEST_CASE("validate_layout accepts every axis at once") {
    Config config = valid_config();
    config.parallel.dp = config.parallel.tp = config.parallel.pp = config.parallel.cp = 2;
    config.parallel.micro_batches = config.parallel.ep = 2;
    config.model.n_expert = 4;
    CHECK_NOTHROW(validate_layout(config, 16));
  }

  TEST_CASE("the blocks split over pipeline stages as pp_layers says or as evenly as possible") {
    Config config = valid_config();  // n_layer = 4
    config.model.n_layer = 7;
    config.parallel.pp = 3;
    CHECK(stage_layers(config) == std::vector<int64_t>{3, 2, 2});
    config.parallel.pp_layers = "1,2,4";
    CHECK(stage_layers(config) == std::vector<int64_t>{1, 2, 4});
    config.parallel.pp_layers = "1,2";
    CHECK_THROWS_AS(stage_layers(config), Error);
    // Interleaved: one count per virtual stage, stage s running virtual stages s, s + pp, ...
    config.parallel.pp = 2;
    config.parallel.pp_virtual = 2;
    config.parallel.pp_layers = "";
    CHECK(stage_layers(config) == std::vector<int64_t>{2, 2, 2, 1});
  }

  TEST_CASE("validate_layout throws kBadConfig naming every problem") {
    Config config = valid_config();
    config.parallel.tp = 3;
    config.parallel.pp = 8;
    config.parallel.zero = 5;
    const auto problems = layout_problems(config, 12);
    CHECK(problems.size() >= 4);
    try {
      validate_layout(config, 12);
      FAIL("expected validate_layout to throw");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kBadConfig);
      const std::string message = e.what();
      CHECK(message.rfind("invalid parallel layout: ", 0) == 0);
      for (const auto& problem : problems) CHECK(message.find(problem) != std::string::npos);
      CHECK(message.find("zero=5") != std::string::npos);
      CHECK(message.find("tp=3 does not divide n_head=4") != std::string::npos);
      CHECK(message.find("pp=8 exceeds n_layer=4") != std::string::npos);
      CHECK(message.find("dp*tp*pp*cp = 1*3*8*1 = 24 but the world has 12 ranks") != std::string::npos);
    }
  }
}
