// llm.c's token shard format (docs/architecture.md "Data"): a header of 256 int32 (magic
// 20240520, version 1, token count, the rest zero), then the tokens as
// uint16. Shards made for llm.c (GPT-2 tokenized or byte-level) load
// unchanged.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>

namespace keel::trainer {

inline constexpr int32_t kShardMagic = 20240520;
inline constexpr int32_t kShardVersion = 1;
inline constexpr size_t kShardHeaderInts = 256;
inline constexpr size_t kShardHeaderBytes = kShardHeaderInts * sizeof(int32_t);

// A read-only, memory-mapped shard whose header and every token were
// checked on open. Move-only.
class TokenShard {
 public:
  // Throws Error(kDataError) naming the file and the problem: missing or
  // unreadable, shorter than a header, wrong magic or version, a token
  // count that disagrees with the file size, a token >= vocab_size.
  static TokenShard open(const std::filesystem::path& path, int64_t vocab_size);

  TokenShard(TokenShard&& other) noexcept;
  TokenShard& operator=(TokenShard&& other) noexcept;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;
  ~TokenShard();

  const std::string& path() const { return path_; }
  int64_t size() const { return num_tokens_; }
  const uint16_t* tokens() const { return tokens_; }

 private:
  TokenShard() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const uint16_t* tokens_ = nullptr;
  int64_t num_tokens_ = 0;
};

// Writes a shard atomically: to "<path>.tmp", fsync, rename, fsync of the
// directory. Throws Error(kDataError) on I/O failure.
void write_token_shard(const std::filesystem::path& path, std::span<const uint16_t> tokens);

}  // namespace keel::trainer
