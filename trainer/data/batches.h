// The batches a run trains and validates on (docs/architecture.md "Data").
//
// The batch of global step s is a pure function of (seed, s, global batch
// size, sequence length): sample i of step s draws its stream of a blend
// (DataMix::draw) and then its start within that stream by the counter RNG
// from (seed, s * global_batch + i). A DP rank fills only its
// slice of samples and a microbatch its sub-slice, so resuming, or changing
// the DP degree, sees exactly the same samples: the step is the loader's
// whole checkpointed position, whatever the stream.
#pragma once

#include "trainer/data/data_mix.h"
#include "trainer/data/token_stream.h"

#include <cstdint>

namespace keel::trainer {

// Fills samples [first_sample, first_sample + count) of training step
// `step`'s global batch: inputs and targets are [count, T], targets shifted
// by one token.
void fill_train_batch(const DataMix& data, uint64_t seed, int64_t step, int64_t global_batch, int T,
                      int64_t first_sample, int64_t count, int32_t* inputs, int32_t* targets);
// The same from one stream.
inline void fill_train_batch(const TokenStream& data, uint64_t seed, int64_t step, int64_t global_batch, int T,
                             int64_t first_sample, int64_t count, int32_t* inputs, int32_t* targets) {
  fill_train_batch(DataMix(data), seed, step, global_batch, T, first_sample, count, inputs, targets);
}

// Fills samples [first_sample, first_sample + count) of validation batch
// `index` of global_batch sequences: consecutive non-overlapping windows from
// the start of the stream, wrapping around at the end, so every validation
// pass sees the same tokens whatever the layout.
void fill_val_batch(const TokenStream& data, int64_t index, int64_t global_batch, int T, int64_t first_sample,
                    int64_t count, int32_t* inputs, int32_t* targets);

}  // namespace keel::trainer
