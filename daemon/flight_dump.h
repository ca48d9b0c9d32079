// What each rank was doing in its collectives, as keeld last read its board
// (docs/architecture.md "Daemon"): the group table and the ring of recent
// collectives. A hang verdict writes it to run_dir/flight/<generation>/
// (one rank-NNNNN.json per rank, and verdict.json), so it survives the
// restart that follows; `keelctl diagnose` shows the same records side by
// side. The ranks' own flight recorders (run_dir/flight/rank-NNNNN.json)
// are written by a rank that fails by itself; a frozen rank writes nothing,
// which is why keeld keeps its own record.
#pragma once

#include "daemon/job_views.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace keel::daemon {

// One rank's record at `now_ns`:
// {"rank", "pid", "exit_code", "published" (false: no board was ever read),
//  "phase", "steps_done", "board_age_s", "heartbeat_age_s" (null: never beaten),
//  "groups": [{"id", "name", "size", "index", "op", "seq_begun", "seq_done",
//              "state", "bytes", "begun_age_s", "done_age_s"}],
//  "recent": [{"group", "group_id", "seq", "op", "state", "bytes",
//              "age_s" (since it began), "duration_s" (to its end, or to now in flight)}]}
// with "recent" newest first. The board is not trusted: a group id out of
// range shows as "?", and no more than the ring holds is read.
nlohmann::json rank_collectives(const RankReport& rank, int64_t now_ns);

// Writes `ranks` (rank_collectives records) as rank-NNNNN.json and
// `verdict` as verdict.json under run_dir/flight/<generation>/, each file
// atomically, and returns that directory relative to run_dir
// ("flight/3"). Error(kInternal) naming the file that could not be written.
std::string write_flight_dump(const std::filesystem::path& run_dir, int64_t generation,
                              const std::vector<nlohmann::json>& ranks, const nlohmann::json& verdict);

}  // namespace keel::daemon
