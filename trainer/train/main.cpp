// keel-trainer: one rank of a training run (docs/architecture.md "Worker contract"). keeld starts it with
// the worker environment; without that environment it runs as a single rank,
// which is how developers and tests run it by hand.
#include "common/config.h"
#include "common/error.h"
#include "common/layout_check.h"
#include "common/log.h"
#include "store/tcp_store.h"
#include "health/fault_injector.h"
#include "interop/hf_export.h"
#include "trainer/parallel/mesh.h"
#include "trainer/parallel/process_groups.h"
#include "trainer/train/blas_core_start.h"
#include "trainer/train/devices.h"
#include "trainer/train/memory_plan.h"
#include "trainer/train/train_loop.h"
#include "trainer/train/worker_env.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <csignal>
#include <iostream>
#include <optional>
#include <string>

namespace {

std::atomic<bool> g_stop{false};

void request_stop(int) { g_stop.store(true); }

void dump_flight_recorder(const keel::trainer::FlightRecorder& recorder, const std::filesystem::path& path) {
  if (path.empty() || recorder.snapshot().empty()) return;
  try {
    std::filesystem::create_directories(path.parent_path());
    recorder.dump(path);
    std::cerr << "keel-trainer: flight recorder written to " << path.string() << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "keel-trainer: could not write the flight recorder to " << path.string() << ": " << e.what()
              << std::endl;
  }
}

void print_summary(const keel::trainer::RunSummary& s, const std::optional<keel::trainer::BlasCore>& blas, bool json) {
  if (json) {
    nlohmann::json out = {{"steps", s.steps_done},
                          {"stopped_early", s.stopped_early},
                          {"final_train_loss", s.final_train_loss},
                          {"tokens", s.tokens},
                          {"wall_s", s.wall_s},
                          {"tokens_per_s", s.tokens_per_s},
                          {"first_step", s.first_step},
                          {"parameter_digest", s.parameter_digest},
                          {"schedules",
                           {{"compute_s", s.schedules.compute_s},
                            {"total_s", s.schedules.total_s},
                            {"peak_alive", s.schedules.peak_alive}}},
                          {"memory",
                           {{"params_bytes", s.memory.params},
                            {"gemm_copy_bytes", s.memory.gemm_copy},
                            {"grads_bytes", s.memory.grads},
                            {"optimizer_bytes", s.memory.optimizer},
                            {"total_bytes", s.memory.total},
                            {"backend_scratch_bytes", s.memory.backend_scratch}}}};
    out["final_val_loss"] = s.final_val_loss ? nlohmann::json(*s.final_val_loss) : nlohmann::json(nullptr);
    out["blas"] = blas ? blas->to_json() : nlohmann::json(nullptr);
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

// Ranks rendezvous through the Store; groups are named by generation so a
// restarted generation never reads the addresses of the one before.
std::unique_ptr<keel::trainer::ProcessGroups> join_groups(const keel::trainer::WorkerEnv& worker,
                                                          const keel::common::ParallelConfig& parallel,
                                                          std::chrono::milliseconds timeout,
                                                          keel::trainer::Backend& backend, keel::store::Store& store,
                                                          keel::health::BoardPublisher* board,
                                                          const std::shared_ptr<keel::trainer::FlightRecorder>& recorder) {
  auto log = keel::common::logger("trainer");
  keel::trainer::Mesh mesh(keel::trainer::Layout::from(parallel), worker.rank);
  auto groups = std::make_unique<keel::trainer::ProcessGroups>(mesh, [&](const keel::trainer::Group& group) {
    log->info("joining {} as rank {} of {}", group.name, group.index_in_group, group.ranks.size());
    return keel::trainer::join_group(backend, store, fmt::format("g{}.{}", worker.generation, group.name),
                                     group.index_in_group, static_cast<int>(group.ranks.size()), timeout, recorder,
                                     keel::store::rank_failed_key(worker.generation), worker.bind_address);
  });
  for (const auto& group : groups->communicators()) {
    if (board != nullptr) group.comm->set_progress_board(board);
    group.comm->set_compute_stream(&backend.compute_stream());
  }
  groups->on_peer_failure();
  return groups;
}

// What the command line asks for.
struct Command {
  std::string config_path;
  std::vector<std::string> overrides;
  bool json = false;
  bool blas_report = false;
  bool plan = false;
  std::string gradient_dump, init_from, eval_dir, eval_data, export_out, export_dtype = "fp32";
  int64_t stop_after = -1, eval_sequences = -1;
};

// Fills `command` from argv; an exit code when the program ends here
// (--help, a usage error).
std::optional<int> parse_command(int argc, char** argv, Command& command) {
  CLI::App app{"keel-trainer: one rank of a keel training run"};
  app.add_option("--config", command.config_path, "TOML run configuration")->required();
  app.add_option("--set", command.overrides, "override a config entry: --set section.key=value (repeatable)");
  app.add_flag("--json", command.json, "print the final summary as one JSON object on stdout");
  app.add_option("--init-from", command.init_from,
                 "when the run has no checkpoint that loads, start from this checkpoint directory (any layout), from "
                 "a Hugging Face model's weights at step 0 with hf:DIR, or from step 0 with 'none' (the same as --set "
                 "checkpoint.init_from=...)");
  app.add_option("--stop-after", command.stop_after,
                 "stop after this many steps as a stop request would: final checkpoint, then exit 14");
  auto* eval = app.add_option("--eval", command.eval_dir,
                               "evaluate this checkpoint (any layout) instead of training and print one JSON "
                               "object: step, loss, sequences, tokens");
  app.add_option("--eval-data", command.eval_data, "token file for --eval (llm.c shard format)")->needs(eval);
  app.add_option("--eval-sequences", command.eval_sequences,
                 "windows of seq_len + 1 tokens from the start of --eval-data (default: all)")
      ->needs(eval);
  app.add_option("--dump-gradients", command.gradient_dump,
                 "write the summed gradients of the first step to DIR, each rank its own part (for layout checks)");
  auto* exported = app.add_option("--export-hf", command.export_out,
                                  "write the run's newest committed checkpoint as a Hugging Face model directory "
                                  "(config.json and safetensors) at this new path, print one JSON object and exit, as "
                                  "keelctl export does");
  app.add_option("--export-dtype", command.export_dtype, "the exported weights' type: fp32 (exact) or bf16")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->needs(exported);
  app.add_flag("--plan", command.plan,
               "print what the run needs without allocating it: parameters, FLOPs a token, and each rank's memory "
               "for weights, gradients, optimizer state and activations at the configured batch and layout "
               "(--json: one JSON object), then exit");
  app.add_flag("--blas-report", command.blas_report,
               "settle and prove the BLAS core as training would (train.blas_core), measure the CPU backend's "
               "sgemm on it and print one JSON object instead of training: what benches report");
  app.footer(
      "Environment (set by keeld; without it this is a single rank): KEEL_RANK, KEEL_WORLD_SIZE,\n"
      "KEEL_RUN_DIR (overrides job.run_dir), KEEL_BOARD (progress board), KEEL_GENERATION, KEEL_STORE,\n"
      "KEEL_STORE_SECRET. OPENBLAS_CORETYPE, when set, is respected over train.blas_core.\n"
      "Logs go to stderr; SPDLOG_LEVEL sets their level.\n"
      "Exit codes: 0 finished, 2 bad config or usage, 3 data error, 10 collective hang, 11 SDC suspected,\n"
      "12 peer or transport failure, 13 checkpoint failure, 14 stopped on request (SIGTERM/SIGINT),\n"
      "70 internal error.");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? 0 : keel::common::exit_code(keel::common::ErrorCode::kBadConfig);
  }
  if (!command.init_from.empty()) command.overrides.push_back("checkpoint.init_from=" + command.init_from);
  return std::nullopt;
}

int main(int argc, char** argv) {
  using keel::common::Error;
  using keel::common::ErrorCode;

  Command command;
  if (auto code = parse_command(argc, argv, command)) return *code;

  // The last collectives of this rank, dumped to run_dir/flight/ on any
  // error so keeld (and an operator) can see where it stopped.
  auto recorder = std::make_shared<keel::trainer::FlightRecorder>();
  std::filesystem::path flight_path;
  // Declared out here so that a failing rank can tell every group it
  // belongs to before it exits; the Store outlives the communicators.
  std::unique_ptr<keel::store::Store> store;
  // keeld reads this rank's progress from its board (a rank run by hand has
  // none); the communicators report to it, so it outlives them.
  std::optional<keel::health::BoardPublisher> board;
  // The communicators wait on the backend's compute stream, so it
  // outlives them.
  std::unique_ptr<keel::trainer::Backend> backend;
  std::unique_ptr<keel::trainer::ProcessGroups> groups = std::make_unique<keel::trainer::ProcessGroups>();
  try {
    const auto worker = keel::trainer::WorkerEnv::from_process();
    keel::common::init_logging(worker.rank);
    auto log = keel::common::logger("trainer");

    auto config = keel::common::Config::load(command.config_path, command.overrides);
    if (!command.export_out.empty()) {
      const auto report = keel::interop::export_hf(
          {config.checkpoint_dir(), command.export_out,
           command.export_dtype == "bf16" ? keel::interop::TensorDtype::kBF16 : keel::interop::TensorDtype::kF32});
      fmt::print("{}\n", report.to_json().dump());
      return 0;
    }
    if (command.plan) {
      const keel::trainer::RunPlan plan = keel::trainer::plan_run(config);
      fmt::print("{}", command.json ? keel::trainer::to_json(plan).dump() + "\n" : keel::trainer::to_text(plan, config));
      return 0;
    }
    if (worker.run_dir) config.job.run_dir = *worker.run_dir;
    // keeld runs the same check before it starts any rank.
    keel::common::validate_layout(config, worker.world_size);
    const auto& parallel = config.parallel;
    // Before anything else runs: this may execute the program again.
    std::optional<keel::trainer::BlasCore> blas;
    if (config.train.device == "cpu") blas = keel::trainer::settle_blas_core(config.train.blas_core, argv);
    flight_path = std::filesystem::path(config.job.run_dir) / "flight" / fmt::format("rank-{:05d}.json", worker.rank);
    log->info("resolved config:\n{}", config.to_toml());

    std::signal(SIGINT, request_stop);
    std::signal(SIGTERM, request_stop);
    // A full file-size limit is a failed write (EFBIG) to handle, not a
    // reason to die.
    std::signal(SIGXFSZ, SIG_IGN);
    if (!worker.board.empty()) {
      board.emplace(keel::health::ProgressBoard::open(worker.board), worker.rank, worker.generation);
      board->time_stalls(config.train.device == "cpu");
    }
    backend = keel::trainer::make_backend(config.train);
    log->info("backend {}", backend->name());
    if (blas && blas->keel_chose()) {
      const bool broken = keel::health::FaultInjector(config, worker.rank, worker.generation).breaks_blas_core();
      keel::trainer::prove_blas_core(*blas, *backend, broken, argv);
    }
    if (blas && board) board->set_blas_core(blas->core, blas->chosen_by);
    if (command.blas_report) {
      if (worker.rank == 0) std::cout << keel::trainer::blas_report(blas, *backend).dump() << std::endl;
      return 0;
    }
    if (worker.world_size > 1) {
      const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(parallel.timeout_s * 1000));
      store = keel::store::connect_store(worker.store, worker.store_secret, timeout);
      groups = join_groups(worker, parallel, timeout, *backend, *store, board ? &*board : nullptr, recorder);
    }
    keel::trainer::TrainLoop loop(
        config, *backend, *groups,
        keel::trainer::RankContext{store.get(), worker.rank, worker.world_size, worker.generation,
                                   board ? &*board : nullptr, worker.snapshot_fd.value_or(-1), worker.snapshot_buddy});
    // While the loop lives, a peer's failure also cancels its checkpoint
    // commit (the dead rank's report will never come), and its fault
    // injector reaches the communicators.
    struct LoopHooks {
      keel::trainer::ProcessGroups& groups;
      ~LoopHooks() {
        groups.on_peer_failure();
        for (const auto& group : groups.communicators()) group.comm->set_fault_injector(nullptr);
      }
    } hooks{*groups};
    groups->on_peer_failure([&loop](const std::string& cause) { loop.cancel_checkpoint("a peer failed: " + cause); });
    for (const auto& group : groups->communicators()) group.comm->set_fault_injector(&loop.faults());
    if (!command.gradient_dump.empty()) loop.dump_first_gradients(command.gradient_dump, worker.rank);
    if (!command.eval_dir.empty()) {
      if (command.eval_data.empty()) throw Error(ErrorCode::kBadConfig, "--eval needs --eval-data TOKEN_FILE");
      loop.restore(command.eval_dir);
      const auto result = loop.evaluate(command.eval_data, command.eval_sequences);
      if (worker.rank == 0) {
        std::cout << nlohmann::json{{"step", loop.first_step()},
                                    {"loss", result.loss},
                                    {"sequences", result.sequences},
                                    {"tokens", result.sequences * config.model.seq_len}}
                         .dump()
                  << std::endl;
      }
      return 0;
    }
    loop.resume();
    auto summary = loop.run(g_stop, command.stop_after);
    if (summary.final_checkpoint_failed) {
      std::cerr << "keel-trainer: checkpoint_failure: the final checkpoint was not committed; see events.jsonl"
                << std::endl;
    }
    print_summary(summary, blas, command.json);
    if (summary.final_checkpoint_failed) return keel::common::exit_code(ErrorCode::kCheckpointFailure);
    return summary.stopped_early ? keel::common::exit_code(ErrorCode::kStoppedOnRequest) : 0;
  } catch (const Error& e) {
    std::cerr << "keel-trainer: " << keel::common::error_code_name(e.code()) << ": " << e.what() << std::endl;
    groups->leave_all(e.what());
    dump_flight_recorder(*recorder, flight_path);
    return keel::common::exit_code(e.code());
  } catch (const std::exception& e) {
    std::cerr << "keel-trainer: internal error: " << e.what() << std::endl;
    groups->leave_all(e.what());
    dump_flight_recorder(*recorder, flight_path);
    return keel::common::exit_code(ErrorCode::kInternal);
  }
}
