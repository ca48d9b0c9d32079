// What keeld does about the detectors' verdicts (docs/architecture.md
// "Daemon"), in one place and as a pure function, so that the whole policy
// is read and tested here:
//
// * a hang: recorded (`hang_detected`, with where the flight dump went),
//   and the generation is restarted, as a rank failure would be;
// * a replica-digest finding: recorded (`sdc_detected`), and with [health]
//   sdc_policy "restart" (or "exclude", which needs elastic runs and acts
//   as restart for now) the generation is stopped and the next one resumes
//   from the newest checkpoint at or before the replica set's last agreed
//   step, every newer checkpoint moved aside; "warn" only records. The
//   trainer's own findings (rerun, known-answer test) are neither recorded
//   again nor acted on: rank 0 recorded them, the rerun already replaced
//   the corrupted step, and a failed known-answer test already stopped
//   every rank (exit 11). The monitor still marks their rank suspect;
// * a straggler: recorded (`straggler_flagged`), nothing else: a slow rank
//   still trains correctly.
#pragma once

#include "daemon/health_monitor.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace keel::daemon {

struct HealthResponse {
  struct Event {
    std::string kind;
    nlohmann::json fields;
  };
  std::vector<Event> events;         // to append to events.jsonl, in order
  std::vector<std::string> warnings; // to log
  std::string stop_cause;            // non-empty: stop the generation with this cause and restart
  // Move every checkpoint of a later step aside before the next generation
  // starts; nothing: keep them all.
  std::optional<int64_t> keep_through_step;
};

// `flight_dir`: where the flight dump of this poll's hangs went, relative
// to the run directory ("flight/3"); empty when there was none.
HealthResponse respond(const Verdicts& verdicts, const std::string& sdc_policy, const std::string& flight_dir);

}  // namespace keel::daemon
