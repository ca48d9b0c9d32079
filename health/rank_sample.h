// What keeld knows of one rank at one poll (docs/architecture.md "Health"):
// the input of every detector. A detector is a plain class fed these
// samples and the time (`observe(samples, now_ns) -> findings`): no sockets,
// no processes, no sleeping, so unit tests drive it with synthetic boards
// and a FakeClock (common/clock.h).
//
// A board is read from another process and is not trusted: a detector
// must make sense of a rank that never published, of garbage in any field
// (ranks, sequence numbers, times in the future or the past) and of a clock
// that jumps, and must never crash or name a rank on such evidence alone.
#pragma once

#include "health/progress_board.h"

#include <cstdint>
#include <optional>
#include <vector>

namespace keel::health {

struct RankSample {
  int rank = 0;                        // the global rank keeld started
  std::optional<BoardSnapshot> board;  // the newest snapshot read; nothing: never published
  int64_t heartbeat_ns = 0;            // the board's heartbeat; 0: never beaten
  bool running = true;                 // false once the rank's process exited
  // False for another node's rank this keeld has not heard of lately
  // (daemon/world_view.h): nothing is known of it, which is not "never
  // published", so it is never named, like a board not trusted.
  bool known = true;
};

// Samples of every rank of the job, rank 0 first (index = rank).
using RankSamples = std::vector<RankSample>;

// The board that says it is this build's board of that rank (its version
// and rank fields), running or not, or nullptr: a detector takes no other
// board as evidence, so random bytes are never read as timings or digests
// of a rank. What an exited rank published stays true (the digests of the
// steps it finished); its timings no longer describe a live rank.
inline const BoardSnapshot* published_board(const RankSample& sample) {
  if (!sample.known || !sample.board) return nullptr;
  const BoardSnapshot& b = *sample.board;
  return b.version == kBoardVersion && b.rank == sample.rank ? &b : nullptr;
}

// published_board() of a running rank.
inline const BoardSnapshot* trusted_board(const RankSample& sample) {
  return sample.running ? published_board(sample) : nullptr;
}

}  // namespace keel::health
