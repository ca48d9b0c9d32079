// keel-bench-keeld: what keeld costs and how fast it brings a run back.
// (1) Tokens/s of 4 ranks (DP2 x TP2, ZeRO-1) under keeld against the same 4
// ranks started by the test launcher, side by side on this machine (target
// ratio >= 0.99); keeld's peak RSS and CPU time over the keeld run.
// (2) Restart time: from kill -9 of a rank to the first step completed by
// the next generation, with the back-off set to 0, over several kills,
// restoring from in-memory snapshots and from disk, on the quickstart's
// model (4 ranks) and on one rank holding 1.1 GB of training state; with
// the work lost and the snapshots' stall as a share of the step time.
// Prints one JSON object per result.
#include "bench/blas_ceiling.h"
#include "bench/bench_model.h"
#include "bench/metrics_rows.h"
#include "daemon/protocol.h"
#include "tests/support/process.h"
#include "tests/support/rank_launcher.h"
#include "tests/support/temp_dir.h"
#include "tests/trainer/token_fixture.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <atomic>
#include <chrono>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;

// The benchmark model under keeld, as DP2 x TP2 ZeRO-1.
// keeld's control socket beside the config, no metrics page.
const std::string kDaemon = R"(
[daemon]
socket = "keeld.sock"
metrics_port = -1
)";

const std::string kConfig = std::string(keel::bench::kBenchModel) + R"(
[job]
name = "bench-keeld"
[parallel]
dp = 2
tp = 2
zero = 1
)" + kDaemon;

// VmHWM (peak resident set, KiB) and utime + stime (s) of a live process.
struct Usage {
  long peak_rss_kib = 0;
  double cpu_s = 0;
};
Usage usage_of(pid_t pid) {
  Usage u;
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.starts_with("VmHWM:")) u.peak_rss_kib = std::stol(line.substr(6));
  }
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto close_paren = text.rfind(')');
  if (close_paren == std::string::npos) return u;
  std::istringstream fields(text.substr(close_paren + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; fields >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::stod(field);
    if (i == 15) break;
  }
  u.cpu_s = ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
  return u;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

std::vector<std::string> with_sets(std::vector<std::string> argv, const std::vector<std::string>& sets) {
  for (const auto& s : sets) argv.insert(argv.end(), {"--set", s});
  return argv;
}

nlohmann::json status(const std::string& socket) {
  keel::daemon::Request request;
  return keel::daemon::call_daemon(socket, request, std::chrono::seconds(10));
}

// The quickstart job's model (configs/quickstart.toml) on the pattern
// shard, as DP2 x TP2 ZeRO-1.
const std::string kQuickstartModel = R"(
[model]
vocab_size = 256
seq_len = 128
n_layer = 4
n_head = 4
n_embd = 128
[data]
train = "train.bin"
[parallel]
dp = 2
tp = 2
zero = 1
[train]
batch_size = 16
lr = 2e-3
warmup_steps = 1
val_every = 0
)" + kDaemon;

// One rank holding 1.1 GB of training state: 92M parameters, their two
// AdamW moments, float32 (12 bytes each), in a short sequence so that a
// step takes about half a second on two cores.
const std::string kLargeModel = R"(
[model]
vocab_size = 256
seq_len = 64
n_layer = 13
n_head = 12
n_embd = 768
[data]
train = "train.bin"
[parallel]
dp = 1
tp = 1
[train]
batch_size = 1
lr = 6e-4
warmup_steps = 1
val_every = 0
)" + kDaemon;

struct RestartCase {
  std::string name;
  std::string config;
  int64_t checkpoint_every = 10;  // steps; each kill lands halfway between two saves
  int kills = 3;
};

// Polls keeld's status at `socket` every 2 ms until `done`; throws after
// five minutes.
nlohmann::json wait_for(const std::string& socket, const std::function<bool(const nlohmann::json&)>& done) {
  const auto deadline = Clock::now() + std::chrono::minutes(5);
  while (Clock::now() < deadline) {
    try {
      const auto s = status(socket);
      if (done(s)) return s;
    } catch (const keel::daemon::DaemonUnreachable&) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  throw std::runtime_error("keeld did not get there in five minutes");
}

// rank 0's state_restored record of `generation` in `run_dir`, if written.
std::optional<nlohmann::json> restored_in(const std::filesystem::path& run_dir, int64_t generation) {
  std::ifstream in(run_dir / "events.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto e = nlohmann::json::parse(line, nullptr, false);
    if (e.is_object() && e.value("kind", "") == "state_restored" && e.value("generation", -1) == generation) return e;
  }
  return std::nullopt;
}

// The step of generation `generation`'s rank_failed record in `run_dir`.
int64_t rank_failed_step(const std::filesystem::path& run_dir, int64_t generation) {
  std::ifstream in(run_dir / "events.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto e = nlohmann::json::parse(line, nullptr, false);
    if (e.is_object() && e.value("kind", "") == "rank_failed" && e.value("generation", -1) == generation) {
      return e.at("step").get<int64_t>();
    }
  }
  throw std::runtime_error("no rank_failed event of generation " + std::to_string(generation));
}

// keeld runs `c` as a service with no back-off; `c.kills` times the last
// rank is killed with SIGKILL halfway between two checkpoints, and the
// time to the first step the next generation completes is taken, with
// where it restored from, how long that took (state_restored) and the
// steps lost. "memory": snapshots at their default interval; "disk": off.
nlohmann::json time_restarts(const RestartCase& c, const std::string& source, const std::filesystem::path& config,
                             const std::filesystem::path& run_dir, const std::map<std::string, std::string>& env) {
  const std::string socket = (run_dir.parent_path() / "keeld.sock").string();
  std::vector<std::string> sets = {"job.run_dir=" + run_dir.string(), "train.steps=1000000",
                                   "checkpoint.every_steps=" + std::to_string(c.checkpoint_every),
                                   "daemon.restart_backoff_s=0"};
  if (source == "disk") sets.push_back("checkpoint.memory_every_steps=0");
  keel::test::ChildProcess service(
      with_sets({keel::test::keel_binary("keeld").string(), "--config", config.string()}, sets), env);
  std::vector<double> restart_s, restore_s, lost, stall_share, intervals, step_s;
  std::vector<std::string> restored_from;
  uint64_t state_bytes = 0;
  bool caches_dropped = true;
  for (int k = 0; k < c.kills; ++k) {
    // Halfway between two saves, after a first one, with the snapshots'
    // stall and interval sampled on the way.
    int64_t last_snapshot = -1;
    const auto before = wait_for(socket, [&](const nlohmann::json& s) {
      if (s.at("state") != "running" || s.at("generation") != k) return false;
      const auto& head = s.at("ranks").at(0);
      if (head.value("step_ms", 0.0) > 0) step_s.push_back(head.at("step_ms").get<double>() / 1e3);
      if (head.contains("snapshot")) {
        const auto& snap = head.at("snapshot");
        const int64_t step = snap.at("step");
        if (last_snapshot >= 0 && step > last_snapshot && head.at("step_ms").get<double>() > 0) {
          intervals.push_back(static_cast<double>(step - last_snapshot));
          stall_share.push_back(snap.at("stall_s").get<double>() /
                                (static_cast<double>(step - last_snapshot) * head.at("step_ms").get<double>() / 1e3));
        }
        last_snapshot = step;
        state_bytes = 0;
        for (const auto& r : s.at("ranks")) {
          if (r.contains("snapshot")) state_bytes += r.at("snapshot").at("bytes").get<uint64_t>();
        }
      }
      const int64_t step = head.value("step", int64_t{0});
      return s.at("checkpoint_step").get<int64_t>() > 0 && step % c.checkpoint_every == c.checkpoint_every / 2 &&
             (source == "disk" || last_snapshot > 0);
    });
    // As keel-bench-checkpoint's loads: nothing of the checkpoint in the
    // page cache (root only; the snapshots are shared memory, never
    // dropped).
    ::sync();
    std::ofstream drop("/proc/sys/vm/drop_caches");
    drop << "3\n" << std::flush;
    caches_dropped = caches_dropped && static_cast<bool>(drop);
    const auto killed_at = Clock::now();
    ::kill(before.at("ranks").back().at("pid").get<pid_t>(), SIGKILL);
    std::optional<nlohmann::json> restored;
    wait_for(socket, [&](const nlohmann::json& s) {
      if (s.at("generation") != k + 1 || s.at("state") != "running") return false;
      if (!restored) restored = restored_in(run_dir, k + 1);
      return restored && s.at("step").get<int64_t>() > restored->at("step").get<int64_t>();
    });
    restart_s.push_back(std::chrono::duration<double>(Clock::now() - killed_at).count());
    restore_s.push_back(restored->at("seconds").get<double>());
    restored_from.push_back(restored->at("from"));
    // The step the killed rank had finished (its board's last word), not
    // the one sampled before the kill: the ranks went on meanwhile.
    lost.push_back(static_cast<double>(rank_failed_step(run_dir, k) - restored->at("step").get<int64_t>()));
  }
  service.signal(SIGTERM);
  service.wait(600);
  nlohmann::json out = {{"bench", "keeld_restart"},
                        {"model", c.name},
                        {"source", source},
                        {"restart_backoff_s", 0},
                        {"checkpoint_every_steps", c.checkpoint_every},
                        {"restart_s", restart_s},
                        {"median_restart_s", median(restart_s)},
                        {"restore_s", restore_s},
                        {"median_restore_s", median(restore_s)},
                        {"restored_from", restored_from},
                        {"median_step_s", median(step_s)},
                        {"page_cache_dropped_before_each_kill", caches_dropped},
                        {"lost_steps", lost},
                        {"median_lost_steps", median(lost)},
                        {"measures", "kill -9 of the last rank halfway between two checkpoints to the first step "
                                     "completed by the next generation; restore_s: rank 0's state_restored seconds"}};
  if (source == "memory") {
    out["state_bytes"] = state_bytes;
    out["snapshot_every_steps"] = intervals.empty() ? nlohmann::json(nullptr) : nlohmann::json(median(intervals));
    out["snapshot_stall_share"] = stall_share.empty() ? nlohmann::json(nullptr) : nlohmann::json(median(stall_share));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"keel-bench-keeld: keeld's overhead against the test launcher, and its restart time"};
  int steps = 20, warmup = 2, rounds = 3;
  app.add_option("--steps", steps, "steps per throughput run");
  app.add_option("--warmup", warmup, "first steps left out of the timing");
  int small_kills = 3, large_kills = 3;
  app.add_option("--kills", small_kills, "restarts to time on the quickstart model, from memory and from disk");
  app.add_option("--large-kills", large_kills, "restarts to time on the 1.1 GB model (0: skip it)");
  app.add_option("--rounds", rounds, "launcher and keeld runs, alternating; medians are reported")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  if (steps <= warmup) {
    std::cerr << "keel-bench-keeld: --steps must exceed --warmup\n";
    return 2;
  }
  keel::test::TempDir dir;
  keel::test::write_pattern_shard(dir / "train.bin", 1 << 20);
  const auto config = dir.write("bench.toml", kConfig);
  const auto trainer = keel::test::keel_binary("keel-trainer").string();
  const auto keeld = keel::test::keel_binary("keeld").string();
  const std::map<std::string, std::string> quiet = {{"SPDLOG_LEVEL", "warn"}};
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const std::string threads = std::to_string(std::max(1u, cores / 4));

  // (1) The same job, started by the test launcher and by keeld, in
  // alternating rounds so that drift of the machine hits both alike.
  std::vector<double> launcher_runs, keeld_runs;
  Usage usage;
  double keeld_wall_s = 0;
  for (int round = 0; round < rounds; ++round) {
    const std::string suffix = std::to_string(round);
    auto run_launcher = [&]() -> bool {
      keel::test::RankLauncher ranks(
          4, with_sets({trainer, "--config", config.string()},
                       {"job.run_dir=" + (dir / ("launcher" + suffix)).string(),
                        "train.steps=" + std::to_string(steps), "train.threads=" + threads}),
          quiet);
      for (const auto& r : ranks.wait_all()) {
        if (r.exit_code != 0) {
          std::cerr << "keel-bench-keeld: a launcher rank exited " << r.exit_code << ":\n" << r.output;
          return false;
        }
      }
      return true;
    };
    auto run_keeld = [&]() -> bool {
      keel::test::ChildProcess daemon(
          with_sets({keeld, "--config", config.string(), "--foreground"},
                    {"job.run_dir=" + (dir / ("keeld" + suffix)).string(), "train.steps=" + std::to_string(steps)}),
          quiet);
      std::atomic<bool> running{true};
      std::thread sampler([&] {
        while (running.load()) {
          const Usage now = usage_of(daemon.pid());
          if (now.peak_rss_kib > 0) usage = now;
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
      });
      const auto start = Clock::now();
      const auto result = daemon.wait(1800);
      keeld_wall_s = std::chrono::duration<double>(Clock::now() - start).count();
      running = false;
      sampler.join();
      if (result.exit_code != 0) {
        std::cerr << "keel-bench-keeld: keeld exited " << result.exit_code << ":\n" << result.output;
        return false;
      }
      return true;
    };
    // Odd rounds run keeld first, so neither side always follows the other.
    const bool ok = round % 2 == 0 ? run_launcher() && run_keeld() : run_keeld() && run_launcher();
    if (!ok) return 1;
    launcher_runs.push_back(
        keel::bench::tokens_per_s(keel::bench::timed_rows(dir / ("launcher" + suffix) / "metrics.jsonl", warmup), 8.0 * 256));
    keeld_runs.push_back(
        keel::bench::tokens_per_s(keel::bench::timed_rows(dir / ("keeld" + suffix) / "metrics.jsonl", warmup), 8.0 * 256));
  }
  const double launcher = median(launcher_runs), under_keeld = median(keeld_runs);
  const nlohmann::json machine = {{"cores", cores}};
  std::cout << nlohmann::json{{"bench", "keeld_overhead"},
                              {"layout", "dp2_tp2_zero1"},
                              {"steps_timed", steps - warmup},
                              {"rounds", rounds},
                              {"launcher_tokens_per_s", launcher_runs},
                              {"keeld_tokens_per_s", keeld_runs},
                              {"median_launcher_tokens_per_s", launcher},
                              {"median_keeld_tokens_per_s", under_keeld},
                              {"ratio_keeld_over_launcher", under_keeld / launcher},
                              {"target_ratio", 0.99},
                              {"keeld_peak_rss_mib", static_cast<double>(usage.peak_rss_kib) / 1024.0},
                              {"keeld_cpu_s", usage.cpu_s},
                              {"keeld_cpu_percent_of_one_core", 100.0 * usage.cpu_s / keeld_wall_s},
                              {"keeld_wall_s", keeld_wall_s},
                              {"blas", keel::bench::blas_ceiling(std::stoi(threads))},
                              {"machine", machine}}
                   .dump()
            << std::endl;

  // (2) Restart time, from memory and from disk, on the quickstart's model
  // and on one with over 1 GB of training state.
  const std::vector<RestartCase> cases = {
      {"quickstart", kQuickstartModel, 20, small_kills},
      {"1.1GB", kLargeModel, 40, large_kills},
  };
  nlohmann::json summary = {{"bench", "keeld_restart_summary"}, {"machine", machine}};
  for (const RestartCase& c : cases) {
    if (c.kills == 0) continue;
    const auto case_config = dir.write("restart-" + c.name + ".toml", c.config);
    nlohmann::json by_source;
    for (const std::string source : {"memory", "disk"}) {
      const auto figures = time_restarts(c, source, case_config, dir / ("restart-" + c.name + "-" + source), quiet);
      std::cout << figures.dump() << std::endl;
      by_source[source] = figures;
    }
    summary[c.name] = {
        {"state_bytes", by_source["memory"]["state_bytes"]},
        {"median_restart_s", {{"memory", by_source["memory"]["median_restart_s"]},
                              {"disk", by_source["disk"]["median_restart_s"]}}},
        {"median_restore_s", {{"memory", by_source["memory"]["median_restore_s"]},
                              {"disk", by_source["disk"]["median_restore_s"]}}},
        {"restore_speedup", by_source["disk"]["median_restore_s"].get<double>() /
                                by_source["memory"]["median_restore_s"].get<double>()},
        {"restart_speedup", by_source["disk"]["median_restart_s"].get<double>() /
                                by_source["memory"]["median_restart_s"].get<double>()},
        {"median_lost_steps", {{"memory", by_source["memory"]["median_lost_steps"]},
                               {"disk", by_source["disk"]["median_lost_steps"]}}},
        {"snapshot_stall_share", by_source["memory"]["snapshot_stall_share"]},
        {"snapshot_every_steps", by_source["memory"]["snapshot_every_steps"]},
        {"step_s", by_source["memory"]["median_step_s"]}};
  }
  summary["targets"] = {{"restore_speedup_at_1GB", 3.0}, {"snapshot_stall_share", 0.02}};
  std::cout << summary.dump() << std::endl;
  return 0;
}
