// What keeld and keelctl show, on their own: the views of a JobReport are
// pure functions of it (ages counted to its now_ns), and the flight records
// and keelctl's health and diagnose views render synthetic boards,
// garbage in them included.
#include "daemon/flight_dump.h"
#include "daemon/health_view.h"
#include "daemon/job_views.h"
#include "daemon/status_view.h"
#include "tests/support/temp_dir.h"

#include <doctest/doctest.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

namespace keel::daemon {
namespace {

constexpr int64_t kNow = 500'000'000'000;
constexpr int64_t kSecond = 1'000'000'000;

// A rank of group g0.dp.0 whose last collective is `seq` in `state`, begun
// `age_s` before kNow.
RankReport rank_in_dp(int rank, int64_t seq, health::CollectiveState state, double age_s) {
  RankReport r;
  r.rank = rank;
  r.pid = 100 + rank;
  r.heartbeat_ns = kNow - kSecond / 10;
  health::BoardSnapshot b;
  b.rank = rank;
  b.steps_done = 12;
  b.phase = static_cast<uint32_t>(health::Phase::kBackward);
  b.update_ns = kNow - kSecond;
  auto& g = b.groups[0];
  std::strcpy(g.name, "g0.dp.0");
  std::strcpy(g.op, "all_reduce");
  g.size = 3;
  g.index = rank;
  g.seq_begun = seq;
  g.seq_done = state == health::CollectiveState::kInFlight ? seq - 1 : seq;
  g.state = static_cast<uint32_t>(state);
  g.begin_ns = kNow - static_cast<int64_t>(age_s * 1e9);
  // The ring: seq - 1 done, then seq.
  for (int64_t s = seq - 1; s <= seq; ++s) {
    auto& c = b.recent[b.recent_count % health::kRecentCollectives];
    c.group = 0;
    c.seq = s;
    std::strcpy(c.op, "all_reduce");
    const bool last = s == seq;
    c.state = static_cast<uint32_t>(last ? state : health::CollectiveState::kDone);
    c.begin_ns = last ? g.begin_ns : g.begin_ns - 2 * kSecond;
    c.end_ns = last && state == health::CollectiveState::kInFlight ? 0 : c.begin_ns + kSecond / 100;
    ++b.recent_count;
  }
  r.last = b;
  return r;
}

// A running job's report, taken at kNow.
JobReport running_report() {
  JobReport report;
  report.now_ns = kNow;
  report.job = "views";
  report.state = JobState::kRunning;
  return report;
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("the status and the metrics of a report count ages to its now and carry the detectors' verdicts") {
    JobReport report = running_report();
    report.stale_after_s = 2;
    report.ranks = {rank_in_dp(0, 7, health::CollectiveState::kInFlight, 3),
                    rank_in_dp(1, 6, health::CollectiveState::kDone, 9)};
    report.ranks[1].last->update_ns = kNow - 3 * kSecond;  // older than stale_after_s
    report.ranks[1].verdict = {RankCondition::kHung, "never began the collective"};
    report.ranks[0].straggler_score = 0.25;
    report.detections = {1, 2, 3};

    const auto status = status_json(report);
    CHECK(status.at("ranks").at(0).at("health") == "ok");
    CHECK(status.at("ranks").at(1).at("health") == "stale");
    CHECK(status.at("ranks").at(0).at("board_age_s") == doctest::Approx(1.0));
    CHECK(status.at("ranks").at(0).at("collective").at("duration_s") == doctest::Approx(3.0));
    CHECK(status.at("ranks").at(0).at("verdict") == "healthy");
    CHECK(status.at("ranks").at(1).at("verdict") == "hung");
    CHECK(status.at("ranks").at(1).at("verdict_reason") == "never began the collective");
    CHECK(status_line(report).find("health rank 1 hung") != std::string::npos);

    std::ostringstream table;
    print_status(status, table);
    CHECK(table.str().find("verdict") != std::string::npos);
    CHECK(table.str().find("rank 1: never began the collective") != std::string::npos);

    const std::string page = metrics_text(report);
    CHECK(page.find("keel_detections_total{job=\"views\",kind=\"hang\"} 1") != std::string::npos);
    CHECK(page.find("keel_detections_total{job=\"views\",kind=\"sdc\"} 2") != std::string::npos);
    CHECK(page.find("keel_detections_total{job=\"views\",kind=\"straggler\"} 3") != std::string::npos);
    CHECK(page.find("keel_rank_straggler_score{job=\"views\",rank=\"0\"} 0.25") != std::string::npos);
    CHECK(page.find("keel_rank_board_age_seconds{job=\"views\",rank=\"1\"} 3") != std::string::npos);
  }

  TEST_CASE("the status names each rank's BLAS core and a rank that fell back stands apart") {
    JobReport report = running_report();
    report.ranks = {rank_in_dp(0, 7, health::CollectiveState::kDone, 1), rank_in_dp(1, 7, health::CollectiveState::kDone, 1),
                    rank_in_dp(2, 7, health::CollectiveState::kDone, 1)};
    for (auto& rank : report.ranks) {
      std::strcpy(rank.last->blas_core, rank.rank == 2 ? "Prescott" : "Cooperlake");
      std::strcpy(rank.last->blas_chosen_by, rank.rank == 2 ? "fallback" : "auto");
    }
    const auto status = status_json(report);
    CHECK(status.at("ranks").at(0).at("blas_core") == "Cooperlake");
    CHECK(status.at("ranks").at(2).at("blas_chosen_by") == "fallback");
    std::ostringstream table;
    print_status(status, table);
    CAPTURE(table.str());
    CHECK(table.str().find("BLAS core Cooperlake (chosen by auto) on ranks 0, 1 | Prescott (chosen by fallback) on "
                           "rank 2\n") != std::string::npos);
  }

  TEST_CASE("a node of a many-node job shows its place in the job and etcd out of reach as degraded") {
    JobReport report = running_report();
    report.ranks = {rank_in_dp(0, 7, health::CollectiveState::kDone, 1), rank_in_dp(1, 7, health::CollectiveState::kDone, 1)};
    // Each rank's last step: its DP group's payload, and a TP group inside the node.
    for (auto& r : report.ranks) {
      r.last->groups[0].step_bytes = 3u << 20;
      std::strcpy(r.last->groups[1].name, "g0.tp.1");
      r.last->groups[1].step_bytes = 512u << 10;
    }
    report.ranks[1].last->groups[1].step_bytes = 256u << 10;  // the most of any rank shows
    const std::vector<NodeReport> members = {{"node-a", "10.0.0.1", 0, 2, "rank 0 straggler", 3.2},
                                             {"node-b", "10.0.0.2", 2, 2, "ok", 0.0},
                                             {"node-c", "", 4, 2, "not heard from", std::nullopt}};
    report.cluster = ClusterReport{"node-b", 1, members, 6, 2, {"dp"}, std::nullopt};
    CHECK(status_line(report).find(" node node-b") != std::string::npos);
    CHECK(status_line(report).find("degraded") == std::string::npos);
    auto status = status_json(report);
    CHECK(status.at("cluster").at("node_rank") == 1);
    CHECK(status.at("cluster").at("etcd_unreachable_s").is_null());
    std::ostringstream table;
    print_status(status, table);
    CAPTURE(table.str());
    CHECK(table.str().find("node node-b (1 of 3: node-a, node-b, node-c), ranks 2 to 3 of 6 | across nodes: dp\n") !=
          std::string::npos);
    // Every node of the job, with what this node knows of it.
    CHECK(status.at("cluster").at("members").size() == 3);
    CHECK(status.at("cluster").at("members")[2].at("heard_s").is_null());
    CHECK(table.str().find("  node 0 node-a at 10.0.0.1: ranks 0 to 1, rank 0 straggler (heard 3 s ago)\n") !=
          std::string::npos);
    CHECK(table.str().find("  node 1 node-b at 10.0.0.2: ranks 2 to 3, ok\n") != std::string::npos);
    CHECK(table.str().find("  node 2 node-c at -: ranks 4 to 5, not heard from\n") != std::string::npos);
    CHECK(status.at("axis_bytes_per_step") == nlohmann::json{{"dp", 3u << 20}, {"tp", 512u << 10}});
    CHECK(table.str().find("collectives a step, per rank: dp 3.0 MiB across nodes, tp 512.0 KiB\n") !=
          std::string::npos);

    report.cluster->etcd_unreachable_s = 12.4;
    CHECK(status_line(report).find("degraded: etcd unreachable for 12 s") != std::string::npos);
    status = status_json(report);
    std::ostringstream degraded;
    print_status(status, degraded);
    CHECK(degraded.str().find("| degraded: etcd unreachable for 12 s") != std::string::npos);
    // One node: no cluster at all.
    report.cluster.reset();
    CHECK(status_json(report).at("cluster").is_null());
  }

  TEST_CASE("the status shows the copies sent and held and a copy step its buddy has not taken") {
    JobReport report = running_report();
    report.buddy = BuddyReport{{{4, 13, 1u << 20}}, {{0, 12, 1u << 20, 0.25, "node-1"}}, std::nullopt};
    auto status = status_json(report);
    CHECK(status.at("snapshot_copies").at("failing").is_null());
    std::ostringstream table;
    print_status(status, table);
    CAPTURE(table.str());
    CHECK(table.str().find("snapshot copies: rank 0 step 12 to 'node-1' (0.25 s), holds rank 4 step 13 (1.0 MiB)\n") !=
          std::string::npos);
    report.buddy->failing = CopyFailure{14, 3, "cannot connect: Connection refused"};
    status = status_json(report);
    CHECK(status.at("snapshot_copies").at("failing") ==
          nlohmann::json{{"step", 14}, {"tries", 3}, {"why", "cannot connect: Connection refused"}});
    std::ostringstream failing;
    print_status(status, failing);
    CHECK(failing.str().find("step 14 not yet held by its buddy after 3 tries, no later copy until it is: cannot "
                             "connect: Connection refused\n") != std::string::npos);
  }

  TEST_CASE("loss spikes and skipped steps show in the status and on the page but never as detections") {
    JobReport report = running_report();
    report.ranks = {rank_in_dp(0, 7, health::CollectiveState::kDone, 1)};
    std::ostringstream quiet;
    print_status(status_json(report), quiet);
    CHECK(quiet.str().find("loss spike") == std::string::npos);
    CHECK(quiet.str().find("skipped") == std::string::npos);

    report.loss_spikes = {3, 120};
    report.skipped_steps = {1, 40};
    const auto status = status_json(report);
    CHECK(status.at("loss_spikes") == nlohmann::json{{"count", 3}, {"last_step", 120}});
    CHECK(status.at("skipped_steps") == nlohmann::json{{"count", 1}, {"last_step", 40}});
    std::ostringstream table;
    print_status(status, table);
    CAPTURE(table.str());
    CHECK(table.str().find("3 loss spikes (the last at step 120) | 1 step skipped (the last at step 40)") !=
          std::string::npos);

    const std::string page = metrics_text(report);
    CHECK(page.find("keel_loss_spikes_total{job=\"views\"} 3") != std::string::npos);
    CHECK(page.find("keel_steps_skipped_total{job=\"views\"} 1") != std::string::npos);
    CHECK(page.find("keel_detections_total{job=\"views\",kind=\"sdc\"} 0") != std::string::npos);
  }

  TEST_CASE("keelctl diagnose shows the rank that never began the collective the others wait in") {
    const std::vector<RankReport> ranks = {rank_in_dp(0, 7, health::CollectiveState::kInFlight, 31),
                                           rank_in_dp(1, 6, health::CollectiveState::kDone, 35),
                                           rank_in_dp(2, 7, health::CollectiveState::kInFlight, 31)};
    nlohmann::json records = nlohmann::json::array();
    for (const auto& r : ranks) records.push_back(rank_collectives(r, kNow));
    CHECK(records[0].at("recent").at(0).at("seq") == 7);  // newest first
    CHECK(records[0].at("recent").at(0).at("state") == "in_flight");
    CHECK(records[0].at("recent").at(0).at("duration_s") == doctest::Approx(31.0));
    CHECK(records[1].at("groups").at(0).at("seq_begun") == 6);
    CHECK(records[1].at("heartbeat_age_s") == doctest::Approx(0.1));

    const nlohmann::json reply = {
        {"ok", true},
        {"verdict",
         {{"culprit_ranks", {1}}, {"waiting_ranks", {0, 2}}, {"frozen_ranks", nlohmann::json::array()},
          {"group", "g0.dp.0"}, {"seq", 7}, {"op", "all_reduce"}, {"detect_s", 31.0}, {"budget_s", 30.0},
          {"reason", "rank 1 never began g0.dp.0 #7"}, {"generation", 0}}},
        {"generation", 0},
        {"flight", "flight/0"},
        {"ranks", records}};
    std::ostringstream out;
    print_diagnose(reply, out);
    const std::string text = out.str();
    CAPTURE(text);
    CHECK(text.find("hang in g0.dp.0 #7 (all_reduce), generation 0") != std::string::npos);
    CHECK(text.find("culprits: 1") != std::string::npos);
    CHECK(text.find("flight dump: run_dir/flight/0") != std::string::npos);
    // The verdict's row: two ranks in flight, the culprit not begun.
    std::istringstream lines(text);
    std::string row;
    for (std::string line; std::getline(lines, line);) {
      if (line.starts_with("g0.dp.0") && line.find(" 7 ") != std::string::npos) row = line;
    }
    CHECK(row.find("in flight 31.0s") != std::string::npos);
    CHECK(row.find("NOT BEGUN") != std::string::npos);
    CHECK(row.find("NOT BEGUN") > row.find("in flight"));  // rank 1's column after rank 0's

    // Without a verdict the same table shows the ranks as they are.
    std::ostringstream live;
    print_diagnose({{"ok", true}, {"verdict", nullptr}, {"generation", 2}, {"ranks", records}}, live);
    CHECK(live.str().find("no hang detected") != std::string::npos);
    CHECK(live.str().find("NOT BEGUN") != std::string::npos);
  }

  TEST_CASE("a flight record of a garbage board names no group it does not have and reads no more than the ring") {
    RankReport r = rank_in_dp(0, 7, health::CollectiveState::kInFlight, 1);
    auto& b = *r.last;
    b.recent[0].group = 99;       // out of the table
    b.recent[1].group = 5;        // an empty slot
    b.recent_count = ~uint64_t{0};  // far past the ring
    std::memset(b.groups[0].op, 'x', sizeof(b.groups[0].op));  // no NUL
    const auto record = rank_collectives(r, kNow);
    CHECK(record.at("recent").size() <= health::kRecentCollectives);
    CHECK(record.at("groups").at(0).at("op").get<std::string>().size() == health::kOpNameBytes);
    for (const auto& c : record.at("recent")) {
      if (c.at("group_id") == 99 || c.at("group_id") == 5) CHECK(c.at("group") == "?");
    }
    RankReport never;
    never.rank = 3;
    const auto empty = rank_collectives(never, kNow);
    CHECK(empty.at("published") == false);
    CHECK(empty.at("recent").empty());
    CHECK(empty.at("heartbeat_age_s").is_null());
  }

  TEST_CASE("a flight dump writes one file per rank and the verdict under the generation") {
    test::TempDir dir;
    const std::vector<nlohmann::json> records = {rank_collectives(rank_in_dp(0, 7, health::CollectiveState::kInFlight, 1), kNow),
                                                 rank_collectives(rank_in_dp(1, 6, health::CollectiveState::kDone, 1), kNow)};
    const std::string where = write_flight_dump(dir.path(), 4, records, {{"group", "g4.dp.0"}});
    CHECK(where == "flight/4");
    for (const char* file : {"rank-00000.json", "rank-00001.json", "verdict.json"}) {
      CAPTURE(file);
      std::ifstream in(dir / "flight" / "4" / file);
      REQUIRE(in.good());
      CHECK(!nlohmann::json::parse(in).empty());
    }
  }

  TEST_CASE("keelctl health shows each rank's verdict with its reason and the detections") {
    const nlohmann::json reply = {
        {"ok", true},
        {"ranks",
         {{{"rank", 0}, {"health", "healthy"}, {"reason", ""}},
          {{"rank", 1}, {"health", "suspect"}, {"reason", "at step 40 its replica digest differed"}}}},
        {"detections", {{"hang", 0}, {"sdc", 1}, {"straggler", 0}}},
        {"hang_budgets", {{"warmed_up", true}, {"groups", {{"dp", 31.5}}}, {"phases", {{"checkpoint", 120.0}}}}},
        {"sync_tax", 1.04},
        {"records", {{"loss_spikes", 2}, {"skipped_steps", 1}}}};
    std::ostringstream out;
    print_health(reply, out);
    const std::string text = out.str();
    CAPTURE(text);
    CHECK(text.find("suspect    at step 40 its replica digest differed") != std::string::npos);
    CHECK(text.find("0 hang, 1 sdc, 0 straggler") != std::string::npos);
    CHECK(text.find("records, no alarms: loss spikes 2, steps skipped 1") != std::string::npos);
    CHECK(text.find("dp 31.5 s") != std::string::npos);
    CHECK(text.find("checkpoint 120.0 s") != std::string::npos);
  }
}

}  // namespace keel::daemon
