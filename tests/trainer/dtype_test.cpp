// bfloat16 conversion: round to nearest, ties to even, as CUDA's
// __float2bfloat16 does, so host and device agree on every bit.
#include "trainer/kernels/dtype.h"

#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

using keel::trainer::bf16;
using keel::trainer::to_bf16;
using keel::trainer::to_float;

TEST_SUITE("unit") {
  TEST_CASE("floats round to the nearest bfloat16 with ties to even") {
    struct Case {
      float value;
      uint16_t bits;
    };
    const std::vector<Case> cases = {
        {1.0f, 0x3f80},
        {-2.0f, 0xc000},
        {0.0f, 0x0000},
        {-0.0f, 0x8000},
        {1.0f + 0x1p-8f, 0x3f80},             // halfway, 0x3f80 is even: down
        {1.0f + 3 * 0x1p-8f, 0x3f82},         // halfway, 0x3f81 is odd: up
        {1.0f + 0x1p-8f + 0x1p-20f, 0x3f81},  // above halfway: up
        {std::numeric_limits<float>::infinity(), 0x7f80},
        {-std::numeric_limits<float>::infinity(), 0xff80},
        {std::numeric_limits<float>::max(), 0x7f80},  // past the largest bfloat16 by more than half an ulp
        {0x1p-133f, 0x0001},                          // the smallest subnormal bfloat16
    };
    for (const auto& c : cases) {
      CAPTURE(c.value);
      CHECK(to_bf16(c.value).bits == c.bits);
    }
  }

  TEST_CASE("a NaN stays a NaN and every bfloat16 survives the round trip through float") {
    CHECK(std::isnan(to_float(to_bf16(std::numeric_limits<float>::quiet_NaN()))));
    // A NaN whose payload sits only in the low half must not round to infinity.
    CHECK(std::isnan(to_float(to_bf16(std::bit_cast<float>(0x7f800001u)))));
    size_t changed = 0;
    for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
      const float value = to_float(bf16{static_cast<uint16_t>(bits)});
      if (std::isnan(value)) continue;
      changed += to_bf16(value).bits != bits;
    }
    CHECK(changed == 0);
  }
}
