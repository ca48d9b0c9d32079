#include "daemon/status_view.h"

#include "common/human_format.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace keel::daemon {
namespace {

std::string text(const nlohmann::json& j, const char* key, const std::string& otherwise = "-") {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return otherwise;
  return it->is_string() ? it->get<std::string>() : it->dump();
}

std::string collective(const nlohmann::json& rank) {
  const auto it = rank.find("collective");
  if (it == rank.end()) return "-";
  const auto& c = *it;
  return fmt::format("{} {} #{} {} {} ({:.3f} s)", c.value("group", "?"), c.value("op", "?"), c.value("seq", 0),
                     common::format_bytes(c.value("bytes", uint64_t{0})), c.value("state", "?"), c.value("duration_s", 0.0));
}

// "3 loss spikes (the last at step 120)"; empty for none.
std::string tally(const nlohmann::json& s, const char* key, const char* one, const char* many) {
  const auto it = s.find(key);
  if (it == s.end() || !it->is_object()) return "";
  const int64_t count = it->value("count", int64_t{0});
  if (count <= 0) return "";
  return fmt::format("{} {} (the last at step {})", count, count == 1 ? one : many, it->value("last_step", int64_t{-1}));
}

// "BLAS core Cooperlake (chosen by auto) on ranks 0, 1 | ..." (trainer/train/blas_core_start.h):
// ranks grouped by core and chooser, so a rank that fell back stands out.
std::string blas_cores(const nlohmann::json& ranks) {
  std::map<std::pair<std::string, std::string>, std::vector<std::string>> groups;
  for (const auto& r : ranks) {
    if (r.contains("blas_core")) groups[{text(r, "blas_core"), text(r, "blas_chosen_by")}].push_back(text(r, "rank"));
  }
  std::vector<std::string> parts;
  for (const auto& [core, members] : groups) {
    parts.push_back(fmt::format("{} (chosen by {}) on rank{} {}", core.first, core.second,
                                members.size() == 1 ? "" : "s", fmt::join(members, ", ")));
  }
  return parts.empty() ? "" : fmt::format("BLAS core {}\n", fmt::join(parts, " | "));
}

}  // namespace

void print_status(const nlohmann::json& s, std::ostream& out) {
  const int64_t restarts = s.value("restarts", 0);
  out << fmt::format("job {}: {}, generation {} ({} restart{})\n", text(s, "job"), text(s, "state"),
                     text(s, "generation"), restarts, restarts == 1 ? "" : "s");
  if (!text(s, "reason", "").empty()) out << "reason: " << text(s, "reason") << "\n";
  const int64_t step = s.value("step", int64_t{0}), total = s.value("total_steps", int64_t{0});
  std::string line = fmt::format("step {}/{} ({:.0f}%)", step, total, total > 0 ? 100.0 * step / total : 0.0);
  if (s.contains("loss") && s["loss"].is_number()) line += fmt::format(" | loss {:.4f}", s["loss"].get<double>());
  if (s.contains("tokens_per_s") && s["tokens_per_s"].is_number()) {
    line += fmt::format(" | {:.0f} tok/s", s["tokens_per_s"].get<double>());
  }
  if (s.contains("eta_s") && s["eta_s"].is_number()) line += " | ETA " + common::format_duration(s["eta_s"].get<double>());
  const int64_t checkpoint = s.value("checkpoint_step", int64_t{-1});
  line += checkpoint >= 0 ? fmt::format(" | checkpoint step {}", checkpoint) : std::string(" | no checkpoint yet");
  out << line << "\n";
  if (const auto rows = s.value("snapshots", nlohmann::json::array()); !rows.empty()) {
    const size_t ranks = s.value("ranks", nlohmann::json::array()).size();
    std::vector<std::string> parts;
    for (const auto& row : rows) {
      parts.push_back(fmt::format("step {} ({} of {} ranks, {})", row.value("step", int64_t{0}), row.value("ranks", 0),
                                  ranks, common::format_bytes(row.value("bytes", uint64_t{0}))));
    }
    out << fmt::format("in-memory snapshots on this node: {}\n", fmt::join(parts, ", "));
  }
  if (const auto copies = s.value("snapshot_copies", nlohmann::json()); copies.is_object()) {
    std::vector<std::string> parts;
    for (const auto& c : copies.value("sent", nlohmann::json::array())) {
      parts.push_back(fmt::format("rank {} step {} to '{}' ({:.2f} s)", c.value("rank", int64_t{0}),
                                  c.value("step", int64_t{0}), c.value("to", ""), c.value("seconds", 0.0)));
    }
    for (const auto& c : copies.value("held", nlohmann::json::array())) {
      parts.push_back(fmt::format("holds rank {} step {} ({})", c.value("rank", int64_t{0}),
                                  c.value("step", int64_t{0}), common::format_bytes(c.value("bytes", uint64_t{0}))));
    }
    if (const auto f = copies.value("failing", nlohmann::json()); f.is_object()) {
      parts.push_back(fmt::format("step {} not yet held by its buddy after {} tries, no later copy until it is: {}",
                                  f.value("step", int64_t{0}), f.value("tries", 0), f.value("why", "")));
    }
    out << fmt::format("snapshot copies: {}\n", parts.empty() ? std::string("none yet") : fmt::format("{}", fmt::join(parts, ", ")));
  }
  // Records, no alarms: what the operator may want to look at in events.
  const std::string spikes = tally(s, "loss_spikes", "loss spike", "loss spikes");
  const std::string skipped = tally(s, "skipped_steps", "step skipped", "steps skipped");
  if (!spikes.empty() || !skipped.empty()) {
    out << (spikes.empty() ? skipped : skipped.empty() ? spikes : spikes + " | " + skipped)
        << " (keelctl events: loss_spike, step_skipped)\n";
  }
  // Per step, per axis: what one rank hands to its group, and whether the
  // group spans nodes (its bytes cross the slower links).
  const auto crossing = s.contains("cluster") && s["cluster"].is_object()
                            ? s["cluster"].value("cross_node_axes", nlohmann::json::array())
                            : nlohmann::json::array();
  if (const auto bytes = s.value("axis_bytes_per_step", nlohmann::json::object()); !bytes.empty()) {
    std::vector<std::string> parts;
    for (const auto& [axis, n] : bytes.items()) {
      const bool across = std::find(crossing.begin(), crossing.end(), axis) != crossing.end();
      parts.push_back(fmt::format("{} {}{}", axis, common::format_bytes(n.get<uint64_t>()), across ? " across nodes" : ""));
    }
    out << fmt::format("collectives a step, per rank: {}\n", fmt::join(parts, ", "));
  }
  if (const auto c = s.find("cluster"); c != s.end() && c->is_object()) {
    const auto nodes = c->value("nodes", nlohmann::json::array());
    out << fmt::format("node {} ({} of {}: {}), ranks {} to {} of {}", text(*c, "node"), text(*c, "node_rank"),
                       nodes.size(), fmt::join(nodes.get<std::vector<std::string>>(), ", "),
                       c->value("first_rank", 0),
                       c->value("first_rank", 0) + static_cast<int>(s.value("ranks", nlohmann::json::array()).size()) - 1,
                       text(*c, "world"));
    if (const auto axes = c->value("cross_node_axes", nlohmann::json::array()); !axes.empty()) {
      out << fmt::format(" | across nodes: {}", fmt::join(axes.get<std::vector<std::string>>(), ", "));
    }
    if (c->contains("etcd_unreachable_s") && (*c)["etcd_unreachable_s"].is_number()) {
      out << fmt::format(" | degraded: etcd unreachable for {:.0f} s", (*c)["etcd_unreachable_s"].get<double>());
    }
    out << "\n";
    const auto members = c->value("members", nlohmann::json::array());
    for (size_t i = 0; i < members.size(); ++i) {
      const auto& n = members[i];
      const int first = n.value("first_rank", 0);
      const std::string address = n.value("address", "");
      const double heard_s = n.contains("heard_s") && n["heard_s"].is_number() ? n["heard_s"].get<double>() : 0;
      out << fmt::format("  node {} {} at {}: ranks {} to {}, {}{}\n", i, text(n, "node"),
                         address.empty() ? "-" : address, first, first + n.value("ranks", 1) - 1, text(n, "health"),
                         heard_s >= 1 ? fmt::format(" (heard {:.0f} s ago)", heard_s) : "");
    }
  }
  out << blas_cores(s.value("ranks", nlohmann::json::array()));
  out << "run_dir " << text(s, "run_dir");
  if (s.contains("metrics_port") && s["metrics_port"].is_number()) {
    out << " | metrics http://127.0.0.1:" << s["metrics_port"].get<int>() << "/metrics";
  }
  out << " | keeld pid " << text(s, "keeld_pid") << ", up " << common::format_duration(s.value("uptime_s", 0.0)) << "\n\n";
  out << fmt::format("{:<5} {:<8} {:>7} {:<11} {:<9} {:<9} {:<10} {}\n", "rank", "pid", "step", "phase", "step_ms",
                     "health", "verdict", "last collective");
  for (const auto& r : s.value("ranks", nlohmann::json::array())) {
    std::string health = text(r, "health");
    if (r.contains("exit_code") && r["exit_code"].is_number()) health += " " + r["exit_code"].dump();
    const std::string step_ms =
        r.contains("step_ms") && r["step_ms"].is_number() ? fmt::format("{:.1f}", r["step_ms"].get<double>()) : "-";
    out << fmt::format("{:<5} {:<8} {:>7} {:<11} {:<9} {:<9} {:<10} {}\n", text(r, "rank"), text(r, "pid"),
                       text(r, "step"), text(r, "phase"), step_ms, health, text(r, "verdict"), collective(r));
  }
  // Why a rank is not healthy, below the table.
  for (const auto& r : s.value("ranks", nlohmann::json::array())) {
    if (!text(r, "verdict_reason", "").empty()) out << "rank " << text(r, "rank") << ": " << text(r, "verdict_reason") << "\n";
  }
}

void print_events(const nlohmann::json& reply, std::ostream& out) {
  const auto events = reply.value("events", nlohmann::json::array());
  if (events.empty()) {
    out << "no events yet\n";
    return;
  }
  out << fmt::format("{:<24} {:>4} {:>5}  {:<22} {}\n", "time", "gen", "rank", "kind", "details");
  for (const auto& e : events) {
    nlohmann::json details = e;
    for (const char* key : {"time", "generation", "rank", "kind"}) details.erase(key);
    const int rank = e.value("rank", -1);
    out << fmt::format("{:<24} {:>4} {:>5}  {:<22} {}\n", text(e, "time"), text(e, "generation"),
                       rank < 0 ? std::string("keeld") : std::to_string(rank), text(e, "kind"),
                       details.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  }
}

}  // namespace keel::daemon
