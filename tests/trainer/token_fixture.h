// A token shard for tests that need data but not any particular text.
#pragma once

#include "trainer/data/token_shard.h"

#include <cstdint>
#include <filesystem>
#include <vector>

namespace keel::test {

// Writes `count` byte-vocabulary tokens from a fixed multiplicative-hash
// pattern: varied enough that a model has something to learn, identical on
// every run.
inline void write_pattern_shard(const std::filesystem::path& path, size_t count) {
  std::vector<uint16_t> tokens(count);
  for (size_t i = 0; i < count; ++i) tokens[i] = static_cast<uint16_t>((i * 2654435761u >> 9) % 256);
  trainer::write_token_shard(path, tokens);
}

}  // namespace keel::test
