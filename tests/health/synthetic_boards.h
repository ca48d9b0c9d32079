// Boards as keeld would read them from the ranks of a job, written by hand
// for the detectors' unit tests: no shared memory, no processes.
#pragma once

#include "health/rank_sample.h"

#include <cstring>
#include <string>
#include <random>

namespace keel::test {

class SyntheticJob {
 public:
  explicit SyntheticJob(int ranks, int64_t generation = 0) : samples_(static_cast<size_t>(ranks)) {
    for (int r = 0; r < ranks; ++r) {
      auto& sample = samples_[static_cast<size_t>(r)];
      sample.rank = r;
      sample.board.emplace();
      sample.board->rank = r;
      sample.board->pid = 1000 + r;
      sample.board->generation = generation;
    }
  }

  const health::RankSamples& samples() const { return samples_; }
  health::RankSample& sample(int r) { return samples_.at(static_cast<size_t>(r)); }
  health::BoardSnapshot& board(int r) { return *sample(r).board; }

  // Rank `r` finished `step` (0-based) with this split of its time.
  // `cpu_wait_ms`: runnable but waiting for a CPU, on top of the compute,
  // `own_cpu_wait_ms` of it while the rank's own other threads ran;
  // `stalled_ms`: of the compute, neither running nor runnable.
  void time_step(int r, int64_t step, float compute_ms, float wait_ms = 0, float data_ms = 0, float cpu_wait_ms = 0,
                 float own_cpu_wait_ms = 0, float stalled_ms = 0) {
    health::BoardSnapshot& b = board(r);
    b.steps[static_cast<size_t>(step) % health::kRecentSteps] = {
        step, compute_ms + wait_ms + data_ms + cpu_wait_ms, compute_ms, wait_ms, data_ms, cpu_wait_ms, own_cpu_wait_ms,
        stalled_ms};
    b.steps_done = step + 1;
  }

  // Rank `r` is stage `stage` of a pipeline of `stages`: a member of a pp
  // group, as the trainer registers it on its board.
  void join_pipeline(int r, int stage, int stages) {
    health::BoardSnapshot& b = board(r);
    auto& g = b.groups[0];
    std::string name("g");
    name += std::to_string(b.generation);
    name += ".pp.0";
    std::strncpy(g.name, name.c_str(), sizeof(g.name) - 1);
    g.size = stages;
    g.index = stage;
  }

  // Rank `r` published the digest of its replica set after `steps_done` steps.
  void publish_digest(int r, int64_t steps_done, uint64_t replica_set, uint64_t digest) {
    health::BoardSnapshot& b = board(r);
    b.digests[b.digest_count % health::kDigestSlots] = {steps_done, replica_set, digest};
    ++b.digest_count;
    b.steps_done = std::max(b.steps_done, steps_done);
  }

 private:
  health::RankSamples samples_;
};

// A board of random bytes, as a torn or foreign segment would read; with
// `plausible_header` its version and rank say it is `rank`'s board, so a
// detector has to make sense of the rest.
inline health::BoardSnapshot garbage_board(std::mt19937_64& rng, int rank, bool plausible_header) {
  health::BoardSnapshot board;
  unsigned char bytes[sizeof(board)];
  for (auto& byte : bytes) byte = static_cast<unsigned char>(rng());
  std::memcpy(static_cast<void*>(&board), bytes, sizeof(board));
  if (plausible_header) {
    board.version = health::kBoardVersion;
    board.rank = rank;
  }
  return board;
}

}  // namespace keel::test
