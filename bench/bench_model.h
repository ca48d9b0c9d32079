// The model every benchmark trains, train_throughput.py's: L=4, C=256, H=4,
// T=256, global batch 8, V=256, fp32, on a token file "train.bin" beside the
// config. A benchmark appends its own sections ([parallel], [daemon], ...).
#pragma once

namespace keel::bench {

inline constexpr const char* kBenchModel = R"(
[model]
vocab_size = 256
seq_len = 256
n_layer = 4
n_head = 4
n_embd = 256
[data]
train = "train.bin"
[train]
batch_size = 8
lr = 6e-4
warmup_steps = 1
val_every = 0
)";

}  // namespace keel::bench
