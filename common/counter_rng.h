// A counter-based random generator: every draw is a pure function of
// (key, counter), so any process can produce exactly the elements it owns
// (a shard of a tensor, its slice of a batch) without generating the rest.
// XXH3-128 is the mixing function: its avalanche quality is more than enough
// for initialisation and sampling, and it is already a keel dependency.
#pragma once

#include <xxhash.h>

#include <cmath>
#include <cstdint>
#include <string_view>

namespace keel::common {

// A key for one stream, e.g. (seed, "h.3.attn.c_attn.weight").
inline uint64_t stream_key(uint64_t seed, std::string_view name) {
  return XXH3_64bits_withSeed(name.data(), name.size(), seed);
}

// Two independent uniform 64-bit words for (key, counter).
inline XXH128_hash_t counter_bits(uint64_t key, uint64_t counter) {
  return XXH3_128bits_withSeed(&counter, sizeof(counter), key);
}

// Uniform in [0, 1) with 53 bits of resolution.
inline double to_unit(uint64_t bits) { return static_cast<double>(bits >> 11) * 0x1.0p-53; }

// Uniform integer in [0, n) for n > 0 (Lemire's multiply-shift; the bias is
// below 2^-40 for every n keel uses).
inline uint64_t counter_uniform_below(uint64_t key, uint64_t counter, uint64_t n) {
  __extension__ using u128 = unsigned __int128;
  uint64_t bits = counter_bits(key, counter).low64;
  return static_cast<uint64_t>((static_cast<u128>(bits) * n) >> 64);
}

// Standard normal via Box-Muller on the two words of one draw.
inline double counter_normal(uint64_t key, uint64_t counter) {
  XXH128_hash_t h = counter_bits(key, counter);
  double u1 = 1.0 - to_unit(h.low64);  // (0, 1]: log is finite
  double u2 = to_unit(h.high64);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

}  // namespace keel::common
