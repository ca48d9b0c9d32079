// keel-bench-keeld: what keeld costs and how fast it brings a run back.
// (1) Tokens/s of 4 ranks (DP2 x TP2, ZeRO-1) under keeld against the same 4
// ranks started by the test launcher, side by side on this machine (target
// ratio >= 0.99); keeld's peak RSS and CPU time over the keeld run.
// (2) Restart time: from kill -9 of a rank to the first step completed by
// the next generation, with the back-off set to 0, over several kills.
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
#include <atomic>
#include <chrono>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;

// The benchmark model under keeld, as DP2 x TP2 ZeRO-1.
const std::string kConfig = std::string(keel::bench::kBenchModel) + R"(
[job]
name = "bench-keeld"
[parallel]
dp = 2
tp = 2
zero = 1
[daemon]
socket = "keeld.sock"
metrics_port = -1
)";

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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"keel-bench-keeld: keeld's overhead against the test launcher, and its restart time"};
  int steps = 20, warmup = 2, kills = 3, rounds = 3;
  app.add_option("--steps", steps, "steps per throughput run");
  app.add_option("--warmup", warmup, "first steps left out of the timing");
  app.add_option("--kills", kills, "restarts to time");
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

  // (2) Restart time: kill -9 a rank, time until the next generation completes a step.
  const std::string socket = (dir / "keeld.sock").string();
  keel::test::ChildProcess service(
      with_sets({keeld, "--config", config.string()},
                {"job.run_dir=" + (dir / "restart").string(), "train.steps=100000", "checkpoint.every_steps=2",
                 "daemon.restart_backoff_s=0"}),
      quiet);
  auto wait_for = [&](const std::function<bool(const nlohmann::json&)>& done) {
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
  };
  std::vector<double> restart_s;
  for (int k = 0; k < kills; ++k) {
    const auto before = wait_for([&](const nlohmann::json& s) {
      return s.at("state") == "running" && s.at("generation") == k && s.at("checkpoint_step").get<int64_t>() >= 0 &&
             s.at("step").get<int64_t>() > s.at("checkpoint_step").get<int64_t>();
    });
    const auto killed_at = Clock::now();
    ::kill(before.at("ranks").at(1).at("pid").get<pid_t>(), SIGKILL);
    // The new generation's first step: its board moves past the checkpoint it resumed from.
    int64_t resumed_from = -1;
    wait_for([&](const nlohmann::json& s) {
      if (s.at("generation") != k + 1 || s.at("state") != "running") return false;
      if (resumed_from < 0) resumed_from = s.at("checkpoint_step");
      return s.at("step").get<int64_t>() > resumed_from;
    });
    restart_s.push_back(std::chrono::duration<double>(Clock::now() - killed_at).count());
  }
  service.signal(SIGTERM);
  service.wait(600);
  std::cout << nlohmann::json{{"bench", "keeld_restart"},
                              {"layout", "dp2_tp2_zero1"},
                              {"restart_backoff_s", 0},
                              {"restart_s", restart_s},
                              {"median_restart_s", median(restart_s)},
                              {"measures", "kill -9 of rank 1 to the first step completed by the next generation"},
                              {"machine", machine}}
                   .dump()
            << std::endl;
  return 0;
}
