#include "trainer/data/token_writers.h"

#include "checkpoint/manifest.h"
#include "common/atomic_file.h"
#include "common/error.h"
#include "trainer/data/megatron_dataset.h"
#include "trainer/data/token_shard.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>

namespace keel::trainer {
namespace {

namespace fs = std::filesystem;
using common::Error;
using common::ErrorCode;

[[noreturn]] void fail(const std::string& what) { throw Error(ErrorCode::kDataError, what); }

// Shards of one split, written each time shard_tokens have accumulated so
// memory stays bounded for any corpus size.
class LlmcShardWriter final : public TokenWriter {
 public:
  LlmcShardWriter(fs::path dir, std::string name, int64_t shard_tokens, int64_t vocab_size)
      : dir_(std::move(dir)), name_(std::move(name)), shard_tokens_(static_cast<size_t>(shard_tokens)),
        wide_(vocab_size > 65536) {
    buffer_.reserve(std::min<size_t>(shard_tokens_, size_t{1} << 24));
  }

  void add_sequence(const std::vector<int32_t>& tokens) override { append(tokens.data(), tokens.size()); }
  void end_document(std::optional<int32_t> end) override {
    if (end) append(&*end, 1);
  }
  void finish() override {
    if (!buffer_.empty()) flush();
  }

  int remove_stale() const override {
    int removed = 0;
    const std::string head = name_ + "_";
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
        fail(fmt::format("{}: cannot remove this stale shard of an earlier run: {}", entry.path().string(),
                         error.message()));
      }
      ++removed;
    }
    return removed;
  }

  int64_t tokens() const override { return tokens_; }
  std::vector<std::string> written() const override { return written_; }
  std::string source() const override { return (dir_ / (name_ + "_*.bin")).string(); }

 private:
  void append(const int32_t* tokens, size_t n) {
    while (n > 0) {
      const size_t take = std::min(n, shard_tokens_ - buffer_.size());
      buffer_.insert(buffer_.end(), tokens, tokens + take);
      tokens += take;
      n -= take;
      if (buffer_.size() == shard_tokens_) flush();
    }
  }
  void flush() {
    const fs::path path = dir_ / fmt::format("{}_{:06}.bin", name_, written_.size());
    if (wide_) {
      write_token_shard(path, std::vector<uint32_t>(buffer_.begin(), buffer_.end()));
    } else {
      write_token_shard(path, std::vector<uint16_t>(buffer_.begin(), buffer_.end()));
    }
    written_.push_back(path.string());
    tokens_ += static_cast<int64_t>(buffer_.size());
    buffer_.clear();
  }

  fs::path dir_;
  std::string name_;
  size_t shard_tokens_;
  bool wide_;
  std::vector<int32_t> buffer_;
  std::vector<std::string> written_;
  int64_t tokens_ = 0;
};

class MegatronWriter final : public TokenWriter {
 public:
  MegatronWriter(fs::path dir, std::string name, int64_t vocab_size)
      : prefix_(dir / name), wide_(vocab_size >= 65500) {
    fs::remove(prefix_.string() + ".idx");  // no index may name the .bin while it is rewritten
    bin_.open(prefix_.string() + ".bin", std::ios::binary | std::ios::trunc);
    if (!bin_) fail(fmt::format("{}.bin: cannot create it", prefix_.string()));
  }

  void add_sequence(const std::vector<int32_t>& tokens) override {
    write(tokens.data(), tokens.size());
    lengths_.push_back(static_cast<int32_t>(tokens.size()));
    ++open_sequences_;
  }
  void end_document(std::optional<int32_t> end) override {
    if (open_sequences_ == 0) return;
    if (end) {
      write(&*end, 1);
      ++lengths_.back();
    }
    documents_.push_back(static_cast<int64_t>(lengths_.size()));
    open_sequences_ = 0;
  }
  void finish() override {
    end_document(std::nullopt);
    bin_.flush();
    if (!bin_) fail(fmt::format("{}.bin: write failed: check free space", prefix_.string()));
    bin_.close();
    checkpoint::fsync_path(prefix_.string() + ".bin");
    std::string idx(kMegatronMagic);
    auto put = [&idx](const auto& value) { idx.append(reinterpret_cast<const char*>(&value), sizeof(value)); };
    put(kMegatronVersion);
    put(wide_ ? kMegatronInt32 : kMegatronUint16);
    put(static_cast<uint64_t>(lengths_.size()));
    put(static_cast<uint64_t>(documents_.size()));
    for (int32_t length : lengths_) put(length);
    int64_t offset = 0;
    for (int32_t length : lengths_) {
      put(offset);
      offset += static_cast<int64_t>(length) * (wide_ ? 4 : 2);
    }
    for (int64_t d : documents_) put(d);
    common::write_file_atomically(prefix_.string() + ".idx", idx, 0644, ErrorCode::kDataError);
  }
  int remove_stale() const override { return 0; }  // one pair of files, rewritten whole
  int64_t tokens() const override { return tokens_; }
  std::vector<std::string> written() const override { return {prefix_.string() + ".bin", prefix_.string() + ".idx"}; }
  std::string source() const override { return prefix_.string(); }

 private:
  void write(const int32_t* tokens, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      if (wide_) {
        bin_.write(reinterpret_cast<const char*>(tokens + i), 4);
      } else {
        const auto narrow = static_cast<uint16_t>(tokens[i]);
        bin_.write(reinterpret_cast<const char*>(&narrow), 2);
      }
    }
    tokens_ += static_cast<int64_t>(n);
  }

  fs::path prefix_;
  bool wide_;
  std::ofstream bin_;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> documents_{0};  // the index's first entry, then each document's end
  size_t open_sequences_ = 0;
  int64_t tokens_ = 0;
};

}  // namespace

std::unique_ptr<TokenWriter> llmc_shard_writer(const fs::path& dir, const std::string& name, int64_t shard_tokens,
                                               int64_t vocab_size) {
  return std::make_unique<LlmcShardWriter>(dir, name, shard_tokens, vocab_size);
}

std::unique_ptr<TokenWriter> megatron_writer(const fs::path& dir, const std::string& name, int64_t vocab_size) {
  return std::make_unique<MegatronWriter>(dir, name, vocab_size);
}

}  // namespace keel::trainer
