#include "trainer/data/token_shard.h"

#include "common/error.h"
#include "common/unique_fd.h"
#include "common/write_all.h"
#include "common/log.h"
#include "trainer/data/token_scan.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>

namespace keel::trainer {
namespace {

using common::Error;
using common::ErrorCode;

// The format is llm.c's on-disk layout, which is little-endian; reading it
// through a cast needs a machine of the same order.
static_assert(std::endian::native == std::endian::little, "llm.c token shards are little-endian");

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw Error(ErrorCode::kDataError, fmt::format("{}: {}", path, what));
}

std::string errno_text(int error) { return std::strerror(error); }

void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  if (const int error = common::write_all(fd, data, bytes); error != 0) {
    fail(path, fmt::format("write failed: {}: check free space and permissions", errno_text(error)));
  }
}

}  // namespace

TokenShard TokenShard::open(const std::filesystem::path& path, int64_t vocab_size) {
  const std::string name = path.string();
  common::UniqueFd fd(::open(name.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    fail(name, fmt::format("cannot open: {}: check the data path in the config", errno_text(errno)));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) fail(name, fmt::format("cannot stat: {}", errno_text(errno)));
  if (S_ISDIR(st.st_mode)) fail(name, "is a directory, not a token shard: point the data glob at the .bin files");
  if (!S_ISREG(st.st_mode)) fail(name, "is not a regular file: token shards must be regular .bin files");

  const auto file_bytes = static_cast<size_t>(st.st_size);
  if (file_bytes == 0) fail(name, "empty file (0 bytes): not an llm.c token shard; re-run keel-prepare-data");
  if (file_bytes < kShardHeaderBytes) {
    fail(name, fmt::format("file is {} bytes, shorter than the {}-byte shard header: not an llm.c token shard",
                           file_bytes, kShardHeaderBytes));
  }

  TokenShard shard;
  shard.path_ = name;
  shard.map_ = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (shard.map_ == MAP_FAILED) {
    shard.map_ = nullptr;
    fail(name, fmt::format("cannot mmap {} bytes: {}", file_bytes, errno_text(errno)));
  }
  shard.map_bytes_ = file_bytes;

  std::array<int32_t, kShardHeaderInts> header{};
  std::memcpy(header.data(), shard.map_, kShardHeaderBytes);
  const ShardFormat* format = nullptr;
  for (const ShardFormat* f : {&kGpt2Shard, &kLlama3Shard}) {
    if (header[0] == f->magic) format = f;
  }
  if (format == nullptr) {
    fail(name, fmt::format("wrong magic {} (expected {} for {} or {} for {}): not an llm.c token shard", header[0],
                           kGpt2Shard.magic, kGpt2Shard.name, kLlama3Shard.magic, kLlama3Shard.name));
  }
  if (header[1] != format->version) {
    fail(name, fmt::format("unsupported shard version {} (an {} shard is version {}): re-create it", header[1],
                           format->name, format->version));
  }
  shard.format_ = format;
  const size_t token_bytes = format->token_bytes;
  const int64_t count = header[2];
  if (count < 0) fail(name, fmt::format("header token count is negative ({}): the header is corrupt", count));

  const size_t expected_bytes = kShardHeaderBytes + static_cast<size_t>(count) * token_bytes;
  if (file_bytes < expected_bytes) {
    fail(name, fmt::format("truncated: the header says {} tokens ({} bytes) but the file is {} bytes "
                           "({} whole tokens): re-create the shard",
                           count, expected_bytes, file_bytes, (file_bytes - kShardHeaderBytes) / token_bytes));
  }
  if (file_bytes > expected_bytes) {
    fail(name, fmt::format("{} trailing byte(s) after the {} tokens the header announces (the file is {} bytes, "
                           "expected {}): the header or the file is corrupt; re-create the shard",
                           file_bytes - expected_bytes, count, file_bytes, expected_bytes));
  }

  // The scan reads every page once, front to back; afterwards training
  // reads random windows, for which read-ahead would only waste I/O.
  ::madvise(shard.map_, file_bytes, MADV_SEQUENTIAL);
  shard.tokens_ = static_cast<const char*>(shard.map_) + kShardHeaderBytes;
  shard.num_tokens_ = count;
  if (const auto bad = first_token_outside(shard.tokens_, token_bytes, count, vocab_size)) {
    fail(name, fmt::format("token {} at index {} is >= model.vocab_size {} (largest token in the shard: {}): "
                           "set model.vocab_size to at least {} or re-tokenize",
                           bad->token, bad->index, vocab_size, bad->largest, bad->largest + 1));
  }
  ::madvise(shard.map_, file_bytes, MADV_RANDOM);

  common::logger("data")->debug("opened {}: {} tokens, {}", name, count, format->name);
  return shard;
}

void TokenShard::copy(int64_t offset, int64_t count, int32_t* out) const {
  copy_tokens(tokens_, format_->token_bytes, offset, count, out);
}

int32_t TokenShard::token(int64_t index) const {
  int32_t value = 0;
  copy(index, 1, &value);
  return value;
}

TokenShard::TokenShard(TokenShard&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      tokens_(std::exchange(other.tokens_, nullptr)),
      format_(other.format_),
      num_tokens_(std::exchange(other.num_tokens_, 0)) {}

TokenShard& TokenShard::operator=(TokenShard&& other) noexcept {
  if (this != &other) {
    if (map_ != nullptr) ::munmap(map_, map_bytes_);
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    tokens_ = std::exchange(other.tokens_, nullptr);
    format_ = other.format_;
    num_tokens_ = std::exchange(other.num_tokens_, 0);
  }
  return *this;
}

TokenShard::~TokenShard() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

namespace {

void write_shard(const std::filesystem::path& path, const ShardFormat& format, const void* tokens, size_t count) {
  const std::string name = path.string();
  if (count > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    fail(name, fmt::format("{} tokens do not fit one shard (the header count is an int32): split the data", count));
  }
  std::array<int32_t, kShardHeaderInts> header{};
  header[0] = format.magic;
  header[1] = format.version;
  header[2] = static_cast<int32_t>(count);

  // Readers must never see a half-written shard under the final name, even
  // after a crash: write a temporary, make it durable, then rename it over.
  const std::string tmp = name + ".tmp";
  try {
    common::UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (fd.get() < 0) {
      fail(tmp, fmt::format("cannot create: {}: check that the directory exists and is writable",
                            errno_text(errno)));
    }
    write_all(fd.get(), header.data(), kShardHeaderBytes, tmp);
    write_all(fd.get(), tokens, count * format.token_bytes, tmp);
    if (::fsync(fd.get()) != 0) fail(tmp, fmt::format("fsync failed: {}", errno_text(errno)));
    if (fd.close() != 0) fail(tmp, fmt::format("close failed: {}", errno_text(errno)));
    if (::rename(tmp.c_str(), name.c_str()) != 0) {
      fail(name, fmt::format("cannot rename {} to it: {}", tmp, errno_text(errno)));
    }
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }

  // The rename is durable only once the directory entry is on disk.
  std::filesystem::path dir = path.parent_path();
  if (dir.empty()) dir = ".";
  common::UniqueFd dir_fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir_fd.get() < 0 || ::fsync(dir_fd.get()) != 0) {
    fail(name, fmt::format("cannot fsync directory {}: {}", dir.string(), errno_text(errno)));
  }
}

}  // namespace

void write_token_shard(const std::filesystem::path& path, std::span<const uint16_t> tokens) {
  write_shard(path, kGpt2Shard, tokens.data(), tokens.size());
}

void write_token_shard(const std::filesystem::path& path, std::span<const uint32_t> tokens) {
  write_shard(path, kLlama3Shard, tokens.data(), tokens.size());
}

}  // namespace keel::trainer
