#include "daemon/flight_dump.h"

#include "common/atomic_file.h"
#include "common/clock.h"

#include <fmt/format.h>


namespace keel::daemon {
namespace {

// Seconds from `ns` to `now_ns`; null for a time never set.
nlohmann::json age(int64_t ns, int64_t now_ns) {
  return ns > 0 ? nlohmann::json(common::ns_to_seconds(now_ns - ns)) : nlohmann::json(nullptr);
}

}  // namespace

nlohmann::json rank_collectives(const RankReport& rank, int64_t now_ns) {
  nlohmann::json out = {{"rank", rank.rank}, {"pid", rank.pid}, {"published", rank.last.has_value()}};
  out["exit_code"] = rank.exit_code ? nlohmann::json(*rank.exit_code) : nlohmann::json(nullptr);
  out["heartbeat_age_s"] = age(rank.heartbeat_ns, now_ns);
  nlohmann::json groups = nlohmann::json::array();
  nlohmann::json recent = nlohmann::json::array();
  if (rank.last) {
    const auto& s = *rank.last;
    out["phase"] = health::phase_name(s.phase);
    out["steps_done"] = s.steps_done;
    out["board_age_s"] = age(s.update_ns, now_ns);
    for (size_t id = 0; id < health::kMaxGroups; ++id) {
      const auto& g = s.groups[id];
      if (g.name[0] == '\0') continue;
      groups.push_back({{"id", id},
                        {"name", health::group_name(g)},
                        {"size", g.size},
                        {"index", g.index},
                        {"op", health::board_text(g.op)},
                        {"seq_begun", g.seq_begun},
                        {"seq_done", g.seq_done},
                        {"state", health::collective_state_name(g.state)},
                        {"bytes", g.bytes},
                        {"begun_age_s", age(g.begin_ns, now_ns)},
                        {"done_age_s", age(g.done_ns, now_ns)}});
    }
    const uint64_t held = std::min<uint64_t>(s.recent_count, health::kRecentCollectives);
    for (uint64_t i = 0; i < held; ++i) {
      const auto& c = s.recent[(s.recent_count - 1 - i) % health::kRecentCollectives];
      if (c.group < 0) continue;
      const bool known = static_cast<size_t>(c.group) < health::kMaxGroups &&
                         s.groups[static_cast<size_t>(c.group)].name[0] != '\0';
      const bool in_flight = c.state == static_cast<uint32_t>(health::CollectiveState::kInFlight);
      recent.push_back({{"group", known ? health::group_name(s.groups[static_cast<size_t>(c.group)]) : "?"},
                        {"group_id", c.group},
                        {"seq", c.seq},
                        {"op", health::board_text(c.op)},
                        {"state", health::collective_state_name(c.state)},
                        {"bytes", c.bytes},
                        {"age_s", age(c.begin_ns, now_ns)},
                        {"duration_s", common::ns_to_seconds((in_flight ? now_ns : c.end_ns) - c.begin_ns)}});
    }
  }
  out["groups"] = groups;
  out["recent"] = recent;
  return out;
}

std::string write_flight_dump(const std::filesystem::path& run_dir, int64_t generation,
                              const std::vector<nlohmann::json>& ranks, const nlohmann::json& verdict) {
  const std::string relative = fmt::format("flight/{}", generation);
  const auto dir = run_dir / relative;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    throw common::Error(common::ErrorCode::kInternal,
                        fmt::format("cannot create {}: {}", dir.string(), ec.message()));
  }
  for (const auto& rank : ranks) {
    common::write_file_atomically(dir / fmt::format("rank-{:05d}.json", rank.value("rank", 0)), rank.dump(2) + "\n",
                                  0644, common::ErrorCode::kInternal);
  }
  common::write_file_atomically(dir / "verdict.json", verdict.dump(2) + "\n", 0644, common::ErrorCode::kInternal);
  return relative;
}

}  // namespace keel::daemon
