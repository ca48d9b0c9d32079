#include "trainer/data/data_mix.h"

#include "common/counter_rng.h"
#include "trainer/data/dataset.h"
#include "trainer/data/megatron_dataset.h"

#include <algorithm>

namespace keel::trainer {

std::unique_ptr<TokenStream> open_token_stream(const std::string& path, int64_t vocab_size, int64_t min_tokens) {
  if (MegatronDataset::exists(path)) {
    return std::make_unique<MegatronDataset>(MegatronDataset::open(path, vocab_size, min_tokens));
  }
  return std::make_unique<TokenDataset>(TokenDataset::open(path, vocab_size, min_tokens));
}

DataMix DataMix::open(const std::vector<common::DataSource>& sources, int64_t vocab_size, int64_t min_tokens) {
  DataMix mix;
  double sum = 0;
  for (const auto& source : sources) {
    mix.owned_.push_back(open_token_stream(source.path, vocab_size, min_tokens));
    mix.streams_.push_back(mix.owned_.back().get());
    sum += source.weight;
    mix.cumulative_.push_back(sum);
  }
  // Weights are checked to add up to 1 within 1e-6: the last bound is 1
  // exactly, so every draw lands in a stream.
  if (!mix.cumulative_.empty()) mix.cumulative_.back() = 1.0;
  return mix;
}

DataMix::DataMix(const TokenStream& one) : streams_{&one}, cumulative_{1.0} {}

size_t DataMix::draw(uint64_t seed, uint64_t counter) const {
  if (streams_.size() == 1) return 0;
  const double u = common::to_unit(common::counter_bits(common::stream_key(seed, "train_source"), counter).low64);
  return static_cast<size_t>(std::upper_bound(cumulative_.begin(), cumulative_.end(), u) - cumulative_.begin());
}

}  // namespace keel::trainer
