// Whether a config's parallel layout can run (docs/architecture.md
// "Parallel layout and communication"), from the config and the world size
// alone. keel-trainer runs validate_layout before anything starts, and keeld
// runs the same function before it starts any rank, so that a layout the
// ranks would refuse is refused once, with the ranks' own sentences, rather
// than retried generation after generation.
#pragma once

#include "common/config.h"

#include <cstdint>
#include <string>
#include <vector>

namespace keel::common {

// One sentence per way `config`'s layout cannot be laid out on `world_size`
// ranks (the mesh's rules: degrees, divisibility by the model's heads,
// widths, vocabulary, layers, sequence, experts and batch), each naming the
// values involved and what to change; empty when it can.
std::vector<std::string> layout_problems(const Config& config, int64_t world_size);

// One sentence per part of a valid layout this build cannot train yet
// (docs/architecture.md "Not built yet"): pipeline, context and expert
// parallelism, and MoE with TP.
std::vector<std::string> unbuilt_layout_problems(const Config& config);

// Throws Error(kBadConfig) listing every problem of both kinds, so a user
// fixes them all in one go rather than one per attempt.
void validate_layout(const Config& config, int64_t world_size);

}  // namespace keel::common
