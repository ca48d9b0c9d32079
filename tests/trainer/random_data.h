// Seeded random inputs for the kernel tests, so that a failing case can be
// rerun with the same values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace keel::test {

// n floats uniform in [lo, hi).
inline std::vector<float> random_vec(size_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// n integers uniform in [0, bound).
inline std::vector<int32_t> random_ints(size_t n, int32_t bound, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, bound - 1);
  std::vector<int32_t> v(n);
  for (int32_t& x : v) x = dist(rng);
  return v;
}

}  // namespace keel::test
