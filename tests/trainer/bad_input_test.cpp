// Bad input end to end: each row is a real keel-trainer process given a
// malformed config or data file; it must exit with the documented code
// (docs/architecture.md "Worker contract": 2 config, 3 data) and say what is wrong, never crash or hang.
#include "store/tcp_store.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"
#include "trainer/data/token_shard.h"

#include <doctest/doctest.h>

#include <cstring>
#include <map>
#include <fstream>
#include <vector>

namespace fs = std::filesystem;

namespace {

void write_bytes(const fs::path& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A shard file built by hand so each row can break one thing.
std::vector<char> shard_bytes(int32_t magic, int32_t version, int32_t declared, const std::vector<uint16_t>& tokens) {
  std::vector<int32_t> header(256, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = declared;
  std::vector<char> bytes(header.size() * 4 + tokens.size() * 2);
  std::memcpy(bytes.data(), header.data(), header.size() * 4);
  std::memcpy(bytes.data() + header.size() * 4, tokens.data(), tokens.size() * 2);
  return bytes;
}

std::vector<uint16_t> tokens(size_t count, uint16_t max_token = 255) {
  std::vector<uint16_t> t(count);
  for (size_t i = 0; i < count; ++i) t[i] = static_cast<uint16_t>(i * 7 % (max_token + 1));
  return t;
}

const char* kGoodConfig = R"(
[job]
name = "bad-input"
run_dir = "run"
[model]
seq_len = 16
n_layer = 1
n_head = 2
n_embd = 32
[data]
train = "train.bin"
[train]
steps = 2
batch_size = 2
warmup_steps = 1
val_every = 0
threads = 1
)";

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("malformed configs and data files exit with their documented code and name the problem") {
    struct Row {
      const char* name;
      std::string config;                 // written to run.toml
      std::vector<std::string> args;      // extra arguments
      std::vector<char> train_bytes;      // written to train.bin
      int exit_code;
      const char* expected;               // substring of the output
    };
    const std::string good = kGoodConfig;
    const auto good_shard = shard_bytes(20240520, 1, 4000, tokens(4000));
    auto truncated = good_shard;
    truncated.resize(truncated.size() - 100);
    auto trailing = good_shard;
    trailing.push_back('x');

    const std::vector<Row> rows = {
        {"valid input trains", good, {}, good_shard, 0, "training finished"},
        {"TOML syntax error", good + "[train\n", {}, good_shard, 2, "not valid TOML"},
        {"unknown section", good + "[checkpoints]\nevery = 5\n", {}, good_shard, 2, "unknown section [checkpoints]"},
        {"section defined twice", good + "[job]\nseed = 5\n", {}, good_shard, 2, "not valid TOML"},
        {"misspelt key", std::string(good).replace(good.find("threads"), 7, "thread"), {}, good_shard, 2,
         "unknown key 'thread' in [train]"},
        {"wrong type", R"([model]
n_layer = "two"
[data]
train = "train.bin")", {}, good_shard, 2, "n_layer must be an integer"},
        {"inconsistent heads", good, {"--set", "model.n_head=5"}, good_shard, 2, "n_head=5 does not divide n_embd=32"},
        {"bad override syntax", good, {"--set", "model.n_head"}, good_shard, 2, "expected section.key=value"},
        {"unknown override", good, {"--set", "train.epochs=3"}, good_shard, 2, "unknown key 'epochs' in [train]"},
        {"layout larger than the world", good, {"--set", "parallel.dp=2"}, good_shard, 2,
         "dp*tp*pp*cp = 2*1*1*1 = 2 but the world has 1 ranks"},
        {"tp not dividing the heads", good, {"--set", "parallel.tp=3"}, good_shard, 2,
         "tp=3 does not divide n_head=2"},
        {"a pipeline split that does not add up to the model", good,
         {"--set", "parallel.pp_layers=2"}, good_shard, 2,
         "pp_layers=\"2\" gives 1 stages 2 blocks but the layout has pp=1 stages and the model n_layer=1 blocks"},
        {"a GPU run where no GPU is visible", good, {"--set", "train.device=cuda"}, good_shard, 2,
         "set train.device = \"cpu\""},
        {"zero stage out of range", good, {"--set", "parallel.zero=5"}, good_shard, 2,
         "must be a ZeRO stage 0-3 (got 5)"},
        {"missing config option", "", {"--no-such-flag"}, good_shard, 2, ""},
        {"no shard matches", good, {"--set", "data.train=nothing_*.bin"}, good_shard, 3, "nothing_*.bin"},
        {"empty shard", good, {}, {}, 3, "train.bin"},
        {"wrong magic", good, {}, shard_bytes(12345, 1, 4000, tokens(4000)), 3, "magic"},
        {"wrong version", good, {}, shard_bytes(20240520, 7, 4000, tokens(4000)), 3, "version"},
        {"truncated tokens", good, {}, truncated, 3, "train.bin"},
        {"trailing bytes", good, {}, trailing, 3, "train.bin"},
        {"token outside vocabulary", good, {}, shard_bytes(20240520, 1, 4000, tokens(4000, 300)), 3, "vocab"},
        {"dataset shorter than a sequence", good, {}, shard_bytes(20240520, 1, 8, tokens(8)), 3, "train.bin"},
        {"run directory under a file", std::string(good).replace(good.find("\"run\""), 5, "\"train.bin/run\""), {},
         good_shard, 2,
         "set job.run_dir to a writable directory"},
        {"missing validation shards", good, {"--set", "data.val=val_*.bin", "--set", "train.val_every=1"}, good_shard,
         3, "val_*.bin"},
    };

    for (const Row& row : rows) {
      CAPTURE(row.name);
      keel::test::TempDir dir;
      auto config = dir.write("run.toml", row.config);
      write_bytes(dir / "train.bin", row.train_bytes);
      std::vector<std::string> argv = {keel::test::keel_binary("keel-trainer").string()};
      if (row.args.empty() || row.args[0] != "--no-such-flag") {
        argv.insert(argv.end(), {"--config", config.string()});
      }
      argv.insert(argv.end(), row.args.begin(), row.args.end());
      // No row may see a GPU, so the table reads alike on every machine.
      auto result = keel::test::run_process(argv, {{"CUDA_VISIBLE_DEVICES", ""}}, 120);
      CAPTURE(result.output);
      CHECK(result.exit_code == row.exit_code);
      CHECK(result.output.find(row.expected) != std::string::npos);
      CHECK(result.output.find("internal error") == std::string::npos);
    }
  }

  TEST_CASE("a malformed worker environment or an unreachable or refusing store exits with its code and says why") {
    keel::test::TempDir dir;
    auto config = dir.write("run.toml", kGoodConfig);
    write_bytes(dir / "train.bin", shard_bytes(20240520, 1, 4000, tokens(4000)));
    const std::string trainer = keel::test::keel_binary("keel-trainer").string();
    // A live store whose secret the ranks below do not have.
    keel::store::StoreServer store(keel::store::new_store_secret());
    const std::string secret = keel::store::new_store_secret();
    struct Row {
      std::map<std::string, std::string> env;
      std::vector<std::string> args;
      int exit_code;
      const char* expected;
    };
    const Row rows[] = {
        {{{"KEEL_RANK", "x"}}, {}, 2, "KEEL_RANK=x is not an integer"},
        {{{"KEEL_WORLD_SIZE", "2"}}, {}, 2, "needs KEEL_STORE"},
        {{{"KEEL_WORLD_SIZE", "2"}, {"KEEL_STORE", "tcp://127.0.0.1:1"}}, {}, 2, "needs KEEL_STORE_SECRET"},
        {{{"KEEL_WORLD_SIZE", "2"}, {"KEEL_STORE", "tcp://127.0.0.1:1"}, {"KEEL_STORE_SECRET", "x"}}, {}, 2,
         "KEEL_STORE_SECRET is not a store secret"},
        {{{"KEEL_WORLD_SIZE", "2"}, {"KEEL_STORE", "127.0.0.1:1"}, {"KEEL_STORE_SECRET", secret}},
         {"--set", "parallel.dp=2"}, 2, "KEEL_STORE"},
        {{{"KEEL_WORLD_SIZE", "2"}, {"KEEL_STORE", "tcp://127.0.0.1:1"}, {"KEEL_STORE_SECRET", secret}},
         {"--set", "parallel.dp=2", "--set", "parallel.timeout_s=1"}, 12, "127.0.0.1:1"},
        {{{"KEEL_WORLD_SIZE", "2"}, {"KEEL_STORE", store.address()}, {"KEEL_STORE_SECRET", secret}},
         {"--set", "parallel.dp=2"}, 2, "wrong store secret"},
        {{{"KEEL_WORLD_SIZE", "2"}, {"KEEL_STORE", "tcp://127.0.0.1:1"}, {"KEEL_STORE_SECRET", secret}},
         {"--set", "parallel.dp=2", "--set", "parallel.ep=2"}, 2, "ep=2 needs a MoE model but n_expert=0"},
    };
    for (const Row& row : rows) {
      CAPTURE(row.expected);
      std::vector<std::string> argv = {trainer, "--config", config.string()};
      argv.insert(argv.end(), row.args.begin(), row.args.end());
      auto result = keel::test::run_process(argv, row.env, 60);
      CAPTURE(result.output);
      CHECK(result.exit_code == row.exit_code);
      CHECK(result.output.find(row.expected) != std::string::npos);
    }
  }
}
