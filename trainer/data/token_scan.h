// Token files seen through their width (docs/architecture.md "Data"):
// checking every token against the vocabulary at memory speed, as llm.c
// shards and Megatron-LM indexed datasets do when they open, and reading
// them widened to int32.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>

namespace keel::trainer {

// The largest token, scanned in fixed-size blocks: a constant trip count lets
// the compiler vectorise the inner loop, which keeps opening a multi-GB
// dataset at memory bandwidth rather than at one compare per cycle.
template <class Token> inline Token max_token(const Token* tokens, int64_t n) {
  constexpr int64_t kBlock = 4096;
  Token result = 0;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    Token block_max = 0;
    for (int64_t j = 0; j < kBlock; ++j) block_max = std::max(block_max, tokens[i + j]);
    result = std::max(result, block_max);
  }
  for (; i < n; ++i) result = std::max(result, tokens[i]);
  return result;
}

// f(typed token pointer) for a shard's token width.
template <class F> auto with_tokens(const void* tokens, size_t token_bytes, F&& f) {
  return token_bytes == 2 ? f(static_cast<const uint16_t*>(tokens)) : f(static_cast<const uint32_t*>(tokens));
}

// Tokens [pos, pos + count) into out, widened to int32.
inline void copy_tokens(const void* tokens, size_t token_bytes, int64_t pos, int64_t count, int32_t* out) {
  with_tokens(tokens, token_bytes, [&](const auto* t) {
    std::transform(t + pos, t + pos + count, out, [](auto x) { return static_cast<int32_t>(x); });
  });
}

// The first token >= vocab_size and the largest token, or nullopt when
// every token is below vocab_size.
struct BadToken {
  int64_t index;
  int64_t token;
  int64_t largest;
};
inline std::optional<BadToken> first_token_outside(const void* tokens, size_t token_bytes, int64_t count,
                                            int64_t vocab_size) {
  return with_tokens(tokens, token_bytes, [&](const auto* t) -> std::optional<BadToken> {
    const int64_t largest = count > 0 ? static_cast<int64_t>(max_token(t, count)) : -1;
    if (largest < vocab_size) return std::nullopt;
    const auto outside = [vocab_size](auto x) { return static_cast<int64_t>(x) >= vocab_size; };
    const auto* bad = std::find_if(t, t + count, outside);
    return BadToken{bad - t, static_cast<int64_t>(*bad), largest};
  });
}

}  // namespace keel::trainer
