#include "trainer/data/batches.h"

#include "common/counter_rng.h"
#include "common/error.h"

#include <fmt/format.h>

namespace keel::trainer {
namespace {

using common::Error;
using common::ErrorCode;

void fill_window(const TokenStream& data, int64_t start, int T, int32_t* inputs, int32_t* targets) {
  data.copy(start, T, inputs);
  data.copy(start + 1, T, targets);
}

}  // namespace

void fill_train_batch(const DataMix& data, uint64_t seed, int64_t step, int64_t global_batch, int T,
                      int64_t first_sample, int64_t count, int32_t* inputs, int32_t* targets) {
  const uint64_t key = common::stream_key(seed, "train_batch");
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t counter = static_cast<uint64_t>(step) * static_cast<uint64_t>(global_batch) +
                             static_cast<uint64_t>(first_sample + i);
    const TokenStream& stream = data.stream(data.draw(seed, counter));
    // A window is T + 1 tokens (T inputs, the last T of them also targets),
    // so it may start at any of the num_tokens - T positions where it fits.
    const int64_t n_windows = stream.num_tokens() - T;
    if (n_windows < 1) {
      throw Error(ErrorCode::kDataError,
                  fmt::format("the training data holds {} tokens, too few for one window of seq_len + 1 = {}: "
                              "add data or lower model.seq_len",
                              stream.num_tokens(), T + 1));
    }
    const auto start = static_cast<int64_t>(common::counter_uniform_below(key, counter, n_windows));
    fill_window(stream, start, T, inputs + i * T, targets + i * T);
  }
}

// Wrap rule: the stream holds W = (num_tokens - 1) / T whole windows laid end
// to end at 0, T, 2T, ... (window k's last target is window k + 1's first
// input, as in llm.c). Validation window w = index * B + b starts at
// (w mod W) * T, so a pass cycles through exactly those W windows and the
// fewer than T tokens left over at the end are never evaluated.
void fill_val_batch(const TokenStream& data, int64_t index, int64_t global_batch, int T, int64_t first_sample,
                    int64_t count, int32_t* inputs, int32_t* targets) {
  const int64_t whole_windows = (data.num_tokens() - 1) / T;
  if (whole_windows < 1) {
    throw Error(ErrorCode::kDataError,
                fmt::format("the validation data holds {} tokens, too few for one window of seq_len + 1 = {}: "
                            "add data or lower model.seq_len",
                            data.num_tokens(), T + 1));
  }
  for (int64_t i = 0; i < count; ++i) {
    const int64_t window = (index * global_batch + first_sample + i) % whole_windows;
    fill_window(data, window * T, T, inputs + i * T, targets + i * T);
  }
}

}  // namespace keel::trainer
