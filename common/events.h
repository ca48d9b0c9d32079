// run_dir/events.jsonl (docs/architecture.md "Run directory"): what happened to a run that an operator
// (or keeld) must be able to find afterwards — checkpoints committed or
// abandoned, restarts, detections. One JSON object per line with at least
// time, kind, generation and rank; each line is appended with O_APPEND in
// one write and fsynced, so concurrent writers never interleave.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>

namespace keel::common {

// Appends {"time", "kind", "generation", "rank"} plus `fields`. Failures are
// logged, not thrown: losing an event must not stop a run.
void append_event(const std::filesystem::path& run_dir, const std::string& kind, int64_t generation, int rank,
                  nlohmann::json fields = nlohmann::json::object());

// The current UTC time as ISO 8601 with milliseconds.
std::string utc_now();

}  // namespace keel::common
