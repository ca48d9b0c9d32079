// A keeld job in a temporary directory, for tests that run the real daemon:
// a small DP2 x TP2 model on a pattern shard, checkpoints every 5 steps,
// the control socket beside the config. Every test drives keeld as an
// operator would: a process, its control socket, its run directory.
#pragma once

#include "checkpoint/paths.h"
#include "checkpoint/reader.h"
#include "daemon/protocol.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"
#include "tests/support/wait.h"
#include "tests/trainer/token_fixture.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace keel::test {

inline const char* kKeeldJobConfig = R"(
[job]
name = "keeld-test"
run_dir = "run"
[model]
seq_len = 32
n_layer = 2
n_head = 4
n_embd = 32
[data]
train = "train.bin"
[parallel]
dp = 2
tp = 2
zero = 1
timeout_s = 30
[train]
steps = 40
batch_size = 8
lr = 3e-3
warmup_steps = 2
val_every = 0
log_every = 10
[checkpoint]
every_steps = 5
keep = 2
[daemon]
socket = "keeld.sock"
metrics_port = 0
restart_backoff_s = 0.05
grace_s = 10
progress_every_s = 1
)";

// Every tensor of the checkpoint of `step` under `checkpoints`.
inline std::map<std::string, std::vector<float>> checkpoint_tensors(const std::filesystem::path& checkpoints,
                                                                   int64_t step) {
  checkpoint::CheckpointReader reader(checkpoint::step_dir(checkpoints, step));
  std::map<std::string, std::vector<float>> out;
  for (const auto& name : reader.tensors()) {
    const auto shape = reader.global_shape(name);
    const int64_t rows = shape.at(0);
    const int64_t cols = shape.size() > 1 ? shape.at(1) : 1;
    auto& values = out[name];
    values.resize(static_cast<size_t>(rows * cols));
    reader.read(name, 0, 0, rows, cols, values.data());
  }
  return out;
}

class KeeldJob {
 public:
  // `config`: the job's TOML; its paths are relative to the job's
  // directory, whose train.bin holds a pattern shard.
  explicit KeeldJob(const std::string& config = kKeeldJobConfig) {
    write_pattern_shard(dir_ / "train.bin", 30000);
    config_ = dir_.write("job.toml", config);
  }

  const std::filesystem::path& dir() const { return dir_.path(); }
  std::filesystem::path run_dir() const { return dir_ / "run"; }
  std::string socket() const { return (dir_ / "keeld.sock").string(); }

  // keeld on this job; --foreground unless `service`.
  std::unique_ptr<ChildProcess> start(const std::vector<std::string>& sets = {}, bool service = false,
                                      const std::map<std::string, std::string>& env = {}) const {
    std::vector<std::string> argv = {keel_binary("keeld").string(), "--config", config_.string()};
    if (!service) argv.push_back("--foreground");
    for (const auto& s : sets) {
      argv.push_back("--set");
      argv.push_back(s);
    }
    return std::make_unique<ChildProcess>(argv, env);
  }

  // Runs keeld to its end and requires exit `expected`.
  ProcessResult run(const std::vector<std::string>& sets = {}, int expected = 0) const {
    auto result = start(sets)->wait(300);
    INFO(result.output);
    REQUIRE(result.exit_code == expected);
    return result;
  }

  nlohmann::json ask(daemon::Command command) const {
    daemon::Request request;
    request.command = command;
    request.limit = 1000;
    return daemon::call_daemon(socket(), request, std::chrono::seconds(10));
  }

  // Polls keeld's status every `poll` until `done(status)`; fails after
  // `timeout_s`. Each poll costs keeld and this process some CPU, taken
  // from the ranks on a 2-core machine (polled every 10 ms, a DP2 rank
  // waited 14.5% of its step time for a CPU, health/straggler_monitor.h):
  // the states waited for last seconds, so 50 ms loses nothing.
  nlohmann::json wait_for(const std::function<bool(const nlohmann::json&)>& done, double timeout_s = 120,
                          std::chrono::milliseconds poll = std::chrono::milliseconds(50)) const {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    nlohmann::json last;
    while (std::chrono::steady_clock::now() < deadline) {
      try {
        last = ask(daemon::Command::kStatus);
        if (done(last)) return last;
      } catch (const daemon::DaemonUnreachable&) {
        // not up yet
      }
      std::this_thread::sleep_for(poll);
    }
    FAIL("keeld's status did not get there in time; last: " << last.dump());
    return last;
  }

  std::vector<nlohmann::json> events() const {
    std::vector<nlohmann::json> out;
    std::ifstream in(run_dir() / "events.jsonl");
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
    return out;
  }
  std::vector<nlohmann::json> events_of(const std::string& kind) const {
    std::vector<nlohmann::json> out;
    for (auto& e : events()) {
      if (e.at("kind") == kind) out.push_back(e);
    }
    return out;
  }

  // The loss of every step in metrics.jsonl, as printed (for bit-identity).
  std::vector<std::string> losses() const {
    std::vector<std::string> out;
    std::ifstream in(run_dir() / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line).at("loss").dump());
    return out;
  }

  // Every tensor of the checkpoint of `step` (model and optimizer state).
  std::map<std::string, std::vector<float>> checkpoint_tensors(int64_t step) const {
    return test::checkpoint_tensors(run_dir() / "checkpoints", step);
  }

 private:
  TempDir dir_;
  std::filesystem::path config_;
};

// The state letter of process `pid` in /proc ('R', 'S', 'T' for stopped,
// 'Z' for exited and not yet reaped, ...); 'X' when it is gone.
inline char process_state(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto name_end = stat.rfind(')');  // the command name may hold spaces and parentheses
  return name_end == std::string::npos || name_end + 2 >= stat.size() ? 'X' : stat[name_end + 2];
}

// Stops `pid` with SIGSTOP and waits until it is stopped. False when it had
// exited instead: a stopped process cannot exit by itself, so a check made
// on it afterwards still holds when the next signal lands.
inline bool freeze(pid_t pid) {
  if (::kill(pid, SIGSTOP) != 0) return false;
  char state = 'X';
  const bool settled = wait_until(
      [&] {
        state = process_state(pid);
        return state == 'T' || state == 't' || state == 'Z' || state == 'X';
      },
      30);
  return settled && (state == 'T' || state == 't');
}

// Whether `signo` is pending for process `pid` (sent to it and not yet
// delivered, as to a frozen process).
inline bool signal_pending(pid_t pid, int signo) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with("ShdPnd:")) return (std::stoull(line.substr(7), nullptr, 16) >> (signo - 1)) & 1;
  }
  return false;
}

// SIGKILLs a rank that is alive when the signal lands, chosen at random
// among those `status` shows running, and returns its rank; -1 when none
// is. Each candidate is frozen first, so that it cannot finish and exit
// between the choice and the kill; one that already had is passed over.
inline int kill_live_rank(const nlohmann::json& status, std::mt19937& rng) {
  std::vector<nlohmann::json> candidates;
  for (const auto& r : status.at("ranks")) {
    if (r.at("pid").get<pid_t>() > 0 && r.at("exit_code").is_null()) candidates.push_back(r);
  }
  std::shuffle(candidates.begin(), candidates.end(), rng);
  for (const auto& r : candidates) {
    const pid_t pid = r.at("pid").get<pid_t>();
    if (!freeze(pid)) continue;
    ::kill(pid, SIGKILL);
    return r.at("rank").get<int>();
  }
  return -1;
}

// Bit-identity of two checkpoints' tensors, naming the first that differs.
inline void require_identical(const std::map<std::string, std::vector<float>>& a,
                              const std::map<std::string, std::vector<float>>& b);

// A job that lost a rank to kill -9, resumed and finished: the job, keeld's
// status when the rank was chosen, and the rank.
struct KilledRun {
  std::unique_ptr<KeeldJob> job = std::make_unique<KeeldJob>();
  nlohmann::json status;
  int victim = -1;
};

// Runs a job with `sets` under keeld, kills a random live rank with
// SIGKILL once the job reaches `at_step`, and requires keeld to resume by
// itself and end with the checkpoint of step 40 equal to `expected`.
inline KilledRun check_resumes_after_kill(const std::vector<std::string>& sets, int64_t at_step, std::mt19937& rng,
                                          const std::map<std::string, std::vector<float>>& expected) {
  KilledRun run;
  const KeeldJob& job = *run.job;
  auto keeld = job.start(sets);
  run.status = job.wait_for([&](const nlohmann::json& s) {
    return s.at("state") == "running" && s.at("step").get<int64_t>() >= at_step;
  });
  run.victim = kill_live_rank(run.status, rng);
  INFO("killed rank " << run.victim);
  REQUIRE_MESSAGE(run.victim >= 0, "every rank had finished before one could be killed");
  const auto result = keeld->wait(300);
  INFO(result.output);
  REQUIRE(result.exit_code == 0);

  const auto failures = job.events_of("rank_failed");
  REQUIRE(failures.size() == 1);
  CHECK(failures[0].at("rank") == run.victim);
  CHECK(failures[0].at("cause").get<std::string>().find("SIGKILL") != std::string::npos);
  CHECK(job.events_of("generation_started").size() == 2);
  CHECK(job.events_of("job_finished").size() == 1);
  require_identical(job.checkpoint_tensors(40), expected);
  return run;
}

inline void require_identical(const std::map<std::string, std::vector<float>>& a,
                              const std::map<std::string, std::vector<float>>& b) {
  REQUIRE(a.size() == b.size());
  for (const auto& [name, values] : a) {
    INFO("tensor " << name);
    REQUIRE(b.count(name) == 1);
    REQUIRE(values.size() == b.at(name).size());
    CHECK(std::memcmp(values.data(), b.at(name).data(), values.size() * sizeof(float)) == 0);
  }
}

}  // namespace keel::test
