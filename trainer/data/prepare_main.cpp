// keel-prepare-data: turns text files into token shards (docs/architecture.md
// "Data"): llm.c's, which keel-trainer and llm.c itself read unchanged, or a
// Megatron-LM indexed dataset; tokens are bytes (vocab_size 256) or a
// SentencePiece model's, given or trained here on the training split.
//
// Split rule: the inputs are cut into chunks, and every
// round(1 / val_fraction)-th chunk (chunk indices P-1, 2P-1, ...) goes to
// validation. The split is deterministic, spread over the whole corpus
// rather than taken from its tail (which is often one file), and the first
// chunk always goes to training. Bytes: chunks of 4096 bytes of the inputs
// read as one stream. With a tokenizer: runs of whole lines of at least
// 4096 bytes within a file, so no token and no character is cut; each
// input file is a document, ended by the tokenizer's end-of-document
// token when it has one.
#include "common/error.h"
#include "trainer/data/text_tokenizer.h"
#include "trainer/data/token_writers.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace keel::trainer {
namespace {

namespace fs = std::filesystem;
using common::Error;
using common::ErrorCode;

constexpr uint64_t kChunkBytes = 4096;
constexpr size_t kReadBytes = size_t{1} << 20;
// Inputs at least this large get progress lines on stderr.
constexpr uint64_t kProgressBytes = uint64_t{64} << 20;

struct Options {
  fs::path out;
  std::string name = "corpus";
  double val_fraction = 0.1;
  int64_t shard_tokens = 100'000'000;
  bool json = false;
  std::vector<std::string> inputs;
  std::string tokenizer;        // a SentencePiece model file; empty: bytes
  int64_t train_tokenizer = 0;  // train a BPE model of this many pieces first; 0: no
  std::string format = "llmc";  // "llmc" | "megatron"
};

[[noreturn]] void fail(ErrorCode code, const std::string& message) { throw Error(code, message); }

// Every val_period-th chunk is validation; 0 means no validation split.
uint64_t val_period(const Options& options) {
  if (!(options.val_fraction >= 0.0 && options.val_fraction < 1.0)) {
    fail(ErrorCode::kBadConfig,
         fmt::format("--val-fraction {} is outside [0, 1): use e.g. 0.1, or 0 for no validation split",
                     options.val_fraction));
  }
  if (options.val_fraction == 0.0) return 0;
  const auto period = static_cast<uint64_t>(std::llround(1.0 / options.val_fraction));
  if (period < 2) {
    fail(ErrorCode::kBadConfig,
         fmt::format("--val-fraction {} would send every chunk to validation and leave nothing to train on: "
                     "use at most 0.66",
                     options.val_fraction));
  }
  return period;
}

void check_name(const std::string& name) {
  if (name.empty() || name.find('/') != std::string::npos) {
    fail(ErrorCode::kBadConfig,
         fmt::format("--name '{}' must be a non-empty file name prefix without '/'; put the directory in --out",
                     name));
  }
}

// Checks every input before anything is written, so a typo in the last file
// name does not leave a directory of shards from the first few.
uint64_t check_inputs(const std::vector<std::string>& inputs) {
  uint64_t total = 0;
  for (const auto& input : inputs) {
    struct stat st {};
    if (::stat(input.c_str(), &st) != 0) {
      fail(ErrorCode::kDataError, fmt::format("{}: cannot read: {}", input, std::strerror(errno)));
    }
    if (S_ISDIR(st.st_mode)) {
      fail(ErrorCode::kDataError, fmt::format("{}: is a directory: pass the text files inside it", input));
    }
    if (!S_ISREG(st.st_mode)) {
      fail(ErrorCode::kDataError, fmt::format("{}: is not a regular file: pass plain text files", input));
    }
    if (::access(input.c_str(), R_OK) != 0) {
      fail(ErrorCode::kDataError, fmt::format("{}: cannot read: {}", input, std::strerror(errno)));
    }
    total += static_cast<uint64_t>(st.st_size);
  }
  if (total == 0) {
    fail(ErrorCode::kDataError, fmt::format("the {} input file(s) hold no bytes: nothing to tokenize", inputs.size()));
  }
  return total;
}

struct Summary {
  size_t files = 0;
  uint64_t bytes = 0;
  std::vector<uint64_t> train_counts;  // by token id
};

// Entropy of the training split's token distribution: the cross-entropy a
// model reaches by learning token frequencies alone, so the loss a trained
// model must beat.
double unigram_entropy_nats(const std::vector<uint64_t>& counts) {
  uint64_t total = 0;
  for (uint64_t c : counts) total += c;
  double entropy = 0.0;
  for (uint64_t c : counts) {
    if (c == 0) continue;
    const double p = static_cast<double>(c) / static_cast<double>(total);
    entropy -= p * std::log(p);
  }
  return entropy;
}

void progress(uint64_t before, uint64_t now, uint64_t total_bytes) {
  if (total_bytes >= kProgressBytes && now / kProgressBytes != before / kProgressBytes) {
    std::fprintf(stderr, "keel-prepare-data: read %llu of %llu MiB (%.0f%%)\n", static_cast<unsigned long long>(now >> 20),
                 static_cast<unsigned long long>(total_bytes >> 20),
                 100.0 * static_cast<double>(now) / static_cast<double>(total_bytes));
  }
}

// Calls on_chunk(text, chunk index) for every chunk of the inputs (the
// split rule above; a byte chunk that straddles two files comes as two
// pieces with one index) and on_file_end() after each input. Counts the
// bytes read into summary.bytes.
void for_each_chunk(const Options& options, bool whole_lines, uint64_t total_bytes, Summary& summary,
                    const std::function<void(std::string_view, uint64_t)>& on_chunk,
                    const std::function<void()>& on_file_end) {
  summary.bytes = 0;
  summary.files = 0;
  uint64_t chunk = 0;
  std::vector<char> buffer(kReadBytes);
  std::string pending;  // whole lines not yet a chunk
  for (const auto& input : options.inputs) {
    const int fd = ::open(input.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail(ErrorCode::kDataError, fmt::format("{}: cannot read: {}", input, std::strerror(errno)));
    for (;;) {
      const ssize_t n = ::read(fd, buffer.data(), buffer.size());
      if (n < 0) {
        if (errno == EINTR) continue;
        const int error = errno;
        ::close(fd);
        fail(ErrorCode::kDataError, fmt::format("{}: read failed: {}", input, std::strerror(error)));
      }
      if (n == 0) break;
      const std::string_view read(buffer.data(), static_cast<size_t>(n));
      if (!whole_lines) {
        for (size_t at = 0; at < read.size();) {
          const uint64_t stream_pos = summary.bytes + at;
          const size_t take = std::min<size_t>(read.size() - at, kChunkBytes - stream_pos % kChunkBytes);
          on_chunk(read.substr(at, take), stream_pos / kChunkBytes);
          at += take;
        }
      } else {
        for (size_t at = 0; at < read.size();) {
          const size_t newline = read.find('\n', at);
          const size_t end = newline == std::string_view::npos ? read.size() : newline + 1;
          pending.append(read.substr(at, end - at));
          at = end;
          if (newline != std::string_view::npos && pending.size() >= kChunkBytes) {
            on_chunk(pending, chunk++);
            pending.clear();
          }
        }
      }
      progress(summary.bytes, summary.bytes + static_cast<uint64_t>(n), total_bytes);
      summary.bytes += static_cast<uint64_t>(n);
    }
    ::close(fd);
    if (!pending.empty()) {
      on_chunk(pending, chunk++);
      pending.clear();
    }
    ++summary.files;
    on_file_end();
  }
}

bool is_val(uint64_t period, uint64_t chunk) { return period != 0 && chunk % period == period - 1; }

// The tokenizer the options ask for; with --train-tokenizer, trained first
// on the training split's text alone (so the validation text stays held out).
std::unique_ptr<TextTokenizer> tokenizer_for(const Options& options, uint64_t period, uint64_t total_bytes,
                                             fs::path& trained) {
  if (!options.tokenizer.empty() && options.train_tokenizer > 0) {
    fail(ErrorCode::kBadConfig, "--tokenizer and --train-tokenizer both name a tokenizer: pass one");
  }
  if (!options.tokenizer.empty()) return load_sentencepiece(options.tokenizer);
  if (options.train_tokenizer == 0) return byte_tokenizer();
  const fs::path text = options.out / ("." + options.name + "_tokenizer_text.txt");
  {
    std::ofstream out(text, std::ios::binary | std::ios::trunc);
    Summary ignored;
    for_each_chunk(options, true, total_bytes, ignored, [&](std::string_view chunk, uint64_t index) {
      if (!is_val(period, index)) out.write(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    }, [] {});
    if (!out) fail(ErrorCode::kDataError, fmt::format("{}: cannot write the tokenizer's training text", text.string()));
  }
  std::fprintf(stderr, "keel-prepare-data: training a %lld-piece BPE SentencePiece model on the training split\n",
               static_cast<long long>(options.train_tokenizer));
  trained = options.out / options.name;
  try {
    train_sentencepiece(text, options.train_tokenizer, trained, static_cast<int>(std::thread::hardware_concurrency()));
  } catch (...) {
    fs::remove(text);
    throw;
  }
  fs::remove(text);
  trained += ".model";
  return load_sentencepiece(trained);
}

void print_summary(const Options& options, const Summary& summary, const TextTokenizer& tokenizer,
                   const fs::path& trained, const TokenWriter& train, const TokenWriter& val, int removed) {
  const double nats = unigram_entropy_nats(summary.train_counts);
  const double bits = nats / std::log(2.0);
  const std::string val_source = val.tokens() == 0 ? std::string() : val.source();
  if (options.json) {
    nlohmann::json out = {
        {"files", summary.files},
        {"bytes", summary.bytes},
        {"tokenizer", tokenizer.name()},
        {"tokenizer_model", trained.empty() ? options.tokenizer : trained.string()},
        {"vocab_size", tokenizer.vocab_size()},
        {"format", options.format},
        {"train_tokens", train.tokens()},
        {"val_tokens", val.tokens()},
        {"train_shards", train.written()},
        {"val_shards", val.tokens() == 0 ? std::vector<std::string>() : val.written()},
        {"shards_written", train.written().size() + (val.tokens() == 0 ? 0 : val.written().size())},
        {"stale_shards_removed", removed},
        {"train_glob", train.source()},  // what data.train takes: a glob, or a Megatron prefix
        {"val_glob", val_source},
        {"train_unigram_entropy_nats", nats},
        {"train_unigram_entropy_bits", bits},
    };
    std::fputs((out.dump() + "\n").c_str(), stdout);
    return;
  }
  std::string text = fmt::format("read {} file(s), {} bytes (tokens: {}, vocab_size {})\n", summary.files,
                                 summary.bytes, tokenizer.name(), tokenizer.vocab_size());
  if (!trained.empty()) text += fmt::format("tokenizer trained: {}\n", trained.string());
  text += fmt::format("train: {} tokens ({}): data.train = \"{}\"\n", train.tokens(), options.format, train.source());
  text += val_source.empty() ? std::string("val:   none\n")
                             : fmt::format("val:   {} tokens: data.val = \"{}\"\n", val.tokens(), val_source);
  if (removed > 0) text += fmt::format("removed {} stale shard(s) of an earlier run\n", removed);
  text += fmt::format("train token-unigram entropy: {:.4f} nats = {:.4f} bits per token "
                      "(the loss of a model that knows only token frequencies)\n",
                      nats, bits);
  std::fputs(text.c_str(), stdout);
}

int prepare(const Options& options) {
  const uint64_t period = val_period(options);
  check_name(options.name);
  const uint64_t total_bytes = check_inputs(options.inputs);

  std::error_code error;
  fs::create_directories(options.out, error);
  if (error) {
    fail(ErrorCode::kDataError,
         fmt::format("{}: cannot create the output directory: {}", options.out.string(), error.message()));
  }
  fs::path trained;
  const auto tokenizer = tokenizer_for(options, period, total_bytes, trained);
  const int64_t vocab = tokenizer->vocab_size();
  auto writer = [&](const std::string& split) {
    return options.format == "megatron" ? megatron_writer(options.out, options.name + "_" + split, vocab)
                                        : llmc_shard_writer(options.out, options.name + "_" + split,
                                                            options.shard_tokens, vocab);
  };
  const auto train = writer("train");
  const auto val = writer("val");
  Summary summary;
  summary.train_counts.assign(static_cast<size_t>(vocab), 0);
  std::vector<int32_t> ids;
  for_each_chunk(
      options, /*whole_lines=*/options.train_tokenizer > 0 || !options.tokenizer.empty(), total_bytes, summary,
      [&](std::string_view text, uint64_t chunk) {
        ids.clear();
        tokenizer->encode(text, ids);
        if (is_val(period, chunk)) {
          val->add_sequence(ids);
          return;
        }
        for (int32_t id : ids) ++summary.train_counts[static_cast<size_t>(id)];
        train->add_sequence(ids);
      },
      [&] {
        const auto end = tokenizer->end_of_document();
        if (end) ++summary.train_counts[static_cast<size_t>(*end)];
        train->end_document(end);
        val->end_document(end);
      });
  train->finish();
  val->finish();
  const int removed = train->remove_stale() + val->remove_stale();

  if (period != 0 && val->tokens() == 0) {
    std::fprintf(stderr,
                 "keel-prepare-data: warning: the corpus has fewer than %llu chunks of %llu bytes, so the "
                 "validation split is empty; add data or use --val-fraction 0\n",
                 static_cast<unsigned long long>(period), static_cast<unsigned long long>(kChunkBytes));
  }
  print_summary(options, summary, *tokenizer, trained, *train, *val, removed);
  return 0;
}

}  // namespace
}  // namespace keel::trainer

int main(int argc, char** argv) {
  using keel::common::ErrorCode;
  using keel::common::exit_code;

  keel::trainer::Options options;
  CLI::App app{"Tokenizes text files (bytes, vocab_size 256, or a SentencePiece model) into llm.c token shards or "
               "a Megatron-LM indexed dataset for keel-trainer.",
               "keel-prepare-data"};
  app.add_option("--out", options.out, "directory for the shards (created if missing)")->required()->type_name("DIR");
  app.add_option("--name", options.name, "shard name prefix: writes NAME_train_000000.bin, NAME_val_000000.bin, ...")
      ->capture_default_str()
      ->type_name("NAME");
  app.add_option("--val-fraction", options.val_fraction,
                 "share of the corpus for validation, in [0, 1): every round(1/F)-th 4096-byte chunk; "
                 "0 writes no val shards")
      ->type_name("F")
      ->capture_default_str();
  app.add_option("--shard-tokens", options.shard_tokens, "most tokens per shard")
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{std::numeric_limits<int32_t>::max()}));
  app.add_flag("--json", options.json, "print the summary as one JSON object");
  app.add_option("--tokenizer", options.tokenizer, "encode with this SentencePiece model (e.g. Llama 2's tokenizer.model)")
      ->type_name("MODEL");
  app.add_option("--train-tokenizer", options.train_tokenizer,
                 "first train a byte-fallback BPE SentencePiece model of this many pieces on the training split, "
                 "written as OUT/NAME.model, then encode with it")
      ->type_name("VOCAB_SIZE")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--format", options.format,
                 "llmc: llm.c token shards (NAME_train_000000.bin, ...); megatron: a Megatron-LM indexed dataset "
                 "(NAME_train.bin and .idx)")
      ->check(CLI::IsMember({"llmc", "megatron"}))
      ->capture_default_str();
  app.add_option("files", options.inputs, "text files to tokenize, read in the order given")
      ->required()
      ->type_name("FILE");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help exits 0; every other parse error is a usage error (docs/architecture.md "Worker contract").
    return app.exit(e) == 0 ? 0 : exit_code(ErrorCode::kBadConfig);
  }

  try {
    return keel::trainer::prepare(options);
  } catch (const keel::common::Error& e) {
    std::fprintf(stderr, "keel-prepare-data: error: %s\n", e.what());
    if (e.code() == ErrorCode::kBadConfig) std::fprintf(stderr, "Run with --help for more information.\n");
    return exit_code(e.code());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "keel-prepare-data: error: %s\n", e.what());
    return exit_code(ErrorCode::kInternal);
  }
}
