// How context parallelism splits a sequence (docs/architecture.md "Context
// parallelism"). With cp > 1 the seq_len positions form 2*cp chunks of
// seq_len/(2cp) and CP rank r holds chunks r and 2cp-1-r: under the causal
// mask an early chunk sees few keys and its partner many, so every rank
// does the same attention work. A rank lays its positions out chunk by
// chunk, [local chunk][sequence][position in chunk]. With cp = 1 the rank
// holds the whole sequence as its one chunk.
#pragma once

#include <cstdint>

namespace keel::trainer {

// Which keys of a chunk the queries of a chunk see under the causal mask.
enum class ChunkMask { kNone, kDiagonal, kFull };
inline ChunkMask causal_mask(int query_chunk, int key_chunk) {
  return key_chunk > query_chunk ? ChunkMask::kNone
                                 : (key_chunk == query_chunk ? ChunkMask::kDiagonal : ChunkMask::kFull);
}

struct ContextSplit {
  int cp = 1;
  int rank = 0;
  int seq_len = 0;

  int chunks() const { return cp > 1 ? 2 : 1; }
  int chunk_len() const { return seq_len / (cp > 1 ? 2 * cp : 1); }
  // Positions of a sequence on one rank.
  int local_len() const { return chunk_len() * chunks(); }
  // The global chunk that local chunk c (0 or 1) of CP rank `of` is, and
  // its first position.
  int global_chunk(int c, int of) const { return c == 0 ? of : 2 * cp - 1 - of; }
  int start(int c, int of) const { return global_chunk(c, of) * chunk_len(); }

  // This rank's positions of B sequences [B, seq_len] (host memory), laid
  // out as it keeps them: local[B * local_len()].
  void take(const int32_t* sequences, int B, int32_t* local) const;
  // The (query, key) scores causal attention computes on CP rank `of` for
  // one sequence and head: what load balancing evens out.
  int64_t causal_work(int of) const;
};

}  // namespace keel::trainer
