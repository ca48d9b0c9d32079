// keel-prepare-data: turns text files into byte-level llm.c token shards
// (docs/architecture.md "Data") that keel-trainer, and llm.c itself, read unchanged.
//
// Split rule: the inputs are read as one byte stream, cut into chunks of
// 4096 bytes, and every round(1 / val_fraction)-th chunk (chunk indices
// P-1, 2P-1, ...) goes to validation. The split is deterministic, spread over
// the whole corpus rather than taken from its tail (which is often one
// file), and the first chunk always goes to training.
#include "common/error.h"
#include "trainer/data/token_shard.h"

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
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace keel::trainer {
namespace {

namespace fs = std::filesystem;
using common::Error;
using common::ErrorCode;

constexpr uint64_t kChunkBytes = 4096;
constexpr int64_t kByteVocab = 256;
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

// Collects one split's tokens and writes a shard each time shard_tokens of
// them have accumulated, so memory stays bounded for any corpus size.
class SplitWriter {
 public:
  SplitWriter(fs::path dir, std::string prefix, int64_t shard_tokens)
      : dir_(std::move(dir)), prefix_(std::move(prefix)), shard_tokens_(static_cast<size_t>(shard_tokens)) {
    buffer_.reserve(std::min<size_t>(shard_tokens_, size_t{1} << 24));
  }

  void append(const uint8_t* bytes, size_t n) {
    while (n > 0) {
      const size_t take = std::min(n, shard_tokens_ - buffer_.size());
      buffer_.insert(buffer_.end(), bytes, bytes + take);
      bytes += take;
      n -= take;
      if (buffer_.size() == shard_tokens_) flush();
    }
  }

  void finish() {
    if (!buffer_.empty()) flush();
  }

  // Removes shards of this prefix beyond the ones just written: left over
  // from an earlier, larger run, they would match the trainer's glob and
  // silently mix old data into the new set.
  int remove_stale() const {
    int removed = 0;
    const std::string head = prefix_ + "_";
    for (const auto& entry : fs::directory_iterator(dir_)) {
      const std::string file = entry.path().filename().string();
      if (file.size() != head.size() + 10 || file.compare(0, head.size(), head) != 0 ||
          file.compare(head.size() + 6, 4, ".bin") != 0) {
        continue;
      }
      const std::string digits = file.substr(head.size(), 6);
      if (digits.find_first_not_of("0123456789") != std::string::npos) continue;
      if (std::stoul(digits) < written_.size()) continue;
      std::error_code error;
      if (!fs::remove(entry.path(), error)) {
        fail(ErrorCode::kDataError, fmt::format("{}: cannot remove this stale shard of an earlier run: {}",
                                                entry.path().string(), error.message()));
      }
      ++removed;
    }
    return removed;
  }

  int64_t tokens() const { return tokens_; }
  const std::vector<std::string>& written() const { return written_; }
  std::string glob() const { return (dir_ / (prefix_ + "_*.bin")).string(); }

 private:
  void flush() {
    const fs::path path = dir_ / fmt::format("{}_{:06}.bin", prefix_, written_.size());
    write_token_shard(path, buffer_);
    written_.push_back(path.string());
    tokens_ += static_cast<int64_t>(buffer_.size());
    buffer_.clear();
  }

  fs::path dir_;
  std::string prefix_;
  size_t shard_tokens_;
  std::vector<uint16_t> buffer_;
  std::vector<std::string> written_;
  int64_t tokens_ = 0;
};

struct Summary {
  size_t files = 0;
  uint64_t bytes = 0;
  std::array<uint64_t, kByteVocab> train_counts{};
};

// Entropy of the training split's byte distribution: the cross-entropy a
// model reaches by learning byte frequencies alone, so the loss a trained
// model must beat.
double unigram_entropy_nats(const std::array<uint64_t, kByteVocab>& counts) {
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

void read_input(const std::string& input, uint64_t period, uint64_t total_bytes, Summary& summary,
                SplitWriter& train, SplitWriter& val) {
  const int fd = ::open(input.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(ErrorCode::kDataError, fmt::format("{}: cannot read: {}", input, std::strerror(errno)));
  std::vector<uint8_t> buffer(kReadBytes);
  for (;;) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      ::close(fd);
      fail(ErrorCode::kDataError, fmt::format("{}: read failed: {}", input, std::strerror(error)));
    }
    if (n == 0) break;
    const uint64_t before = summary.bytes;
    for (size_t at = 0; at < static_cast<size_t>(n);) {
      const uint64_t stream_pos = summary.bytes + at;
      const uint64_t chunk = stream_pos / kChunkBytes;
      const size_t take = std::min<size_t>(static_cast<size_t>(n) - at, kChunkBytes - stream_pos % kChunkBytes);
      if (period != 0 && chunk % period == period - 1) {
        val.append(buffer.data() + at, take);
      } else {
        for (size_t i = 0; i < take; ++i) ++summary.train_counts[buffer[at + i]];
        train.append(buffer.data() + at, take);
      }
      at += take;
    }
    summary.bytes += static_cast<uint64_t>(n);
    if (total_bytes >= kProgressBytes && summary.bytes / kProgressBytes != before / kProgressBytes) {
      std::fprintf(stderr, "keel-prepare-data: read %llu of %llu MiB (%.0f%%)\n",
                   static_cast<unsigned long long>(summary.bytes >> 20),
                   static_cast<unsigned long long>(total_bytes >> 20),
                   100.0 * static_cast<double>(summary.bytes) / static_cast<double>(total_bytes));
    }
  }
  ::close(fd);
  ++summary.files;
}

void print_summary(const Options& options, const Summary& summary, const SplitWriter& train,
                   const SplitWriter& val, int removed) {
  const double nats = unigram_entropy_nats(summary.train_counts);
  const double bits = nats / std::log(2.0);
  if (options.json) {
    nlohmann::json out = {
        {"files", summary.files},
        {"bytes", summary.bytes},
        {"vocab_size", kByteVocab},
        {"train_tokens", train.tokens()},
        {"val_tokens", val.tokens()},
        {"train_shards", train.written()},
        {"val_shards", val.written()},
        {"shards_written", train.written().size() + val.written().size()},
        {"stale_shards_removed", removed},
        {"train_glob", train.glob()},
        {"val_glob", val.written().empty() ? std::string() : val.glob()},
        {"train_unigram_entropy_nats", nats},
        {"train_unigram_entropy_bits", bits},
    };
    std::fputs((out.dump() + "\n").c_str(), stdout);
    return;
  }
  std::string text = fmt::format("read {} file(s), {} bytes (byte-level tokens, vocab_size {})\n", summary.files,
                                 summary.bytes, kByteVocab);
  text += fmt::format("train: {} tokens in {} shard(s): {}\n", train.tokens(), train.written().size(), train.glob());
  if (val.written().empty()) {
    text += "val:   none\n";
  } else {
    text += fmt::format("val:   {} tokens in {} shard(s): {}\n", val.tokens(), val.written().size(), val.glob());
  }
  if (removed > 0) text += fmt::format("removed {} stale shard(s) of an earlier run\n", removed);
  text += fmt::format("train byte-unigram entropy: {:.4f} nats = {:.4f} bits per token "
                      "(the loss of a model that knows only byte frequencies)\n",
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

  SplitWriter train(options.out, options.name + "_train", options.shard_tokens);
  SplitWriter val(options.out, options.name + "_val", options.shard_tokens);
  Summary summary;
  for (const auto& input : options.inputs) read_input(input, period, total_bytes, summary, train, val);
  train.finish();
  val.finish();
  const int removed = train.remove_stale() + val.remove_stale();

  if (period != 0 && val.tokens() == 0) {
    std::fprintf(stderr,
                 "keel-prepare-data: warning: the corpus has fewer than %llu chunks of %llu bytes, so the "
                 "validation split is empty and no val shards were written; add data or use --val-fraction 0\n",
                 static_cast<unsigned long long>(period), static_cast<unsigned long long>(kChunkBytes));
  }
  print_summary(options, summary, train, val, removed);
  return 0;
}

}  // namespace
}  // namespace keel::trainer

int main(int argc, char** argv) {
  using keel::common::ErrorCode;
  using keel::common::exit_code;

  keel::trainer::Options options;
  CLI::App app{"Tokenizes text files byte by byte (vocab_size 256) into llm.c token shards for keel-trainer.",
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
