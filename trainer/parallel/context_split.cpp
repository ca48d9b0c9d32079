#include "trainer/parallel/context_split.h"

#include <algorithm>

namespace keel::trainer {

void ContextSplit::take(const int32_t* sequences, int B, int32_t* local) const {
  const int Tc = chunk_len();
  for (int c = 0; c < chunks(); ++c) {
    for (int b = 0; b < B; ++b) {
      const int32_t* from = sequences + static_cast<int64_t>(b) * seq_len + start(c, rank);
      std::copy(from, from + Tc, local + (static_cast<int64_t>(c) * B + b) * Tc);
    }
  }
}

int64_t ContextSplit::causal_work(int of) const {
  const int64_t Tc = chunk_len();
  int64_t work = 0;
  for (int c = 0; c < chunks(); ++c) {
    for (int key = 0; key < cp * chunks(); ++key) {
      switch (causal_mask(global_chunk(c, of), key)) {
        case ChunkMask::kNone:
          break;
        case ChunkMask::kDiagonal:
          work += Tc * (Tc + 1) / 2;
          break;
        case ChunkMask::kFull:
          work += Tc * Tc;
          break;
      }
    }
  }
  return work;
}

}  // namespace keel::trainer
