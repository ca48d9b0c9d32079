#include "daemon/job_views.h"

#include "common/clock.h"
#include "common/human_format.h"
#include "daemon/prometheus_text.h"

#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <fstream>

namespace keel::daemon {
namespace {

std::string rank_health(const RankReport& rank, const JobReport& report) {
  if (rank.exit_code) return *rank.exit_code == 0 ? "finished" : "exited";
  if (rank.pid <= 0) return "down";
  if (!rank.last) return "starting";
  return common::ns_to_seconds(report.now_ns - rank.last->update_ns) > report.stale_after_s ? "stale" : "ok";
}

const std::optional<health::BoardSnapshot>& head(const JobReport& report) {
  static const std::optional<health::BoardSnapshot> none;
  return report.ranks.empty() ? none : report.ranks.front().last;
}

// From the mean of the recent steps rank 0 ran in this generation.
std::optional<double> eta_s(const JobReport& report) {
  const auto& s = head(report);
  if (!s || s->steps_done <= s->first_step) return std::nullopt;
  const int64_t n = std::min<int64_t>(s->steps_done - s->first_step, static_cast<int64_t>(health::kRecentSteps));
  double ms = 0;
  int64_t timed = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (const auto* t = s->timing_of(s->steps_done - 1 - i)) {
      ms += t->total_ms;
      ++timed;
    }
  }
  if (timed == 0) return std::nullopt;
  return ms / static_cast<double>(timed) / 1e3 * static_cast<double>(s->total_steps - s->steps_done);
}

}  // namespace

nlohmann::json status_json(const JobReport& report) {
  const int64_t now_ns = report.now_ns;
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto& rank : report.ranks) {
    nlohmann::json r = {{"rank", rank.rank},
                        {"pid", rank.pid},
                        {"health", rank_health(rank, report)},
                        {"verdict", rank_condition_name(rank.verdict.condition)},
                        {"verdict_reason", rank.verdict.reason}};
    r["exit_code"] = rank.exit_code ? nlohmann::json(*rank.exit_code) : nlohmann::json(nullptr);
    if (rank.last) {
      const auto& s = *rank.last;
      r["step"] = s.steps_done;
      r["phase"] = health::phase_name(s.phase);
      r["step_ms"] = s.step_ms;
      r["board_age_s"] = common::ns_to_seconds(now_ns - s.update_ns);
      if (s.snapshot_step >= 0) {
        r["snapshot"] = {{"step", s.snapshot_step}, {"bytes", s.snapshot_bytes}, {"stall_s", s.snapshot_stall_s}};
      }
      if (const std::string core = health::board_text(s.blas_core); !core.empty()) {
        r["blas_core"] = core;
        r["blas_chosen_by"] = health::board_text(s.blas_chosen_by);
      }
      // The collective begun last, of whichever group.
      const health::GroupRecord* newest = nullptr;
      for (const auto& g : s.groups) {
        if (g.seq_begun >= 0 && (newest == nullptr || g.begin_ns > newest->begin_ns)) newest = &g;
      }
      if (newest != nullptr) {
        const auto& g = *newest;
        const bool in_flight = g.state == static_cast<uint32_t>(health::CollectiveState::kInFlight);
        const int64_t end = in_flight ? now_ns : g.done_ns;
        r["collective"] = {{"group", health::group_name(g)},
                           {"op", health::board_text(g.op)},
                           {"seq", g.seq_begun},
                           {"bytes", g.bytes},
                           {"state", health::collective_state_name(g.state)},
                           {"duration_s", common::ns_to_seconds(end - g.begin_ns)}};
      }
    }
    ranks.push_back(r);
  }
  const auto& s = head(report);
  const auto eta = eta_s(report);
  // What each axis moved a step: the most any of this node's ranks handed
  // to its group of that axis in its last step.
  nlohmann::json axis_bytes = nlohmann::json::object();
  for (const auto& rank : report.ranks) {
    if (!rank.last) continue;
    for (const auto& g : rank.last->groups) {
      if (g.name[0] == '\0' || g.step_bytes == 0) continue;
      const std::string axis = health::group_kind(health::group_name(g));
      axis_bytes[axis] = std::max(axis_bytes.value(axis, uint64_t{0}), g.step_bytes);
    }
  }
  nlohmann::json out = {{"ok", true},
                        {"job", report.job},
                        {"state", job_state_name(report.state)},
                        {"generation", report.generation},
                        {"restarts", report.restarts},
                        {"step", report.step},
                        {"total_steps", report.total_steps},
                        {"checkpoint_step", report.checkpoint_step},
                        {"run_dir", report.run_dir.string()},
                        {"checkpoint_dir", report.checkpoint_dir.string()},
                        {"keeld_pid", getpid()},
                        {"uptime_s", report.uptime_s},
                        {"ranks", ranks}};
  out["axis_bytes_per_step"] = axis_bytes;
  out["reason"] = report.reason;
  out["loss"] = s ? nlohmann::json(s->loss) : nlohmann::json(nullptr);
  out["tokens_per_s"] = s ? nlohmann::json(s->tokens_per_s) : nlohmann::json(nullptr);
  out["eta_s"] = eta ? nlohmann::json(*eta) : nlohmann::json(nullptr);
  for (auto [key, tally] : {std::pair{"loss_spikes", report.loss_spikes}, {"skipped_steps", report.skipped_steps}}) {
    out[key] = {{"count", tally.count}, {"last_step", tally.last_step}};
  }
  nlohmann::json snapshots = nlohmann::json::array();
  for (const SnapshotRow& row : report.snapshots) {
    snapshots.push_back({{"step", row.step}, {"ranks", row.ranks}, {"bytes", row.bytes}});
  }
  out["snapshots"] = snapshots;
  out["snapshot_copies"] = nullptr;
  if (const auto& b = report.buddy) {
    nlohmann::json held = nlohmann::json::array();
    for (const HeldCopy& h : b->held) held.push_back({{"rank", h.rank}, {"step", h.step}, {"bytes", h.bytes}});
    nlohmann::json sent = nlohmann::json::array();
    for (const SentCopy& c : b->sent) {
      sent.push_back({{"rank", c.rank}, {"step", c.step}, {"bytes", c.bytes}, {"seconds", c.seconds}, {"to", c.to}});
    }
    nlohmann::json failing;  // null: every copy step sent is held
    if (const auto& f = b->failing) failing = {{"step", f->step}, {"tries", f->tries}, {"why", f->why}};
    out["snapshot_copies"] = {{"held", held}, {"sent", sent}, {"failing", failing}};
  }
  out["cluster"] = nullptr;
  if (const auto& c = report.cluster) {
    nlohmann::json nodes = nlohmann::json::array();
    nlohmann::json members = nlohmann::json::array();
    for (const NodeReport& n : c->members) {
      nodes.push_back(n.name);
      members.push_back({{"node", n.name},
                         {"address", n.address},
                         {"first_rank", n.first_rank},
                         {"ranks", n.ranks},
                         {"health", n.health},
                         {"heard_s", n.heard_s ? nlohmann::json(*n.heard_s) : nlohmann::json(nullptr)}});
    }
    out["cluster"] = {{"node", c->node},   {"node_rank", c->node_rank},   {"nodes", nodes},
                      {"world", c->world}, {"first_rank", c->first_rank}, {"cross_node_axes", c->cross_node_axes}};
    out["cluster"]["members"] = members;
    out["cluster"]["etcd_unreachable_s"] =
        c->etcd_unreachable_s ? nlohmann::json(*c->etcd_unreachable_s) : nlohmann::json(nullptr);
  }
  return out;
}

std::string status_line(const JobReport& report) {
  std::string health = "ok";
  RankCondition worst = RankCondition::kHealthy;
  for (const auto& rank : report.ranks) {
    const std::string h = rank_health(rank, report);
    if (h == "stale" || h == "exited") health = h;
    if (rank.verdict.condition > worst) {
      worst = rank.verdict.condition;
      health = fmt::format("rank {} {}", rank.rank, rank_condition_name(worst));
    }
  }
  std::string line = fmt::format("{}: {} (generation {}) step {}/{}", report.job, job_state_name(report.state),
                                 report.generation, report.step, report.total_steps);
  if (const auto& s = head(report)) line += fmt::format(" loss {:.4f}", s->loss);
  line += " health " + (report.state == JobState::kFailed ? report.reason : health);
  if (report.cluster) {
    line += fmt::format(" node {}", report.cluster->node);
    // The ranks train on without etcd; what waits is the next rendezvous
    // and commit (docs/architecture.md "Multi-node on etcd").
    if (report.cluster->etcd_unreachable_s) {
      line += fmt::format(" degraded: etcd unreachable for {:.0f} s", *report.cluster->etcd_unreachable_s);
    }
  }
  return line;
}

std::string progress_line(const JobReport& report) {
  const auto& s = head(report);
  if (!s) return "";
  const auto eta = eta_s(report);
  return fmt::format("generation {} | step {}/{} | loss {:.4f} | {:.0f} tok/s | ETA {}", report.generation,
                     s->steps_done, s->total_steps, s->loss, s->tokens_per_s,
                     eta ? common::format_duration(*eta) : std::string("-"));
}

std::string metrics_text(const JobReport& report) {
  PrometheusText out;
  const auto& head_board = head(report);
  const PrometheusLabels job = {{"job", report.job}};
  out.gauge("keel_step", "Optimizer steps completed", static_cast<double>(report.step), job);
  out.gauge("keel_total_steps", "Steps the job trains", static_cast<double>(report.total_steps), job);
  out.gauge("keel_loss", "Training loss of the last step", head_board ? head_board->loss : std::nan(""), job);
  out.gauge("keel_tokens_per_second", "Tokens per second of the last step, whole job",
            head_board ? head_board->tokens_per_s : 0.0, job);
  out.gauge("keel_generation", "Current generation (bumped by every restart)", static_cast<double>(report.generation),
            job);
  out.counter("keel_restarts_total", "Generations restarted since keeld started", static_cast<double>(report.restarts),
              job);
  for (auto s : {JobState::kStarting, JobState::kRunning, JobState::kRestarting, JobState::kStopping,
                 JobState::kFinished, JobState::kFailed, JobState::kStopped}) {
    out.gauge("keel_job_state", "1 for the job's current state", s == report.state ? 1.0 : 0.0,
              {{"job", report.job}, {"state", job_state_name(s)}});
  }
  out.gauge("keel_checkpoint_step", "Step of the newest good checkpoint: the one the ranks resumed from, or newer",
            static_cast<double>(report.checkpoint_step), job);
  for (auto [kind, count] : {std::pair{"hang", report.detections.hang}, {"sdc", report.detections.sdc},
                             {"straggler", report.detections.straggler}}) {
    out.counter("keel_detections_total", "Findings of the detectors since keeld started, by kind",
                static_cast<double>(count), {{"job", report.job}, {"kind", kind}});
  }
  out.counter("keel_loss_spikes_total", "Steps of the run that a rerun found to spike alike (a record, no alarm)",
              static_cast<double>(report.loss_spikes.count), job);
  out.counter("keel_steps_skipped_total", "Steps of the run whose update was skipped (health.spike_policy = skip)",
              static_cast<double>(report.skipped_steps.count), job);
  for (const auto& rank : report.ranks) {
    if (!rank.last) continue;
    const auto& s = *rank.last;
    const PrometheusLabels labels = {{"job", report.job}, {"rank", std::to_string(rank.rank)}};
    out.gauge("keel_rank_step", "Steps this rank completed", static_cast<double>(s.steps_done), labels);
    out.gauge("keel_rank_step_seconds", "Duration of this rank's last step", s.step_ms / 1e3, labels);
    out.gauge("keel_rank_board_age_seconds", "Time since this rank last updated its progress board",
              common::ns_to_seconds(report.now_ns - s.update_ns), labels);
    out.gauge("keel_rank_checkpoint_bytes", "Bytes this rank wrote for its newest checkpoint",
              static_cast<double>(s.checkpoint_bytes), labels);
    out.gauge("keel_rank_checkpoint_write_seconds", "Write time of this rank's newest checkpoint file",
              s.checkpoint_write_s, labels);
    if (s.snapshot_step >= 0) {
      out.gauge("keel_snapshot_bytes", "Bytes of this rank's newest in-memory snapshot",
                static_cast<double>(s.snapshot_bytes), labels);
      out.gauge("keel_snapshot_stall_seconds", "How long training waited for this rank's newest in-memory snapshot",
                s.snapshot_stall_s, labels);
      for (const SentCopy& sent : report.buddy ? report.buddy->sent : std::vector<SentCopy>{}) {
        if (sent.rank != rank.rank) continue;
        // The board was read up to a poll ago, the copy's answer just now.
        out.gauge("keel_snapshot_copy_lag_steps",
                  "Steps by which the next node's copy of this rank's snapshot trails its newest snapshot",
                  static_cast<double>(std::max<int64_t>(0, s.snapshot_step - sent.step)), labels);
        out.gauge("keel_snapshot_copy_seconds", "How long this rank's last snapshot copy took to reach the next node",
                  sent.seconds, labels);
      }
    }
    out.gauge("keel_rank_straggler_score",
              "This rank's newest straggler score: its compute over the median rank's, minus 1", rank.straggler_score,
              labels);
  }
  return out.str();
}

nlohmann::json newest_events(const std::filesystem::path& run_dir, int64_t limit) {
  std::ifstream in(run_dir / "events.jsonl");
  std::deque<nlohmann::json> newest;
  std::string line;
  while (std::getline(in, line)) {
    auto event = nlohmann::json::parse(line, nullptr, false);
    if (event.is_discarded()) continue;
    newest.push_back(std::move(event));
    if (static_cast<int64_t>(newest.size()) > limit) newest.pop_front();
  }
  return {{"ok", true}, {"events", nlohmann::json(std::vector<nlohmann::json>(newest.begin(), newest.end()))}};
}

}  // namespace keel::daemon
