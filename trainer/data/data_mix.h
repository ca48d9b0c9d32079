// The training data (docs/architecture.md "Data"): data.train's sources,
// each opened as a token stream, and the weights each sample draws its
// stream by.
#pragma once

#include "common/config.h"
#include "trainer/data/token_stream.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace keel::trainer {

// One source as a stream: a Megatron-LM indexed dataset when PATH.idx
// exists, otherwise the llm.c shards PATH globs. Error(kDataError) when it
// does not read or holds fewer than `min_tokens`.
std::unique_ptr<TokenStream> open_token_stream(const std::string& path, int64_t vocab_size, int64_t min_tokens);

class DataMix {
 public:
  static DataMix open(const std::vector<common::DataSource>& sources, int64_t vocab_size, int64_t min_tokens);
  // One stream that the caller keeps alive.
  explicit DataMix(const TokenStream& one);

  size_t size() const { return streams_.size(); }
  const TokenStream& stream(size_t i) const { return *streams_[i]; }
  // The stream sample `counter` of the run draws from: by weight, from a
  // counter stream of `seed` of its own. One stream draws nothing, so a
  // run begun before blends existed resumes with the samples it had.
  size_t draw(uint64_t seed, uint64_t counter) const;

 private:
  DataMix() = default;
  std::vector<std::unique_ptr<TokenStream>> owned_;
  std::vector<const TokenStream*> streams_;
  std::vector<double> cumulative_;  // the weights summed in order
};

}  // namespace keel::trainer
