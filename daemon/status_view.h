// keelctl's readable views of keeld's replies: the status of a job with its
// per-rank table, and the event log. --json prints the replies themselves.
#pragma once

#include <nlohmann/json.hpp>

#include <ostream>

namespace keel::daemon {

void print_status(const nlohmann::json& status, std::ostream& out);
void print_events(const nlohmann::json& events, std::ostream& out);

}  // namespace keel::daemon
