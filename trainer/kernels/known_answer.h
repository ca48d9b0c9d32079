// The known-answer kernel test (docs/architecture.md "Health": SDC): fixed
// inputs through the Backend's kernels, each output held bit for bit
// against the closed-form result computed in plain integer loops beside it.
// The inputs are small integers, so every float32 sum of the test is exact
// whatever the summation order, tiling or thread count: a correct backend
// cannot differ by a single bit, and a device that computes wrong numbers
// without an error does.
//
// Kernels covered: matmul forward and backward (the GEMMs that dominate a
// step), accumulate, embedding forward and backward, the MoE row gather,
// scatter and dot, sum and sum of squares. Kernels whose results involve
// exp, tanh or a square root have no exact answer to hold them to.
#pragma once

#include "trainer/kernels/backend.h"

#include <cstdint>
#include <string>

namespace keel::trainer {

struct KnownAnswers {
  std::string failed_kernel;  // the first kernel whose output was wrong; empty: none
  uint64_t digest = 0;        // XXH3-64 over every kernel's output, for comparing ranks
  double seconds = 0;         // what the test took, expected results included
};

// Runs every kernel once on `backend` (a few tens of MFLOP).
KnownAnswers test_known_answers(Backend& backend);

}  // namespace keel::trainer
