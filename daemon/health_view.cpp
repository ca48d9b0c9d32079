#include "daemon/health_view.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace keel::daemon {
namespace {

constexpr size_t kDiagnoseRows = 12;

double number(const nlohmann::json& j, const char* key) {
  const auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : 0.0;
}

std::string ranks_of(const nlohmann::json& j, const char* key) {
  std::vector<std::string> ranks;
  for (const auto& r : j.value(key, nlohmann::json::array())) ranks.push_back(r.dump());
  return ranks.empty() ? std::string("none") : fmt::format("{}", fmt::join(ranks, ", "));
}

// "dp 31.2 s, tp 4.0 s" from {"dp": 31.2, "tp": 4.0}.
std::string budgets(const nlohmann::json& by_name) {
  std::vector<std::string> parts;
  for (const auto& [name, s] : by_name.items()) parts.push_back(fmt::format("{} {:.1f} s", name, s.is_number() ? s.get<double>() : 0.0));
  return parts.empty() ? std::string("none yet") : fmt::format("{}", fmt::join(parts, ", "));
}

// One rank's cell in the row of (group, seq): what its record says of
// that collective.
std::string cell(const nlohmann::json& rank, const std::string& group, int64_t seq) {
  if (!rank.value("published", false)) return "no board";
  for (const auto& c : rank.value("recent", nlohmann::json::array())) {
    if (c.value("group", "") != group || c.value("seq", int64_t{-1}) != seq) continue;
    const std::string state = c.value("state", "?");
    if (state == "in_flight") return fmt::format("in flight {:.1f}s", number(c, "age_s"));
    if (state == "done") return fmt::format("done {:.1f}s ago", number(c, "age_s"));
    return state;
  }
  for (const auto& g : rank.value("groups", nlohmann::json::array())) {
    if (g.value("name", "") != group) continue;
    // A member that has not begun it is who the others wait for.
    return g.value("seq_begun", int64_t{-1}) < seq ? "NOT BEGUN" : "-";
  }
  return "";  // not a member of that group
}

}  // namespace

void print_health(const nlohmann::json& reply, std::ostream& out) {
  // On many nodes each rank says its node.
  const auto ranks = reply.value("ranks", nlohmann::json::array());
  const bool nodes = !ranks.empty() && ranks[0].contains("node");
  out << fmt::format("{:<5} {}{:<10} {}\n", "rank", nodes ? fmt::format("{:<12} ", "node") : "", "health", "reason");
  for (const auto& r : ranks) {
    out << fmt::format("{:<5} {}{:<10} {}\n", r.value("rank", -1),
                       nodes ? fmt::format("{:<12} ", r.value("node", "?")) : "", r.value("health", "?"),
                       r.value("reason", ""));
  }
  const auto d = reply.value("detections", nlohmann::json::object());
  out << fmt::format("\ndetections: {} hang, {} sdc, {} straggler | synchronisation tax {:.3f}\n",
                     d.value("hang", 0), d.value("sdc", 0), d.value("straggler", 0), number(reply, "sync_tax"));
  const auto records = reply.value("records", nlohmann::json::object());
  out << fmt::format("records, no alarms: loss spikes {}, steps skipped {}\n", records.value("loss_spikes", 0),
                     records.value("skipped_steps", 0));
  const auto b = reply.value("hang_budgets", nlohmann::json::object());
  out << fmt::format("hang budgets ({}): groups {}; phases {}\n",
                     b.value("warmed_up", false) ? "learned" : "warming up: the ceiling holds",
                     budgets(b.value("groups", nlohmann::json::object())),
                     budgets(b.value("phases", nlohmann::json::object())));
}

void print_diagnose(const nlohmann::json& reply, std::ostream& out) {
  const auto verdict = reply.value("verdict", nlohmann::json());
  std::string group;
  int64_t seq = -1;
  if (verdict.is_object()) {
    group = verdict.value("group", "");
    seq = verdict.value("seq", int64_t{-1});
    out << fmt::format("hang in {} #{} ({}), generation {}: detected after {:.1f} s (budget {:.1f} s)\n", group, seq,
                       verdict.value("op", "?"), verdict.value("generation", int64_t{-1}), number(verdict, "detect_s"),
                       number(verdict, "budget_s"));
    out << fmt::format("culprits: {} (frozen: {}) | waiting: {}\n", ranks_of(verdict, "culprit_ranks"),
                       ranks_of(verdict, "frozen_ranks"), ranks_of(verdict, "waiting_ranks"));
    out << verdict.value("reason", "") << "\n";
    if (reply.contains("flight") && reply["flight"].is_string()) {
      out << "flight dump: run_dir/" << reply["flight"].get<std::string>() << "\n";
    }
  } else {
    out << fmt::format("no hang detected since keeld started; the ranks' collectives now (generation {}):\n",
                       reply.value("generation", int64_t{-1}));
  }
  const auto ranks = reply.value("ranks", nlohmann::json::array());

  // One row per collective any rank remembers, newest first (by the
  // youngest rank's age), and the verdict's own row whatever its age.
  struct Row {
    std::string op;
    double youngest = std::numeric_limits<double>::infinity();
  };
  std::map<std::pair<std::string, int64_t>, Row> rows;
  if (!group.empty()) rows[{group, seq}] = {verdict.value("op", "?"), -1};
  for (const auto& r : ranks) {
    for (const auto& c : r.value("recent", nlohmann::json::array())) {
      auto& row = rows[{c.value("group", "?"), c.value("seq", int64_t{-1})}];
      row.op = c.value("op", "?");
      row.youngest = std::min(row.youngest, number(c, "age_s"));
    }
  }
  std::vector<std::pair<std::pair<std::string, int64_t>, Row>> ordered(rows.begin(), rows.end());
  std::stable_sort(ordered.begin(), ordered.end(),
                   [](const auto& a, const auto& b) { return a.second.youngest < b.second.youngest; });
  if (ordered.size() > kDiagnoseRows) ordered.resize(kDiagnoseRows);

  size_t group_width = 5;
  for (const auto& [key, row] : ordered) group_width = std::max(group_width, key.first.size());
  std::string header = fmt::format("\n{:<{}} {:>6} {:<14}", "group", group_width, "seq", "op");
  for (const auto& r : ranks) header += fmt::format(" {:<17}", fmt::format("rank {}", r.value("rank", -1)));
  out << header << "\n";
  for (const auto& [key, row] : ordered) {
    std::string line = fmt::format("{:<{}} {:>6} {:<14}", key.first, group_width, key.second, row.op);
    for (const auto& r : ranks) line += fmt::format(" {:<17}", cell(r, key.first, key.second));
    out << line << "\n";
  }
  out << "\n";
  for (const auto& r : ranks) {
    if (!r.value("published", false)) {
      out << fmt::format("rank {}: never published its board\n", r.value("rank", -1));
      continue;
    }
    const auto heartbeat = r.value("heartbeat_age_s", nlohmann::json());
    out << fmt::format("rank {}: {} at step {}, board {:.1f} s old, heartbeat {}\n", r.value("rank", -1),
                       r.value("phase", "?"), r.value("steps_done", int64_t{0}), number(r, "board_age_s"),
                       heartbeat.is_number() ? fmt::format("{:.1f} s old", heartbeat.get<double>())
                                             : std::string("never beaten"));
  }
}

}  // namespace keel::daemon
