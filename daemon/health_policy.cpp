#include "daemon/health_policy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace keel::daemon {
namespace {

std::string sdc_cause(const SdcFinding& f) {
  const std::string who = f.rank >= 0 ? fmt::format("rank {}", f.rank)
                                      : fmt::format("replicas [{}] disagree and no majority names one",
                                                    fmt::join(f.disagreeing, ", "));
  const std::string back = f.last_good_step ? fmt::format("the newest checkpoint at or before step {}", *f.last_good_step)
                                            : std::string("the newest checkpoint");
  return fmt::format("silent data corruption detected: {} at step {} ({}, {}); resuming from {}", who, f.step,
                     f.method, f.verdict, back);
}

}  // namespace

HealthResponse respond(const Verdicts& verdicts, const std::string& sdc_policy, const std::string& flight_dir) {
  HealthResponse r;
  for (const auto& hang : verdicts.hangs) {
    auto fields = hang.to_json();
    if (!flight_dir.empty()) fields["flight"] = flight_dir;
    r.events.push_back({"hang_detected", std::move(fields)});
    if (r.stop_cause.empty()) r.stop_cause = "hang detected: " + hang.reason;
  }
  for (const auto& sdc : verdicts.sdc) {
    // The trainer's own findings are its to record and were already dealt
    // with: rank 0 appended sdc_detected, a rerun replaced the corrupted
    // step before it was applied, and a failed
    // known-answer test stopped every rank with exit 11. Rolling back would
    // only repeat correct steps.
    if (sdc.method != "replica_digest") continue;
    auto fields = sdc.event_fields();
    fields["policy"] = sdc_policy;
    r.events.push_back({"sdc_detected", std::move(fields)});
    // Nobody to blame: rolling back cannot help.
    const bool corrupted_state = sdc.rank >= 0 || !sdc.disagreeing.empty();
    if (sdc_policy == "warn" || !corrupted_state) continue;
    if (sdc_policy == "exclude") {
      r.warnings.push_back(fmt::format("sdc_policy \"exclude\": rank {} cannot be left out before runs are elastic; "
                                       "restarting with every rank instead",
                                       sdc.rank));
    }
    if (r.stop_cause.empty()) r.stop_cause = sdc_cause(sdc);
    if (sdc.last_good_step) {
      r.keep_through_step = std::min(r.keep_through_step.value_or(*sdc.last_good_step), *sdc.last_good_step);
    }
  }
  for (const auto& straggler : verdicts.stragglers) r.events.push_back({"straggler_flagged", straggler.to_json()});
  return r;
}

}  // namespace keel::daemon
