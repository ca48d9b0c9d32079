// Token datasets and the batches drawn from them (docs/architecture.md "Data").
//
// The batch of global step s is a pure function of (seed, s, global batch
// size, sequence length): sample i of step s starts at a position drawn by
// the counter RNG from (seed, s * global_batch + i). A DP rank fills only its
// slice of samples and a microbatch its sub-slice, so resuming, or changing
// the DP degree, sees exactly the same samples.
#pragma once

#include "trainer/data/token_shard.h"

#include <cstdint>
#include <string>
#include <vector>

namespace keel::trainer {

// Every shard matched by a glob, in sorted path order, read as one stream.
class TokenDataset {
 public:
  // Throws Error(kDataError) when the glob matches nothing, a shard is bad,
  // or the whole dataset holds fewer than min_tokens tokens.
  static TokenDataset open(const std::string& glob_pattern, int64_t vocab_size, int64_t min_tokens);

  int64_t num_tokens() const { return total_tokens_; }
  const std::vector<TokenShard>& shards() const { return shards_; }

  // Copies tokens [pos, pos + count) of the stream into out, crossing shard
  // boundaries where needed. Requires pos + count <= num_tokens().
  void copy(int64_t pos, int64_t count, int32_t* out) const;

 private:
  std::vector<TokenShard> shards_;
  std::vector<int64_t> starts_;  // stream position of each shard's first token
  int64_t total_tokens_ = 0;
};

// Fills samples [first_sample, first_sample + count) of training step
// `step`'s global batch: inputs and targets are [count, T], targets shifted
// by one token.
void fill_train_batch(const TokenDataset& data, uint64_t seed, int64_t step, int64_t global_batch, int T,
                      int64_t first_sample, int64_t count, int32_t* inputs, int32_t* targets);

// Fills samples [first_sample, first_sample + count) of validation batch
// `index` of global_batch sequences: consecutive non-overlapping windows from
// the start of the stream, wrapping around at the end, so every validation
// pass sees the same tokens whatever the layout.
void fill_val_batch(const TokenDataset& data, int64_t index, int64_t global_batch, int T, int64_t first_sample,
                    int64_t count, int32_t* inputs, int32_t* targets);

}  // namespace keel::trainer
