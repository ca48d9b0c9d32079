// How far one result is from another, for tests that hold a backend or a
// precision to a reference.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <vector>

namespace keel::test {

// ||got - want|| / ||want|| over all elements.
inline double relative_l2(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    diff += d * d;
    norm += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(diff / norm);
}

}  // namespace keel::test
