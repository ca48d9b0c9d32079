// Megatron-LM indexed datasets and blends (docs/architecture.md "Data"): a
// dataset written by an independent Python writer
// (tests/python/write_megatron_dataset.py) reads back as exactly its
// tokens; a blend draws its sources in their proportions, each sample from
// one source, the same samples in any DP slicing; one source draws as it
// always did; a damaged dataset is refused with a sentence naming the file.
#include "common/error.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"
#include "tests/trainer/trainer_runs.h"
#include "trainer/data/batches.h"
#include "trainer/data/data_mix.h"
#include "trainer/data/megatron_dataset.h"

#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using keel::common::Error;
using keel::common::ErrorCode;
using keel::trainer::DataMix;
using keel::trainer::MegatronDataset;

// Writes PREFIX.bin/.idx with the independent writer; the tokens it wrote.
std::vector<int32_t> write_dataset(const fs::path& prefix, const std::string& dtype, int documents, int vocab,
                                   int seed) {
  const auto result = keel::test::run_process({KEEL_SYSTEM_PYTHON,
                                               std::string(KEEL_TESTS_DIR) + "/python/write_megatron_dataset.py",
                                               prefix.string(), dtype, std::to_string(documents),
                                               std::to_string(vocab), std::to_string(seed)});
  INFO(result.output);
  REQUIRE(result.exit_code == 0);
  return keel::test::last_json_line(result.output).at("tokens").get<std::vector<int32_t>>();
}

std::string refusal(const std::function<void()>& open) {
  try {
    open();
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kDataError);
    return e.what();
  }
  return "(opened without complaint)";
}

// Overwrites `bytes` at `offset` of `path`.
void patch(const fs::path& path, std::streamoff offset, const std::string& bytes) {
  std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
  io.seekp(offset);
  io.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

template <class T> std::string bytes_of(T value) { return std::string(reinterpret_cast<const char*>(&value), sizeof(T)); }

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("a Megatron-LM dataset written by an independent writer reads back as exactly its tokens") {
    keel::test::TempDir dir;
    for (const std::string dtype : {"uint16", "int32"}) {
      CAPTURE(dtype);
      const int vocab = dtype == "uint16" ? 50257 : 128256;
      const auto prefix = dir / ("corpus_" + dtype);
      const auto tokens = write_dataset(prefix, dtype, 40, vocab, 7);
      REQUIRE(MegatronDataset::exists(prefix.string()));
      const auto data = MegatronDataset::open(prefix.string(), vocab, 1);
      CHECK(data.sequences() == 40);
      CHECK(data.documents() == 40);
      CHECK(data.token_bytes() == (dtype == "uint16" ? 2u : 4u));
      REQUIRE(data.num_tokens() == static_cast<int64_t>(tokens.size()));
      std::vector<int32_t> all(tokens.size());
      data.copy(0, data.num_tokens(), all.data());
      CHECK(all == tokens);
      std::vector<int32_t> window(17);  // windows across document ends read the stream too
      for (int64_t at = 0; at + 17 <= data.num_tokens(); at += 13) {
        data.copy(at, 17, window.data());
        CHECK(std::equal(window.begin(), window.end(), tokens.begin() + at));
      }
      // The same prefix through the source a config names.
      const auto stream = keel::trainer::open_token_stream(prefix.string(), vocab, 1);
      CHECK(stream->num_tokens() == data.num_tokens());
    }
  }

  TEST_CASE("a blend draws each source in its proportion and every sample from one source in any DP slicing") {
    keel::test::TempDir dir;
    // Source a holds tokens below 1000, source b the tokens 1000 and up.
    write_dataset(dir / "a", "uint16", 200, 1000, 1);
    auto b_tokens = write_dataset(dir / "b", "int32", 200, 1000, 2);
    {
      // Lift b's tokens past a's, file and index unchanged in shape.
      std::ifstream in(dir / "b.bin", std::ios::binary);
      std::vector<int32_t> raw(b_tokens.size());
      in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(raw.size() * 4));
      for (auto& t : raw) t += 1000;
      std::ofstream(dir / "b.bin", std::ios::binary)
          .write(reinterpret_cast<const char*>(raw.data()), static_cast<std::streamsize>(raw.size() * 4));
    }
    const auto mix = DataMix::open({{0.7, true, (dir / "a").string()}, {0.3, true, (dir / "b").string()}}, 2000, 9);
    REQUIRE(mix.size() == 2);
    constexpr int kSamples = 10000;
    int from_a = 0;
    for (uint64_t counter = 0; counter < kSamples; ++counter) from_a += mix.draw(1337, counter) == 0;
    // Binomial(10000, 0.7): standard deviation 0.0046; 0.02 is over four.
    CHECK(std::fabs(from_a / static_cast<double>(kSamples) - 0.7) < 0.02);

    constexpr int T = 8, B = 64;
    std::vector<int32_t> inputs(B * T), targets(B * T), part_in(B * T), part_tg(B * T);
    for (int64_t step : {0, 5, 123}) {
      keel::trainer::fill_train_batch(mix, 1337, step, B, T, 0, B, inputs.data(), targets.data());
      for (int i = 0; i < B; ++i) {
        const bool a = mix.draw(1337, static_cast<uint64_t>(step * B + i)) == 0;
        for (int t = 0; t < T; ++t) {
          CHECK((inputs[i * T + t] < 1000) == a);
          CHECK((targets[i * T + t] < 1000) == a);
        }
      }
      // Four DP ranks of 16 samples each fill the same samples.
      for (int r = 0; r < 4; ++r) {
        keel::trainer::fill_train_batch(mix, 1337, step, B, T, r * 16, 16, part_in.data() + r * 16 * T,
                                        part_tg.data() + r * 16 * T);
      }
      CHECK(part_in == inputs);
      CHECK(part_tg == targets);
    }

    // A blend of one source draws nothing: the samples of the stream alone.
    const auto one = DataMix::open({{1.0, true, (dir / "a").string()}}, 2000, 9);
    const auto a = MegatronDataset::open((dir / "a").string(), 2000, 9);
    keel::trainer::fill_train_batch(one, 1337, 9, B, T, 0, B, inputs.data(), targets.data());
    keel::trainer::fill_train_batch(a, 1337, 9, B, T, 0, B, part_in.data(), part_tg.data());
    CHECK(inputs == part_in);
  }

  TEST_CASE("a damaged Megatron-LM dataset is refused with a sentence naming the file and what is wrong") {
    keel::test::TempDir dir;
    struct Row {
      const char* what;
      std::function<void(const fs::path& prefix)> damage;
      int vocab;
      const char* said;
    };
    // The header: magic 0-8, version 9-16, dtype code 17, sequences 18-25,
    // documents 26-33; then 40 lengths (int32), 40 offsets, 41 document entries.
    constexpr std::streamoff kLengths = 34, kOffsets = kLengths + 40 * 4, kDocuments = kOffsets + 40 * 8;
    const Row rows[] = {
        {"the wrong magic", [](const fs::path& p) { patch(p.string() + ".idx", 0, "MMIDIDY"); }, 300, "wrong magic"},
        {"version 2", [](const fs::path& p) { patch(p.string() + ".idx", 9, bytes_of<uint64_t>(2)); }, 300,
         "index version 2: keel reads version 1"},
        {"float32 tokens", [](const fs::path& p) { patch(p.string() + ".idx", 17, bytes_of<uint8_t>(7)); }, 300,
         "dtype code 7"},
        {"a truncated index",
         [](const fs::path& p) { fs::resize_file(p.string() + ".idx", fs::file_size(p.string() + ".idx") - 8); }, 300,
         "truncated or corrupt"},
        {"a .bin shorter than the sizes say",
         [](const fs::path& p) { fs::resize_file(p.string() + ".bin", fs::file_size(p.string() + ".bin") - 2); }, 300,
         "do not belong together"},
        {"an offset that disagrees with the lengths",
         [](const fs::path& p) { patch(p.string() + ".idx", kOffsets + 8 * 3, bytes_of<int64_t>(1)); }, 300,
         "the lengths and offsets disagree"},
        {"a negative length", [](const fs::path& p) { patch(p.string() + ".idx", kLengths, bytes_of<int32_t>(-1)); },
         300, "the lengths and offsets disagree"},
        {"a document index that decreases",
         [](const fs::path& p) { patch(p.string() + ".idx", kDocuments + 8 * 5, bytes_of<int64_t>(1)); }, 300,
         "document index entry 5 is 1"},
        {"a token past the vocabulary", [](const fs::path&) {}, 100, "is outside model.vocab_size 100"},
        {"no .bin", [](const fs::path& p) { fs::remove(p.string() + ".bin"); }, 300, "cannot open"},
    };
    int n = 0;
    for (const Row& row : rows) {
      INFO(row.what);
      const auto prefix = dir / ("damaged" + std::to_string(n++));
      write_dataset(prefix, "uint16", 40, 300, 3);
      row.damage(prefix);
      const std::string said = refusal([&] { MegatronDataset::open(prefix.string(), row.vocab, 1); });
      CHECK_MESSAGE(said.find(row.said) != std::string::npos, said);
      CHECK(said.find(prefix.string()) != std::string::npos);
    }
  }
}

TEST_SUITE("integration") {
  TEST_CASE("a run on a blend of Megatron-LM datasets stopped and resumed in its layout or another continues its samples") {
    keel::test::TrainerRuns f;
    const auto web = (f.dir() / "web").string(), code = (f.dir() / "code").string();
    write_dataset(web, "uint16", 300, 256, 1);
    write_dataset(code, "int32", 300, 256, 2);
    const std::vector<std::string> sets = {"data.train=[\"0.7 " + web + "\", \"0.3 " + code + "\"]",
                                           "data.val=" + web, "train.steps=8", "train.val_every=4",
                                           "checkpoint.every_steps=4"};
    using keel::test::Layout;
    const auto whole = f.run(Layout{.dp = 2}, "whole", sets);
    REQUIRE(whole.losses.size() == 8);
    f.run(Layout{.dp = 2}, "resumed", sets, {"--stop-after", "4"}, 14);
    const auto resumed = f.run(Layout{.dp = 2}, "resumed", sets);
    CHECK(resumed.exact == whole.exact);
    // Resumed on one rank: the same samples, summed in another order.
    f.run(Layout{.dp = 2}, "shrunk", sets, {"--stop-after", "4"}, 14);
    const auto shrunk = f.run(Layout{}, "shrunk", sets);
    REQUIRE(shrunk.losses.size() == 8);
    for (size_t s = 4; s < 8; ++s) {
      CAPTURE(s);
      CHECK(std::fabs(shrunk.losses[s] - whole.losses[s]) <= 1e-5 * whole.losses[s]);
    }
  }
}
