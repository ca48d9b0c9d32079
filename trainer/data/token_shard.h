// llm.c's token shard formats (docs/architecture.md "Data"): a header of
// 256 int32 (magic, version, token count, the rest zero), then the tokens,
// uint16 in GPT-2's format and uint32 in Llama 3's (llm.c's
// dev/data/data_common.py writes both). Shards made for llm.c load
// unchanged.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>

namespace keel::trainer {

struct ShardFormat {
  int32_t magic;
  int32_t version;
  size_t token_bytes;
  const char* name;
};
// GPT-2's (and keel-prepare-data's byte-level shards), for vocabularies up
// to 65536, and Llama 3's, for larger ones (Llama 3's 128256).
inline constexpr ShardFormat kGpt2Shard{20240520, 1, 2, "llm.c GPT-2 (uint16 tokens)"};
inline constexpr ShardFormat kLlama3Shard{20240801, 7, 4, "llm.c Llama 3 (uint32 tokens)"};
inline constexpr size_t kShardHeaderInts = 256;
inline constexpr size_t kShardHeaderBytes = kShardHeaderInts * sizeof(int32_t);

// A read-only, memory-mapped shard whose header and every token were
// checked on open. Move-only.
class TokenShard {
 public:
  // Throws Error(kDataError) naming the file and the problem: missing or
  // unreadable, shorter than a header, a magic of neither format or its
  // wrong version, a token count that disagrees with the file size, a
  // token >= vocab_size.
  static TokenShard open(const std::filesystem::path& path, int64_t vocab_size);

  TokenShard(TokenShard&& other) noexcept;
  TokenShard& operator=(TokenShard&& other) noexcept;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;
  ~TokenShard();

  const std::string& path() const { return path_; }
  int64_t size() const { return num_tokens_; }
  const ShardFormat& format() const { return *format_; }
  // Tokens [offset, offset + count) into out, widened to int32 (every
  // token was checked to be below the vocabulary on open).
  void copy(int64_t offset, int64_t count, int32_t* out) const;
  int32_t token(int64_t index) const;

 private:
  TokenShard() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const void* tokens_ = nullptr;
  const ShardFormat* format_ = &kGpt2Shard;
  int64_t num_tokens_ = 0;
};

// Writes a shard atomically, in GPT-2's format (uint16 tokens) or Llama
// 3's (uint32): to "<path>.tmp", fsync, rename, fsync of the directory.
// Throws Error(kDataError) on I/O failure.
void write_token_shard(const std::filesystem::path& path, std::span<const uint16_t> tokens);
void write_token_shard(const std::filesystem::path& path, std::span<const uint32_t> tokens);

}  // namespace keel::trainer
