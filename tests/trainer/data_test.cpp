#include "common/error.h"
#include "trainer/data/batches.h"
#include "trainer/data/dataset.h"
#include "trainer/data/token_shard.h"

#include "tests/support/process.h"
#include "tests/support/temp_dir.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <array>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <set>
#include <sstream>

namespace {

namespace fs = std::filesystem;
using keel::common::Error;
using keel::common::ErrorCode;
using keel::test::TempDir;
using namespace keel::trainer;

// Raw shard bytes with any header, so that malformed files can be made.
std::string shard_bytes(int32_t magic, int32_t version, int32_t count, const std::vector<uint16_t>& tokens) {
  std::array<int32_t, kShardHeaderInts> header{};
  header[0] = magic;
  header[1] = version;
  header[2] = count;
  std::string bytes(reinterpret_cast<const char*>(header.data()), kShardHeaderBytes);
  bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(uint16_t));
  return bytes;
}

std::string valid_shard_bytes(const std::vector<uint16_t>& tokens) {
  return shard_bytes(kGpt2Shard.magic, kGpt2Shard.version, static_cast<int32_t>(tokens.size()), tokens);
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The Error a call throws; fails the test when it throws nothing.
Error thrown_error(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e;
  }
  FAIL("expected a keel::common::Error");
  return Error(ErrorCode::kInternal, "unreachable");
}

// Writes `count[i]` tokens to shard i, where the token at stream position p
// is p % 50000: any window read back tells where it came from.
void write_position_shards(const TempDir& dir, const std::string& prefix, const std::vector<int64_t>& counts) {
  int64_t pos = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    std::vector<uint16_t> tokens;
    for (int64_t j = 0; j < counts[i]; ++j, ++pos) tokens.push_back(static_cast<uint16_t>(pos % 50000));
    write_token_shard(dir / (prefix + "_00000" + std::to_string(i) + ".bin"), tokens);
  }
}

TEST_SUITE("unit") {

TEST_CASE("every kind of malformed shard is rejected with a data error naming the file and the problem") {
  TempDir dir;
  struct Row {
    const char* what;
    std::function<fs::path()> make;
    int64_t vocab_size;
    std::vector<std::string> message_parts;
  };
  const std::vector<uint16_t> three{1, 2, 3};
  const std::vector<Row> rows = {
      {"an empty file", [&] { return dir.write("empty.bin", ""); }, 256, {"empty file (0 bytes)"}},
      {"a file shorter than the header", [&] { return dir.write("short.bin", std::string(100, '\0')); }, 256,
       {"file is 100 bytes, shorter than the 1024-byte shard header"}},
      {"a header with the wrong magic",
       [&] { return dir.write("magic.bin", shard_bytes(12345, kGpt2Shard.version, 3, three)); }, 256,
       {"wrong magic 12345 (expected 20240520 for llm.c GPT-2", "20240801 for llm.c Llama 3",
        "not an llm.c token shard"}},
      {"a header with the wrong version",
       [&] { return dir.write("version.bin", shard_bytes(kGpt2Shard.magic, 2, 3, three)); }, 256,
       {"unsupported shard version 2", "is version 1"}},
      {"a negative token count",
       [&] { return dir.write("negative.bin", shard_bytes(kGpt2Shard.magic, kGpt2Shard.version, -5, three)); }, 256,
       {"token count is negative (-5)"}},
      {"fewer tokens than the header announces",
       [&] { return dir.write("truncated.bin", shard_bytes(kGpt2Shard.magic, kGpt2Shard.version, 100, three)); }, 256,
       {"truncated", "header says 100 tokens", "3 whole tokens"}},
      {"more tokens than the header announces",
       [&] { return dir.write("trailing.bin", shard_bytes(kGpt2Shard.magic, kGpt2Shard.version, 1, three)); }, 256,
       {"4 trailing byte(s) after the 1 tokens"}},
      {"an odd byte after the tokens",
       [&] { return dir.write("odd.bin", valid_shard_bytes(three) + "x"); }, 256, {"1 trailing byte(s)"}},
      {"a token outside the vocabulary",
       [&] { return dir.write("vocab.bin", valid_shard_bytes({5, 6, 7, 300, 9, 400})); }, 256,
       {"token 300 at index 3 is >= model.vocab_size 256", "set model.vocab_size to at least 401 or re-tokenize"}},
      {"a directory instead of a file",
       [&] {
         fs::create_directories(dir / "shard_dir.bin");
         return dir / "shard_dir.bin";
       },
       256, {"is a directory"}},
      {"a missing file", [&] { return dir / "missing.bin"; }, 256, {"cannot open", "No such file or directory"}},
  };
  for (const auto& row : rows) {
    CAPTURE(row.what);
    const fs::path path = row.make();
    Error error = thrown_error([&] { TokenShard::open(path, row.vocab_size); });
    CHECK(error.code() == ErrorCode::kDataError);
    const std::string message = error.what();
    CAPTURE(message);
    CHECK(message.find(path.string()) != std::string::npos);
    for (const auto& part : row.message_parts) CHECK(message.find(part) != std::string::npos);
  }
}

TEST_CASE("a header-only shard with zero tokens is valid and empty") {
  TempDir dir;
  const fs::path path = dir.write("zero.bin", valid_shard_bytes({}));
  TokenShard shard = TokenShard::open(path, 256);
  CHECK(shard.size() == 0);
  CHECK(shard.path() == path.string());
}

TEST_CASE("a written shard reads back unchanged in llm.c's exact byte layout") {
  TempDir dir;
  std::vector<uint16_t> tokens;
  for (uint32_t i = 0; i < 100'003; ++i) tokens.push_back(static_cast<uint16_t>((i * 2654435761u) >> 16));
  const fs::path path = dir / "round.bin";
  write_token_shard(path, tokens);

  CHECK(read_file(path) == valid_shard_bytes(tokens));
  CHECK_FALSE(fs::exists(dir / "round.bin.tmp"));

  TokenShard shard = TokenShard::open(path, 65536);
  REQUIRE(shard.size() == static_cast<int64_t>(tokens.size()));
  std::vector<int32_t> read(tokens.size());
  shard.copy(0, shard.size(), read.data());
  CHECK(std::equal(tokens.begin(), tokens.end(), read.begin()));

  TokenShard moved = std::move(shard);
  CHECK(moved.size() == static_cast<int64_t>(tokens.size()));
  CHECK(moved.token(7) == tokens[7]);
}

TEST_CASE("a Llama 3 shard of uint32 tokens reads back in llm.c's layout and refuses a token past the vocabulary") {
  TempDir dir;
  // Llama 3's <|begin_of_text|> (128000) and <|end_of_text|> (128001) around a document.
  const std::vector<uint32_t> tokens{128000, 791, 4062, 14198, 128001, 70000};
  const fs::path path = dir / "llama3_train_000000.bin";
  write_token_shard(path, tokens);
  std::string want(1024, '\0');
  const int32_t header[3] = {kLlama3Shard.magic, kLlama3Shard.version, static_cast<int32_t>(tokens.size())};
  std::memcpy(want.data(), header, sizeof(header));
  want.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(uint32_t));
  CHECK(read_file(path) == want);

  TokenShard shard = TokenShard::open(path, 128256);
  CHECK(shard.format().token_bytes == 4);
  std::vector<int32_t> read(tokens.size());
  shard.copy(0, shard.size(), read.data());
  CHECK(std::equal(tokens.begin(), tokens.end(), read.begin()));

  Error error = thrown_error([&] { TokenShard::open(path, 65536); });
  CHECK(error.code() == ErrorCode::kDataError);
  CHECK(std::string(error.what()).find("token 128000 at index 0") != std::string::npos);
  // Llama 3's magic with GPT-2's version is neither format.
  const fs::path wrong = dir.write("wrong_version.bin", shard_bytes(kLlama3Shard.magic, 1, 0, {}));
  error = thrown_error([&] { TokenShard::open(wrong, 128256); });
  CHECK(std::string(error.what()).find("is version 7") != std::string::npos);
}

TEST_CASE("rewriting a shard replaces it whole") {
  TempDir dir;
  const fs::path path = dir / "again.bin";
  write_token_shard(path, std::vector<uint16_t>(1000, 1));
  write_token_shard(path, std::vector<uint16_t>{4, 5});
  TokenShard shard = TokenShard::open(path, 256);
  REQUIRE(shard.size() == 2);
  CHECK(shard.token(1) == 5);
}

TEST_CASE("writing a shard into a missing directory is a data error naming the file") {
  TempDir dir;
  const fs::path path = dir / "no" / "such" / "dir.bin";
  Error error = thrown_error([&] { write_token_shard(path, std::vector<uint16_t>{1}); });
  CHECK(error.code() == ErrorCode::kDataError);
  CHECK(std::string(error.what()).find("dir.bin.tmp: cannot create") != std::string::npos);
}

TEST_CASE("a GPT-2 tokenized llm.c shard loads with vocab_size 50257 and is refused with 256") {
  TempDir dir;
  // As llm.c's fineweb/tinyshakespeare shards: <|endoftext|> (50256) between documents.
  const std::vector<uint16_t> tokens{50256, 464, 2068, 7586, 21831, 50256, 15496, 995, 13, 50256};
  const fs::path path = dir / "tinyshakespeare_val.bin";
  write_token_shard(path, tokens);

  TokenShard shard = TokenShard::open(path, 50257);
  CHECK(shard.size() == static_cast<int64_t>(tokens.size()));
  CHECK(shard.token(0) == 50256);

  Error error = thrown_error([&] { TokenShard::open(path, 256); });
  CHECK(error.code() == ErrorCode::kDataError);
  const std::string message = error.what();
  CHECK(message.find("token 50256 at index 0") != std::string::npos);
  CHECK(message.find("set model.vocab_size to at least 50257") != std::string::npos);
}

TEST_CASE("a dataset reads its shards in sorted path order rather than creation order") {
  TempDir dir;
  for (const char* name : {"part_c.bin", "part_a.bin", "part_b.bin"}) {
    write_token_shard(dir / name, std::vector<uint16_t>{static_cast<uint16_t>(name[5])});
  }
  TokenDataset data = TokenDataset::open((dir / "part_*.bin").string(), 256, 3);
  std::vector<int32_t> out(3);
  data.copy(0, 3, out.data());
  CHECK(out == std::vector<int32_t>{'a', 'b', 'c'});
  CHECK(data.shards()[0].path() == (dir / "part_a.bin").string());
}

TEST_CASE("a dataset copy crosses shard boundaries including empty and one-token shards") {
  TempDir dir;
  write_position_shards(dir, "s", {700, 0, 1, 1300});
  TokenDataset data = TokenDataset::open((dir / "s_*.bin").string(), 50000, 1);
  REQUIRE(data.num_tokens() == 2001);
  REQUIRE(data.shards().size() == 4);

  std::vector<int32_t> out(2001);
  for (int64_t pos = 0; pos + 5 <= 2001; ++pos) {
    data.copy(pos, 5, out.data());
    for (int64_t i = 0; i < 5; ++i) REQUIRE(out[i] == pos + i);
  }
  data.copy(0, 2001, out.data());
  for (int64_t i = 0; i < 2001; ++i) REQUIRE(out[i] == i);
  data.copy(698, 4, out.data());
  CHECK(out[0] == 698);
  CHECK(out[3] == 701);
}

TEST_CASE("a dataset glob that matches nothing says to run keel-prepare-data") {
  TempDir dir;
  const std::string pattern = (dir / "nothing_*.bin").string();
  Error error = thrown_error([&] { TokenDataset::open(pattern, 256, 1); });
  CHECK(error.code() == ErrorCode::kDataError);
  const std::string message = error.what();
  CHECK(message.find(pattern) != std::string::npos);
  CHECK(message.find("keel-prepare-data") != std::string::npos);
}

TEST_CASE("a dataset smaller than the minimum names both sizes") {
  TempDir dir;
  write_position_shards(dir, "small", {40, 60});
  Error error = thrown_error([&] { TokenDataset::open((dir / "small_*.bin").string(), 50000, 257); });
  CHECK(error.code() == ErrorCode::kDataError);
  const std::string message = error.what();
  CHECK(message.find("holds 100 tokens") != std::string::npos);
  CHECK(message.find("257") != std::string::npos);
}

TEST_CASE("a bad shard inside a dataset fails the whole dataset and names that shard") {
  TempDir dir;
  write_position_shards(dir, "mixed", {10});
  const fs::path bad = dir.write("mixed_000001.bin", shard_bytes(kGpt2Shard.magic, kGpt2Shard.version, 9, {1, 2}));
  Error error = thrown_error([&] { TokenDataset::open((dir / "mixed_*.bin").string(), 50000, 1); });
  CHECK(error.code() == ErrorCode::kDataError);
  CHECK(std::string(error.what()).find(bad.string() + ": truncated") != std::string::npos);
}

struct Batch {
  std::vector<int32_t> inputs;
  std::vector<int32_t> targets;
  bool operator==(const Batch&) const = default;
};

Batch train_slice(const TokenDataset& data, uint64_t seed, int64_t step, int64_t global_batch, int T, int64_t first,
                  int64_t count) {
  Batch b{std::vector<int32_t>(count * T), std::vector<int32_t>(count * T)};
  fill_train_batch(data, seed, step, global_batch, T, first, count, b.inputs.data(), b.targets.data());
  return b;
}

TEST_CASE("a training batch is the same whether fetched whole or in data-parallel and microbatch slices") {
  TempDir dir;
  write_position_shards(dir, "train", {700, 0, 1, 1300});
  TokenDataset data = TokenDataset::open((dir / "train_*.bin").string(), 50000, 1);
  constexpr int T = 16;
  constexpr int64_t kGlobal = 8;

  const Batch whole = train_slice(data, 1337, 5, kGlobal, T, 0, kGlobal);
  CHECK(train_slice(data, 1337, 5, kGlobal, T, 0, kGlobal) == whole);

  // Two uneven pieces, then DP 2 x 2 microbatches of 2 samples.
  for (const std::vector<int64_t>& cuts : {std::vector<int64_t>{0, 3, 8}, std::vector<int64_t>{0, 2, 4, 6, 8}}) {
    Batch joined;
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      Batch part = train_slice(data, 1337, 5, kGlobal, T, cuts[i], cuts[i + 1] - cuts[i]);
      joined.inputs.insert(joined.inputs.end(), part.inputs.begin(), part.inputs.end());
      joined.targets.insert(joined.targets.end(), part.targets.begin(), part.targets.end());
    }
    CHECK(joined == whole);
  }

  CHECK(train_slice(data, 1337, 6, kGlobal, T, 0, kGlobal) != whole);
  CHECK(train_slice(data, 1338, 5, kGlobal, T, 0, kGlobal) != whole);
}

TEST_CASE("training samples are contiguous windows whose targets are the inputs shifted by one token") {
  TempDir dir;
  write_position_shards(dir, "train", {700, 0, 1, 1300});
  TokenDataset data = TokenDataset::open((dir / "train_*.bin").string(), 50000, 1);
  constexpr int T = 16;
  const Batch b = train_slice(data, 7, 3, 64, T, 0, 64);
  for (int64_t i = 0; i < 64; ++i) {
    const int32_t start = b.inputs[i * T];
    CHECK(start >= 0);
    CHECK(start + T < data.num_tokens());
    for (int t = 0; t < T; ++t) {
      REQUIRE(b.inputs[i * T + t] == start + t);
      REQUIRE(b.targets[i * T + t] == start + t + 1);
    }
  }
}

TEST_CASE("training windows reach every start where T + 1 tokens fit and no other") {
  TempDir dir;
  constexpr int T = 8;
  write_position_shards(dir, "tiny", {T + 3});  // starts 0, 1 and 2 fit
  TokenDataset data = TokenDataset::open((dir / "tiny_*.bin").string(), 50000, T + 1);
  const Batch b = train_slice(data, 1, 0, 300, T, 0, 300);
  std::set<int32_t> starts;
  for (int64_t i = 0; i < 300; ++i) starts.insert(b.inputs[i * T]);
  CHECK(starts == std::set<int32_t>{0, 1, 2});

  TempDir small_dir;
  write_position_shards(small_dir, "tiny", {T});
  TokenDataset small = TokenDataset::open((small_dir / "tiny_*.bin").string(), 50000, 1);
  Error error = thrown_error([&] { train_slice(small, 1, 0, 1, T, 0, 1); });
  CHECK(error.code() == ErrorCode::kDataError);
  CHECK(std::string(error.what()).find("too few for one window") != std::string::npos);
}

TEST_CASE("validation batches are consecutive windows that repeat identically and wrap to the start") {
  TempDir dir;
  write_position_shards(dir, "val", {700, 0, 1, 1300});
  TokenDataset data = TokenDataset::open((dir / "val_*.bin").string(), 50000, 1);
  constexpr int T = 16;
  constexpr int B = 4;
  auto val = [&](int64_t index) {
    Batch b{std::vector<int32_t>(B * T), std::vector<int32_t>(B * T)};
    fill_val_batch(data, index, B, T, 0, B, b.inputs.data(), b.targets.data());
    return b;
  };
  const Batch first = val(0);
  CHECK(val(0) == first);
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      REQUIRE(first.inputs[b * T + t] == b * T + t);
      REQUIRE(first.targets[b * T + t] == b * T + t + 1);
    }
  }
  // (2001 - 1) / 16 = 125 whole windows; window 125 = batch 31, row 1 is window 0 again.
  const Batch wrapped = val(31);
  CHECK(wrapped.inputs[0 * T] == 124 * T);
  CHECK(wrapped.targets[0 * T + T - 1] == 2000);
  CHECK(wrapped.inputs[1 * T] == 0);
  CHECK(wrapped.inputs[3 * T] == 2 * T);

  // A slice of a batch (a DP rank's share) is the same windows.
  Batch slice{std::vector<int32_t>(2 * T), std::vector<int32_t>(2 * T)};
  fill_val_batch(data, 31, B, T, 2, 2, slice.inputs.data(), slice.targets.data());
  CHECK(std::equal(slice.inputs.begin(), slice.inputs.end(), wrapped.inputs.begin() + 2 * T));
  CHECK(std::equal(slice.targets.begin(), slice.targets.end(), wrapped.targets.begin() + 2 * T));
}

}  // TEST_SUITE("unit")

struct PrepareRun {
  keel::test::ProcessResult result;
  nlohmann::json summary;
};

PrepareRun prepare(const std::vector<std::string>& args) {
  std::vector<std::string> argv{keel::test::keel_binary("keel-prepare-data").string()};
  argv.insert(argv.end(), args.begin(), args.end());
  PrepareRun run{keel::test::run_process(argv, {}, 120), {}};
  // Output is stdout and stderr together; the JSON summary is its own line.
  std::istringstream lines(run.result.output);
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty() && line.front() == '{') run.summary = nlohmann::json::parse(line);
  }
  return run;
}

// Varied text of about `bytes` bytes, different per seed.
std::string corpus_text(int seed, size_t bytes) {
  static const char* words[] = {"keel", "checkpoint", "the", "gradient", "of", "a", "rank", "hangs", "and",
                                "resumes", "from", "step", "shard", "tokens", "loss", "falls", "\n"};
  std::string text;
  uint32_t state = static_cast<uint32_t>(seed) * 2654435761u + 1;
  while (text.size() < bytes) {
    state = state * 1664525u + 1013904223u;
    text += words[(state >> 16) % std::size(words)];
    text += (state >> 8) % 7 == 0 ? ". " : " ";
  }
  return text;
}

std::vector<uint8_t> dataset_bytes(const std::string& pattern) {
  TokenDataset data = TokenDataset::open(pattern, 256, 1);
  std::vector<int32_t> tokens(data.num_tokens());
  data.copy(0, data.num_tokens(), tokens.data());
  return {tokens.begin(), tokens.end()};
}

TEST_SUITE("integration") {

TEST_CASE("keel-prepare-data splits text files into byte-level train and val shards that reassemble the input") {
  TempDir dir;
  std::string all;
  std::vector<std::string> files;
  for (int i = 0; i < 3; ++i) {
    const std::string text = corpus_text(i, 30'000 + 7'777 * i);
    files.push_back(dir.write("text_" + std::to_string(i) + ".txt", text).string());
    all += text;
  }
  const std::string out = (dir / "out").string();
  std::vector<std::string> args{"--out", out, "--name", "tiny", "--val-fraction", "0.1", "--shard-tokens", "40000",
                                "--json"};
  args.insert(args.end(), files.begin(), files.end());
  PrepareRun run = prepare(args);
  CAPTURE(run.result.output);
  REQUIRE(run.result.exit_code == 0);
  REQUIRE(run.summary.is_object());

  const auto& s = run.summary;
  CHECK(s["files"] == 3);
  CHECK(s["bytes"] == all.size());
  CHECK(s["vocab_size"] == 256);
  const int64_t train_tokens = s["train_tokens"];
  const int64_t val_tokens = s["val_tokens"];
  CHECK(train_tokens + val_tokens == static_cast<int64_t>(all.size()));
  CHECK(s["train_shards"].size() == static_cast<size_t>((train_tokens + 39'999) / 40'000));
  CHECK(s["val_shards"].size() == 1);
  CHECK(s["shards_written"] == s["train_shards"].size() + s["val_shards"].size());
  CHECK(s["train_shards"][0] == out + "/tiny_train_000000.bin");

  const std::vector<uint8_t> train = dataset_bytes(s["train_glob"]);
  const std::vector<uint8_t> val = dataset_bytes(s["val_glob"]);
  REQUIRE(static_cast<int64_t>(train.size()) == train_tokens);
  REQUIRE(static_cast<int64_t>(val.size()) == val_tokens);

  // Every 10th 4096-byte chunk (indices 9, 19, ...) is validation.
  std::string rebuilt;
  size_t train_at = 0;
  size_t val_at = 0;
  for (size_t chunk = 0; rebuilt.size() < all.size(); ++chunk) {
    const size_t n = std::min<size_t>(4096, all.size() - rebuilt.size());
    if (chunk % 10 == 9) {
      rebuilt.append(val.begin() + val_at, val.begin() + val_at + n);
      val_at += n;
    } else {
      rebuilt.append(train.begin() + train_at, train.begin() + train_at + n);
      train_at += n;
    }
  }
  CHECK(rebuilt == all);

  std::array<double, 256> counts{};
  for (uint8_t t : train) counts[t] += 1;
  double nats = 0;
  for (double c : counts) {
    if (c > 0) nats -= c / train.size() * std::log(c / train.size());
  }
  CHECK(s["train_unigram_entropy_nats"].get<double>() == doctest::Approx(nats).epsilon(1e-9));
  CHECK(s["train_unigram_entropy_bits"].get<double>() == doctest::Approx(nats / std::log(2.0)).epsilon(1e-9));
}

TEST_CASE("keel-prepare-data prints a readable summary with the unigram entropy in nats and bits") {
  TempDir dir;
  const fs::path file = dir.write("a.txt", corpus_text(9, 5'000));
  PrepareRun run = prepare({"--out", (dir / "out").string(), "--val-fraction", "0", file.string()});
  CAPTURE(run.result.output);
  CHECK(run.result.exit_code == 0);
  CHECK(run.result.output.find("train: 5") != std::string::npos);
  CHECK(run.result.output.find("val:   none") != std::string::npos);
  CHECK(run.result.output.find("entropy") != std::string::npos);
  CHECK(run.result.output.find("nats") != std::string::npos);
  CHECK(run.result.output.find("bits") != std::string::npos);
  CHECK(fs::exists(dir / "out" / "corpus_train_000000.bin"));
  CHECK_FALSE(fs::exists(dir / "out" / "corpus_val_000000.bin"));
}

TEST_CASE("keel-prepare-data removes shards of an earlier larger run so the glob sees only the new set") {
  TempDir dir;
  const fs::path file = dir.write("a.txt", corpus_text(3, 50'000));
  const std::string out = (dir / "out").string();
  PrepareRun first = prepare({"--out", out, "--shard-tokens", "10000", "--json", file.string()});
  REQUIRE(first.result.exit_code == 0);
  REQUIRE(first.summary["train_shards"].size() == 5);

  PrepareRun second =
      prepare({"--out", out, "--shard-tokens", "30000", "--val-fraction", "0", "--json", file.string()});
  CAPTURE(second.result.output);
  REQUIRE(second.result.exit_code == 0);
  CHECK(second.summary["train_shards"].size() == 2);
  CHECK(second.summary["stale_shards_removed"] == 4);  // 3 train, 1 val
  CHECK(dataset_bytes(second.summary["train_glob"]).size() == fs::file_size(file));
  CHECK_FALSE(fs::exists(dir / "out" / "corpus_val_000000.bin"));
}

TEST_CASE("keel-prepare-data exits 3 naming a missing or empty input and writes nothing") {
  TempDir dir;
  const fs::path good = dir.write("good.txt", "hello");
  const std::string missing = (dir / "missing.txt").string();
  PrepareRun run = prepare({"--out", (dir / "out").string(), good.string(), missing});
  CHECK(run.result.exit_code == 3);
  CHECK(run.result.output.find(missing + ": cannot read: No such file or directory") != std::string::npos);
  CHECK_FALSE(fs::exists(dir / "out"));

  const fs::path empty = dir.write("empty.txt", "");
  PrepareRun empty_run = prepare({"--out", (dir / "out").string(), empty.string()});
  CHECK(empty_run.result.exit_code == 3);
  CHECK(empty_run.result.output.find("hold no bytes") != std::string::npos);
}

TEST_CASE("keel-prepare-data exits 2 on bad flags") {
  TempDir dir;
  const std::string file = dir.write("a.txt", "hello").string();
  const std::string out = (dir / "out").string();
  const std::vector<std::vector<std::string>> bad_args = {
      {"--out", out, "--no-such-flag", file},
      {"--out", out, "--val-fraction", "1.5", file},
      {"--out", out, "--val-fraction", "-0.1", file},
      {"--out", out, "--val-fraction", "0.9", file},
      {"--out", out, "--shard-tokens", "0", file},
      {"--out", out, "--name", "a/b", file},
      {"--out", out},
      {file},
  };
  for (const auto& args : bad_args) {
    PrepareRun run = prepare(args);
    CAPTURE(run.result.output);
    CHECK(run.result.exit_code == 2);
  }
  CHECK(prepare({"--out", out, "--val-fraction", "1.5", file}).result.output.find("--val-fraction 1.5") !=
        std::string::npos);
}

}  // TEST_SUITE("integration")

}  // namespace
