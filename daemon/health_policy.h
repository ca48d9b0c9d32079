// What keeld does about the detectors' verdicts (docs/architecture.md
// "Daemon"), in one place and as a pure function, so that the whole policy
// is read and tested here:
//
// * a hang: recorded (`hang_detected`, with where the flight dump went),
//   and the generation is restarted, as a rank failure would be;
// * an SDC finding: recorded (`sdc_detected`), and with [health] sdc_policy
//   "restart" (or "exclude", which needs elastic runs and acts as restart
//   for now) the generation is stopped and the next one resumes from the
//   newest checkpoint at or before the last step known good: the replica
//   set's last agreed step for a digest finding, which moves every newer
//   checkpoint aside; the newest checkpoint for a rerun or known-answer
//   finding, whose corrupted step was never applied. A "data" verdict (the
//   batch, not a rank) and "warn" only record;
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
