// Tokens read as one stream (docs/architecture.md "Data"): what the
// batches (batches.h) are drawn from. llm.c token shards (TokenDataset) are
// one stream, a Megatron-LM indexed dataset (MegatronDataset) another.
#pragma once

#include <cstdint>

namespace keel::trainer {

class TokenStream {
 public:
  virtual ~TokenStream() = default;
  virtual int64_t num_tokens() const = 0;
  // Copies tokens [pos, pos + count) of the stream into out, each below the
  // vocabulary the stream was opened for. Requires pos + count <= num_tokens().
  virtual void copy(int64_t pos, int64_t count, int32_t* out) const = 0;
};

}  // namespace keel::trainer
