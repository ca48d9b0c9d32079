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

// The blocks each pipeline stage runs, first stage first (with
// interleaving, each virtual stage: pp * pp_virtual counts):
// parallel.pp_layers when set, otherwise n_layer split as evenly as
// possible with the earlier stages taking the remainder. Call it on a
// validated layout; it throws
// Error(kBadConfig) on a pp_layers that layout_problems refuses.
std::vector<int64_t> stage_layers(const Config& config);

// Throws Error(kBadConfig) listing every problem, so a user
// fixes them all in one go rather than one per attempt.
void validate_layout(const Config& config, int64_t world_size);

}  // namespace keel::common
