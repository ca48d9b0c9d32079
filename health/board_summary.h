// A node's ranks as other nodes' keelds see them (docs/architecture.md
// "Multi-node on etcd": detectors across nodes). Each keeld publishes its
// ranks' samples in this form under `health/<node>` once a second; every
// keeld decodes the others' and runs its detectors over the whole world.
//
// A summary carries what the detectors read, nothing else: phase and step,
// heartbeat, the group table (the collective in flight), phase budgets'
// evidence, the step-time ring, replica digests and the rank's own SDC
// report. Flight records (recent collectives) and the BLAS core stay on the
// rank's node. It is MessagePack (nlohmann's), about 1.7 KiB a busy rank.
//
// Times. A board's times are CLOCK_MONOTONIC of its node, meaningless on
// another, so a summary carries each as its age when it was encoded. A
// decoded sample is as of the moment the summary was made (`as_of`):
// shift_times() moves it to a later time, so a remote rank's ages stay what
// its node saw last instead of growing while the next summary is on its
// way: a late summary makes a hang found later, never a rank look frozen.
//
// A summary comes from another machine and is not trusted: decode() takes
// any bytes and returns nothing for what is not a whole, well-formed
// summary; field values are the detectors' to judge, as on a local board.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "health/rank_sample.h"

namespace keel::health {

struct NodeSummary {
  int64_t generation = -1;  // the cluster generation the samples belong to
  RankSamples ranks;        // the node's ranks in rank order, times as of `as_of_ns`
  int64_t as_of_ns = 0;     // the decoding keeld's clock at decode()
};

// The summary of `ranks` (the samples of a node's ranks) at `now_ns` on this
// node's clock.
std::string encode_summary(int64_t generation, const RankSamples& ranks, int64_t now_ns);

// The summary in `bytes` with its times as of `now_ns` on this node's clock,
// or nothing when the bytes are no summary.
std::optional<NodeSummary> decode_summary(const std::string& bytes, int64_t now_ns);

// Moves every time of `sample` by `delta_ns` (0, "never", stays 0).
void shift_times(RankSample& sample, int64_t delta_ns);

}  // namespace keel::health
