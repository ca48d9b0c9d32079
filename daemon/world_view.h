// The samples of every rank of a generation that runs on many nodes
// (docs/architecture.md "Multi-node on etcd": detectors across nodes), as
// keeld's detectors take them: index = global rank. This node's ranks come
// from their boards, every other node's from the summary its keeld
// published (daemon/health_exchange.h), its times moved on to now so its
// ages stay what that node saw last. A node not heard of in this
// generation, heard of too long ago, or whose summary is not of its ranks
// has its ranks unknown (health::RankSample::known): never named, never
// taken as "never published".
#pragma once

#include <cstdint>

#include "cluster/rendezvous.h"
#include "daemon/health_exchange.h"
#include "health/rank_sample.h"

namespace keel::daemon {

// `own`: this node's ranks' samples, in order; a summary decoded more than
// `stale_after_ns` before `now_ns` no longer counts.
health::RankSamples world_samples(const health::RankSamples& own, const cluster::Membership& membership,
                                  const RemoteSummaries& remote, int64_t now_ns, int64_t stale_after_ns);

}  // namespace keel::daemon
