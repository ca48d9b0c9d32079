// llm.c token shards as one stream (docs/architecture.md "Data"): every
// shard a glob matches, in sorted path order.
#pragma once

#include "trainer/data/token_shard.h"
#include "trainer/data/token_stream.h"

#include <cstdint>
#include <string>
#include <vector>

namespace keel::trainer {

// Every shard matched by a glob, in sorted path order, read as one stream.
class TokenDataset final : public TokenStream {
 public:
  // Throws Error(kDataError) when the glob matches nothing, a shard is bad,
  // or the whole dataset holds fewer than min_tokens tokens.
  static TokenDataset open(const std::string& glob_pattern, int64_t vocab_size, int64_t min_tokens);

  int64_t num_tokens() const override { return total_tokens_; }
  const std::vector<TokenShard>& shards() const { return shards_; }

  // Crosses shard boundaries where needed.
  void copy(int64_t pos, int64_t count, int32_t* out) const override;

 private:
  std::vector<TokenShard> shards_;
  std::vector<int64_t> starts_;  // stream position of each shard's first token
  int64_t total_tokens_ = 0;
};

}  // namespace keel::trainer
