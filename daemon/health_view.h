// keelctl's readable views of keeld's health replies: `keelctl health`
// (each rank's verdict with its reason, the detections so far and the hang
// budgets in force) and `keelctl diagnose` (the last hang verdict, and the
// ranks' recent collectives side by side, one column per rank, one row per
// collective, so that the rank that never began the one the others wait in
// stands out). --json prints the replies themselves.
#pragma once

#include <nlohmann/json.hpp>

#include <ostream>

namespace keel::daemon {

void print_health(const nlohmann::json& reply, std::ostream& out);
void print_diagnose(const nlohmann::json& reply, std::ostream& out);

}  // namespace keel::daemon
