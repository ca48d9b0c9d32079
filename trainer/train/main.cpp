// keel-trainer: one rank of a training run (DESIGN §4). keeld starts it with
// the worker environment; without that environment it runs as a single rank,
// which is how developers and tests run it by hand.
#include "common/config.h"
#include "common/error.h"
#include "common/log.h"
#include "trainer/kernels/cpu_backend.h"
#include "trainer/parallel/mesh.h"
#include "trainer/train/train_loop.h"
#include "trainer/train/worker_env.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <iostream>

namespace {

std::atomic<bool> g_stop{false};

void request_stop(int) { g_stop.store(true); }

void print_summary(const keel::trainer::RunSummary& s, bool json) {
  if (json) {
    nlohmann::json out = {{"steps", s.steps_done},
                          {"stopped_early", s.stopped_early},
                          {"final_train_loss", s.final_train_loss},
                          {"tokens", s.tokens},
                          {"wall_s", s.wall_s},
                          {"tokens_per_s", s.tokens_per_s}};
    out["final_val_loss"] = s.final_val_loss ? nlohmann::json(*s.final_val_loss) : nlohmann::json(nullptr);
    std::cout << out.dump() << std::endl;
    return;
  }
  std::cout << fmt::format("\ntraining {} after {} steps\n", s.stopped_early ? "stopped" : "finished", s.steps_done)
            << fmt::format("  final train loss  {:.4f}\n", s.final_train_loss)
            << (s.final_val_loss ? fmt::format("  final val loss    {:.4f}\n", *s.final_val_loss)
                                 : std::string("  final val loss    - (no validation data)\n"))
            << fmt::format("  tokens            {}\n", s.tokens)
            << fmt::format("  wall time         {:.1f} s ({:.0f} tokens/s)\n", s.wall_s, s.tokens_per_s);
}

}  // namespace

int main(int argc, char** argv) {
  using keel::common::Error;
  using keel::common::ErrorCode;

  CLI::App app{"keel-trainer: one rank of a keel training run"};
  std::string config_path;
  std::vector<std::string> overrides;
  bool json = false;
  app.add_option("--config", config_path, "TOML run configuration")->required();
  app.add_option("--set", overrides, "override a config entry: --set section.key=value (repeatable)");
  app.add_flag("--json", json, "print the final summary as one JSON object on stdout");
  app.footer(
      "Environment (set by keeld; without it this is a single rank): KEEL_RANK, KEEL_WORLD_SIZE,\n"
      "KEEL_RUN_DIR (overrides job.run_dir). Logs go to stderr; SPDLOG_LEVEL sets their level.\n"
      "Exit codes: 0 finished, 2 bad config or usage, 3 data error, 10 collective hang, 11 SDC suspected,\n"
      "12 peer or transport failure, 13 checkpoint failure, 14 stopped on request (SIGTERM/SIGINT),\n"
      "70 internal error.");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? 0 : keel::common::exit_code(ErrorCode::kBadConfig);
  }

  try {
    const auto worker = keel::trainer::WorkerEnv::from_process();
    keel::common::init_logging(worker.rank);
    auto log = keel::common::logger("trainer");

    auto config = keel::common::Config::load(config_path, overrides);
    if (worker.run_dir) config.job.run_dir = *worker.run_dir;
    keel::trainer::validate_layout(config, worker.world_size);
    if (worker.world_size != 1) {
      throw Error(ErrorCode::kBadConfig,
                  fmt::format("this build trains a single rank, but KEEL_WORLD_SIZE={}: multi-rank layouts arrive "
                              "with the distributed core",
                              worker.world_size));
    }
    log->info("resolved config:\n{}", config.to_toml());

    std::signal(SIGINT, request_stop);
    std::signal(SIGTERM, request_stop);
    keel::trainer::CpuBackend backend(static_cast<int>(config.train.threads));
    log->info("backend {} with {} threads", backend.name(), backend.threads());
    keel::trainer::TrainLoop loop(config, backend);
    auto summary = loop.run(g_stop);
    print_summary(summary, json);
    return summary.stopped_early ? keel::common::exit_code(ErrorCode::kStoppedOnRequest) : 0;
  } catch (const Error& e) {
    std::cerr << "keel-trainer: " << keel::common::error_code_name(e.code()) << ": " << e.what() << std::endl;
    return keel::common::exit_code(e.code());
  } catch (const std::exception& e) {
    std::cerr << "keel-trainer: internal error: " << e.what() << std::endl;
    return keel::common::exit_code(ErrorCode::kInternal);
  }
}
