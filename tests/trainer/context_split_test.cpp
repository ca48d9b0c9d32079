// Context parallelism's split of a sequence: which positions each CP rank
// holds, and that causal load balancing evens out the attention work.
#include "trainer/parallel/context_split.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <vector>

using keel::trainer::ContextSplit;

TEST_SUITE("unit") {
  TEST_CASE("each CP rank holds chunks r and 2cp-1-r and together the ranks hold every position once") {
    const int B = 2, T = 32;
    std::vector<int32_t> tokens(B * T);
    std::iota(tokens.begin(), tokens.end(), 0);
    for (int cp : {1, 2, 4}) {
      CAPTURE(cp);
      std::vector<int> seen(tokens.size(), 0);
      for (int r = 0; r < cp; ++r) {
        const ContextSplit split{cp, r, T};
        CHECK(split.local_len() * cp == T);
        std::vector<int32_t> local(static_cast<size_t>(B * split.local_len()));
        split.take(tokens.data(), B, local.data());
        for (int c = 0; c < split.chunks(); ++c) {
          for (int b = 0; b < B; ++b) {
            for (int t = 0; t < split.chunk_len(); ++t) {
              const int32_t token = local[static_cast<size_t>((c * B + b) * split.chunk_len() + t)];
              CHECK(token == b * T + split.start(c, r) + t);  // positions in order within a chunk
              ++seen[static_cast<size_t>(token)];
            }
          }
        }
        if (cp > 1) CHECK(split.global_chunk(1, r) == 2 * cp - 1 - r);
      }
      CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
    }
  }

  TEST_CASE("causal attention work is within 5 percent across CP ranks and a contiguous split is not") {
    for (int cp : {2, 4, 8}) {
      CAPTURE(cp);
      const ContextSplit split{cp, 0, 256};
      std::vector<int64_t> work;
      for (int r = 0; r < cp; ++r) work.push_back(split.causal_work(r));
      const auto [lo, hi] = std::minmax_element(work.begin(), work.end());
      CHECK(static_cast<double>(*hi - *lo) <= 0.05 * static_cast<double>(*hi));
      // All the scores of one sequence and head: T(T+1)/2.
      CHECK(std::accumulate(work.begin(), work.end(), int64_t{0}) == 256 * 257 / 2);
      // Rank r holding positions [r, r+1) * T/cp instead: the last rank
      // computes 2cp - 1 times what the first does.
      const int64_t Tr = 256 / cp;
      const int64_t first = Tr * (Tr + 1) / 2, last = (cp - 1) * Tr * Tr + Tr * (Tr + 1) / 2;
      CHECK(static_cast<double>(last - first) > 0.05 * static_cast<double>(last));
    }
  }
}
