// A rank's log as keeld keeps it (docs/architecture.md "Run directory"):
// run_dir/logs/rank-NNNNN.log, the rank's stdout and stderr appended under
// one header line per generation, and what keeld reads back from it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

namespace keel::daemon {

std::filesystem::path rank_log_path(const std::filesystem::path& run_dir, int rank);

// The line keeld appends before it starts `rank` in `generation`.
std::string rank_log_header(int64_t generation, int rank);

// What the rank said last about why it exits: keel-trainer ends with
// `keel-trainer: <error_code_name>: <sentence>` on stderr (docs/architecture.md
// "Worker contract"). The sentence of the last such line after the newest
// header, read from at most the last `max_bytes` of the log, since a rank may
// have written megabytes before it; empty when there is none.
std::string last_error_sentence(const std::filesystem::path& log, size_t max_bytes = 64 * 1024);

}  // namespace keel::daemon
