// keel-prepare-data with a real tokenizer (docs/architecture.md "Data"): a
// SentencePiece model trained on the fortunes corpus's training split
// encodes the corpus so that decoding gives every chunk back, split as the
// byte path splits it; the small Llama learns on those tokens; the
// Megatron-LM format holds the same tokens as llm.c's; a tokenizer that
// does not load is refused with a sentence and exit 2, and nothing is
// written.
#include "tests/support/fortunes.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"
#include "trainer/data/data_mix.h"
#include "trainer/data/megatron_dataset.h"
#include "trainer/data/text_tokenizer.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

keel::test::ProcessResult prepare(std::vector<std::string> args) {
  args.insert(args.begin(), keel::test::keel_binary("keel-prepare-data").string());
  return keel::test::run_process(args, {}, 600);
}

std::vector<int32_t> tokens_of(const std::string& source, int64_t vocab) {
  const auto stream = keel::trainer::open_token_stream(source, vocab, 1);
  std::vector<int32_t> tokens(static_cast<size_t>(stream->num_tokens()));
  stream->copy(0, stream->num_tokens(), tokens.data());
  return tokens;
}

// The split keel-prepare-data documents for a tokenizer, restated: runs of
// whole lines of at least 4096 bytes within a file, every 10th run (index
// 9, 19, ...) held out; a file's text never shares a run with the next.
struct Split {
  std::string train, val;
};
Split split_by_lines(const std::vector<std::string>& files) {
  Split split;
  size_t chunk = 0;
  for (const auto& file : files) {
    std::ifstream in(file, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::string pending;
    auto close = [&] {
      (chunk++ % 10 == 9 ? split.val : split.train) += pending;
      pending.clear();
    };
    for (size_t at = 0; at < text.size();) {
      const size_t newline = text.find('\n', at);
      const size_t end = newline == std::string::npos ? text.size() : newline + 1;
      pending += text.substr(at, end - at);
      at = end;
      if (newline != std::string::npos && pending.size() >= 4096) close();
    }
    if (!pending.empty()) close();
  }
  return split;
}

// `tokens` without the end-of-document token `eos`.
std::vector<int32_t> without(std::vector<int32_t> tokens, int32_t eos) {
  std::erase(tokens, eos);
  return tokens;
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("a SentencePiece model trained on the fortunes training split encodes the corpus losslessly and the small Llama learns on it") {
    keel::test::TempDir dir;
    const auto files = keel::test::fortune_files();
    REQUIRE_MESSAGE(!files.empty(), "the fortunes corpus is missing: run scripts/setup");
    std::vector<std::string> args = {"--out", (dir / "spm").string(), "--name", "fortunes", "--train-tokenizer", "1024",
                                     "--json"};
    args.insert(args.end(), files.begin(), files.end());
    const auto prepared = prepare(args);
    INFO(prepared.output);
    REQUIRE(prepared.exit_code == 0);
    const auto summary = keel::test::last_json_line(prepared.output);
    CHECK(summary.at("vocab_size") == 1024);
    const std::string model = (dir / "spm" / "fortunes.model").string();
    CHECK(summary.at("tokenizer_model") == model);
    CHECK_FALSE(fs::exists(dir / "spm" / ".fortunes_tokenizer_text.txt"));

    const auto tokenizer = keel::trainer::load_sentencepiece(model);
    const int32_t eos = *tokenizer->end_of_document();
    const auto train = tokens_of(summary.at("train_glob"), 1024);
    const auto val = tokens_of(summary.at("val_glob"), 1024);
    CHECK(std::count(train.begin(), train.end(), eos) == static_cast<std::ptrdiff_t>(files.size()));
    const Split text = split_by_lines(files);
    CHECK(tokenizer->decode(without(train, eos)) == text.train);
    CHECK(tokenizer->decode(without(val, eos)) == text.val);  // held out, and still lossless
    CHECK(train.size() * 2 < text.train.size());              // a vocabulary that compresses

    // The small Llama on those tokens under keeld, one rank: it learns.
    const fs::path config = fs::path(KEEL_TESTS_DIR) / ".." / "configs" / "llama-small.toml";
    const auto run = keel::test::run_process(
        {keel::test::keel_binary("keeld").string(), "--config", config.string(), "--foreground", "--set",
         "daemon.socket=" + (dir / "keeld.sock").string(), "--set", "daemon.metrics_port=-1", "--set",
         "daemon.trainer=" + keel::test::keel_binary("keel-trainer").string(), "--set",
         "job.run_dir=" + (dir / "run").string(), "--set", "model.vocab_size=1024", "--set",
         "data.train=" + summary.at("train_glob").get<std::string>(), "--set",
         "data.val=" + summary.at("val_glob").get<std::string>(), "--set", "parallel.dp=1", "--set", "parallel.tp=1",
         "--set", "train.steps=120", "--set", "train.batch_size=8", "--set", "train.val_every=120", "--set",
         "train.warmup_steps=5", "--set", "checkpoint.every_steps=0"},
        {{"SPDLOG_LEVEL", "warn"}}, 600);
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
    std::ifstream metrics(dir / "run" / "metrics.jsonl");
    double val_loss = NAN;
    for (std::string line; std::getline(metrics, line);) {
      const auto record = nlohmann::json::parse(line);
      if (record.contains("val_loss")) val_loss = record.at("val_loss").get<double>();
    }
    // Past what token frequencies alone reach on the training split.
    CHECK(val_loss < summary.at("train_unigram_entropy_nats").get<double>() - 0.2);
  }

  TEST_CASE("keel-prepare-data writes a Megatron-LM dataset holding exactly the tokens of its llm.c shards") {
    keel::test::TempDir dir;
    std::vector<std::string> files;
    for (int i = 0; i < 3; ++i) {
      std::string text;
      for (int line = 0; line < 2000 + 50 * i; ++line) text += "line " + std::to_string(line * (i + 3)) + " of file\n";
      files.push_back(dir.write("text" + std::to_string(i) + ".txt", text).string());
    }
    for (const std::string format : {"llmc", "megatron"}) {
      std::vector<std::string> args = {"--out", (dir / format).string(), "--format", format, "--json"};
      args.insert(args.end(), files.begin(), files.end());
      const auto prepared = prepare(args);
      INFO(prepared.output);
      REQUIRE(prepared.exit_code == 0);
    }
    for (const std::string split : {"train", "val"}) {
      CAPTURE(split);
      const auto megatron = (dir / "megatron" / ("corpus_" + split)).string();
      REQUIRE(keel::trainer::MegatronDataset::exists(megatron));
      const auto data = keel::trainer::MegatronDataset::open(megatron, 256, 1);
      if (split == "train") CHECK(data.documents() == 3);  // one a file
      CHECK(tokens_of(megatron, 256) == tokens_of((dir / "llmc" / ("corpus_" + split + "_*.bin")).string(), 256));
    }
  }

  TEST_CASE("keel-prepare-data refuses a tokenizer that does not load or cannot train with a sentence and writes nothing") {
    keel::test::TempDir dir;
    const auto text = dir.write("text.txt", "some text\nmore text\n").string();
    const auto not_a_model = dir.write("tokenizer.model", "this is not a protobuf").string();
    struct Row {
      const char* what;
      std::vector<std::string> args;
      const char* said;
    };
    const Row rows[] = {
        {"a model that does not load", {"--tokenizer", not_a_model}, "not a SentencePiece model that loads"},
        {"a model file that is missing", {"--tokenizer", (dir / "missing.model").string()}, "missing.model"},
        {"two tokenizers", {"--tokenizer", not_a_model, "--train-tokenizer", "300"}, "pass one"},
        {"a vocabulary too large for the text", {"--train-tokenizer", "100000"}, "SentencePiece could not train"},
        {"a format keel does not write", {"--format", "arrow"}, "arrow"},
    };
    int n = 0;
    for (const Row& row : rows) {
      INFO(row.what);
      const fs::path out = dir / ("out" + std::to_string(n++));
      std::vector<std::string> args = {"--out", out.string()};
      args.insert(args.end(), row.args.begin(), row.args.end());
      args.push_back(text);
      const auto result = prepare(args);
      INFO(result.output);
      CHECK(result.exit_code == 2);
      CHECK(result.output.find(row.said) != std::string::npos);
      bool wrote = false;
      if (fs::exists(out)) {
        for (const auto& entry : fs::directory_iterator(out)) wrote = wrote || entry.path().extension() == ".bin";
      }
      CHECK_FALSE(wrote);
    }
  }
}
