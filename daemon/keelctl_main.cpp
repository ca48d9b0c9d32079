// keelctl: the operator's command line (docs/architecture.md "Daemon"). status, events, stop,
// restart, `checkpoint now`, health, diagnose, stragglers and inject ask
// keeld through its control socket; the other checkpoint commands work on a
// run directory directly, with or without a daemon.
#include "daemon/checkpoint_commands.h"
#include "daemon/job.h"
#include "daemon/health_view.h"
#include "daemon/protocol.h"
#include "daemon/status_view.h"
#include "daemon/straggler_view.h"
#include "common/human_format.h"
#include "interop/hf_export.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <string_view>

namespace {

constexpr int kRefused = 1;
constexpr int kUnreachable = 3;

constexpr int kBadInput = 2;

// Sends `request` to keeld and prints the reply: `show` for a readable view,
// the JSON itself with --json. `then`, when given, runs on a reply keeld
// accepted, after it was printed, and its exit code is keelctl's.
int ask_keeld(const std::string& socket, const keel::daemon::Request& request, bool json,
              const std::function<void(const nlohmann::json&)>& show,
              const std::function<int(const nlohmann::json&)>& then = nullptr) {
  nlohmann::json reply;
  try {
    reply = keel::daemon::call_daemon(socket, request);
  } catch (const keel::daemon::DaemonUnreachable& e) {
    std::cerr << "keelctl: " << e.what() << "\n";
    return kUnreachable;
  } catch (const keel::daemon::ProtocolError& e) {
    std::cerr << "keelctl: " << e.what() << "\n";
    return kUnreachable;
  }
  const bool ok = reply.value("ok", false);
  if (json) {
    std::cout << reply.dump(2) << "\n";
  } else if (ok) {
    show(reply);
  } else {
    std::cerr << "keelctl: keeld refused: " << reply.value("error", std::string("no reason given")) << "\n";
  }
  if (!ok) return kRefused;
  return then ? then(reply) : 0;
}

// The in-memory snapshots of the job whose checkpoints are at `root`, from
// the keeld at `socket` if it runs that job.
keel::daemon::SnapshotSource snapshot_source(const std::string& socket, const std::filesystem::path& root) {
  keel::daemon::Request request;
  request.command = keel::daemon::Command::kStatus;
  nlohmann::json status;
  try {
    status = keel::daemon::call_daemon(socket, request);
  } catch (const std::exception&) {
    return {nullptr, fmt::format("no keeld answers at {}", socket)};
  }
  std::error_code ec;
  const std::string dir = status.value("checkpoint_dir", "");
  if (!status.value("ok", false) || dir.empty() || !std::filesystem::equivalent(dir, root, ec)) {
    return {nullptr, fmt::format("the keeld at {} runs the job of {}, not this one", socket, dir.empty() ? "?" : dir)};
  }
  return {status, ""};
}

// keelctl plan: the job's own trainer prints its plan (keel-trainer
// --plan), so the figures are the trainer's arithmetic for the trainer
// the job would run; it replaces this process and answers with its output
// and exit code.
int run_plan(const std::string& config_path, const std::vector<std::string>& sets, bool json) {
  std::filesystem::path trainer;
  try {
    trainer = keel::daemon::job_trainer(keel::common::Config::load(config_path, sets));
  } catch (const std::exception& e) {
    std::cerr << "keelctl: " << e.what() << "\n";
    return kBadInput;
  }
  std::vector<std::string> args = {trainer.string(), "--config", config_path};
  for (const std::string& set : sets) args.insert(args.end(), {"--set", set});
  args.push_back("--plan");
  if (json) args.push_back("--json");
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  execv(argv[0], argv.data());
  std::cerr << fmt::format("keelctl: cannot run {}: {}\n", trainer.string(), std::strerror(errno));
  return kBadInput;
}

// keelctl export: a checkpoint as a Hugging Face model directory, with a
// progress line on stderr at most once a second (a 8B model is 32 GB).
int run_export(keel::interop::HfExportOptions options, bool json) {
  auto last = std::chrono::steady_clock::now();
  options.progress = [&last](const keel::interop::HfExportProgress& p) {
    const auto now = std::chrono::steady_clock::now();
    if (p.tensors_done < p.tensors && now - last < std::chrono::seconds(1)) return;
    last = now;
    const double rate = p.seconds > 0 ? static_cast<double>(p.bytes_done) / p.seconds : 0;
    std::cerr << fmt::format("keelctl: exported {} of {} tensors, {} of {}, {} so far, ETA {}\n", p.tensors_done,
                             p.tensors, keel::common::format_bytes(p.bytes_done), keel::common::format_bytes(p.bytes),
                             keel::common::format_duration(p.seconds),
                             keel::common::format_duration(rate > 0 ? static_cast<double>(p.bytes - p.bytes_done) / rate : 0));
  };
  try {
    const auto report = keel::interop::export_hf(options);
    if (json) {
      std::cout << report.to_json().dump(2) << "\n";
    } else {
      std::cout << fmt::format("exported {} (step {}) to {}: {} tensors, {} in {}\n", report.checkpoint.string(),
                               report.step, report.out.string(), report.tensors, keel::common::format_bytes(report.bytes),
                               fmt::join(report.files, ", "));
    }
    return 0;
  } catch (const keel::common::Error& e) {
    std::cerr << "keelctl: " << e.what() << "\n";
    return e.code() == keel::common::ErrorCode::kCheckpointFailure ? kRefused : kBadInput;
  } catch (const std::exception& e) {
    std::cerr << "keelctl: " << e.what() << "\n";
    return kBadInput;
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"keelctl: operate keel training runs"};
  app.require_subcommand(1);
  std::string socket = keel::daemon::default_socket_path();
  app.add_option("--socket", socket, "keeld's control socket (default: $KEEL_SOCKET or /run/keel/keeld.sock)");
  bool json = false;
  keel::daemon::Request request;
  auto print_message = [](const nlohmann::json& reply) { std::cout << reply.value("message", "done") << "\n"; };

  auto* status = app.add_subcommand("status", "the job, its generation, step, loss, tokens/s, ETA and every rank");
  status->add_flag("--json", json, "print keeld's reply as JSON");
  auto* events = app.add_subcommand("events", "the newest events of the run: restarts, failures, checkpoints");
  events->add_flag("--json", json, "print keeld's reply as JSON");
  events->add_option("--limit", request.limit, "how many of the newest events")->check(CLI::Range(1, 100000));
  auto* stop = app.add_subcommand("stop", "the ranks save a final checkpoint and keeld exits; starting keeld resumes");
  bool no_checkpoint = false;
  stop->add_flag("--no-checkpoint", no_checkpoint, "stop at once; the run resumes from its newest checkpoint");
  stop->add_flag("--json", json, "print keeld's reply as JSON");
  auto* restart = app.add_subcommand("restart", "save a checkpoint and start a new generation (or run a finished or failed job again)");
  restart->add_flag("--json", json, "print keeld's reply as JSON");

  auto* health = app.add_subcommand("health", "each rank's verdict (healthy, straggler, suspect, hung) and why");
  health->add_flag("--json", json, "print keeld's reply as JSON");
  auto* diagnose = app.add_subcommand("diagnose", "the last hang verdict and every rank's recent collectives side by side");
  diagnose->add_flag("--json", json, "print keeld's reply as JSON");
  auto* stragglers = app.add_subcommand("stragglers", "per rank: median compute time, straggler score, flagged");
  stragglers->add_flag("--json", json, "print keeld's reply as JSON");
  std::string plot;
  stragglers->add_option("--plot", plot, "also draw a rank x step heat map of compute time into this PNG file");
  auto* inject = app.add_subcommand(
      "inject", "inject a fault into a running rank for a game day: crash, hang, slow, bitflip or nan");
  auto add_option = [inject](const char* name, auto& field, const char* help) {
    if (std::string_view(name) == "kind") {
      inject->add_option(name, field, help)->required();
    } else {
      inject->add_option(std::string("--") + name, field, help);
    }
  };
  request.fault.visit(add_option);
  inject->add_flag("--json", json, "print keeld's reply as JSON");

  auto* checkpoint = app.add_subcommand("checkpoint", "save now, or list, verify, inspect or prune a run's checkpoints");
  checkpoint->require_subcommand(1);
  auto* now = checkpoint->add_subcommand("now", "ask keeld's ranks to save after the step in progress");
  now->add_flag("--json", json, "print keeld's reply as JSON");

  std::string run_dir, checkpoints, tensor;
  int64_t step = -1, limit = 64, keep = 3, keep_every = 0;
  bool all = false, dry_run = false;
  auto common_options = [&](CLI::App* cmd, bool with_step) {
    cmd->add_option("--run-dir", run_dir, "the run directory (its checkpoints/ is used)");
    cmd->add_option("--checkpoints", checkpoints, "the checkpoint directory itself (when checkpoint.dir is set)");
    cmd->add_flag("--json", json, "print one JSON document");
    if (with_step) cmd->add_option("--step", step, "one checkpoint (default: the newest committed)");
  };
  auto* list = checkpoint->add_subcommand("list", "step, time, size, layout and status of every checkpoint");
  common_options(list, false);
  auto* verify = checkpoint->add_subcommand("verify", "check every file against its size and checksum (exit 1 on a mismatch)");
  common_options(verify, true);
  verify->add_flag("--all", all, "every committed checkpoint");
  auto* inspect = checkpoint->add_subcommand("inspect", "tensors, shapes and dtypes; --tensor dumps one");
  common_options(inspect, true);
  inspect->add_option("--tensor", tensor, "a tensor to dump, e.g. model/wte or optim/exp_avg/h.0.ln_1.weight");
  inspect->add_option("--limit", limit, "values to print (0: all)");
  auto* prune = checkpoint->add_subcommand("prune", "remove what retention would");
  common_options(prune, false);
  prune->add_option("--keep", keep, "newest checkpoints kept");
  prune->add_option("--keep-every", keep_every, "also keep steps that are multiples of this (0: none)");
  prune->add_flag("--dry-run", dry_run, "only list what would be removed");
  std::string plan_config;
  std::vector<std::string> plan_sets;
  auto* plan = app.add_subcommand(
      "plan", "what a job needs before it starts: parameters, FLOPs a token and each rank's memory (keel-trainer --plan)");
  plan->add_option("--config", plan_config, "the job's TOML")->required();
  plan->add_option("--set", plan_sets, "override a config entry: --set section.key=value (repeatable)");
  plan->add_flag("--json", json, "print one JSON document");
  keel::interop::HfExportOptions export_options;
  std::string export_format = "hf", export_dtype = "fp32";
  auto* exporter = app.add_subcommand(
      "export", "write a checkpoint (any layout) as a Hugging Face model: config.json and safetensors");
  exporter->add_option("checkpoint", export_options.checkpoint,
                       "a checkpoint directory, or a run's checkpoints/ (its newest committed checkpoint)")
      ->required();
  exporter->add_option("--format", export_format, "the format written (hf: Hugging Face)")
      ->check(CLI::IsMember({"hf"}));
  exporter->add_option("--out", export_options.out, "the directory to create (it must not exist)")->required();
  exporter->add_option("--dtype", export_dtype, "the weights' type: fp32 (exact) or bf16")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  exporter->add_option("--max-shard-size", export_options.max_shard_bytes,
                       "split into files of at most this many bytes, as Hugging Face does (default 5GB)")
      ->transform(CLI::AsSizeValue(true));
  exporter->add_flag("--json", json, "print one JSON document");
  app.footer(
      "Exit codes: 0 fine, 1 keeld refused the request, a checkpoint failed verification or an export\n"
      "could not be written,\n"
      "2 bad usage or input, 3 keeld is not running (or not at --socket).");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : kBadInput;
  }
  if (plan->parsed()) return run_plan(plan_config, plan_sets, json);
  if (exporter->parsed()) {
    export_options.dtype = export_dtype == "bf16" ? keel::interop::TensorDtype::kBF16 : keel::interop::TensorDtype::kF32;
    return run_export(export_options, json);
  }
  using keel::daemon::Command;
  request.checkpoint = !no_checkpoint;
  if (inject->parsed()) {
    if (const std::string problem = keel::daemon::fault_spec_problem(request.fault); !problem.empty()) {
      std::cerr << "keelctl: " << problem << "\n";
      return kBadInput;
    }
  }
  auto draw = [&plot](const nlohmann::json& reply) {
    if (plot.empty()) return 0;
    try {
      keel::daemon::plot_stragglers(reply, plot);
    } catch (const std::exception& e) {
      std::cerr << "keelctl: " << e.what() << "\n";
      return kBadInput;
    }
    return 0;
  };
  auto view = [](void (*print)(const nlohmann::json&, std::ostream&)) {
    return [print](const nlohmann::json& reply) { print(reply, std::cout); };
  };
  struct Asked {
    CLI::App* command;
    Command request;
    std::function<void(const nlohmann::json&)> show;
    std::function<int(const nlohmann::json&)> then;
  };
  const Asked asked[] = {
      {status, Command::kStatus, view(keel::daemon::print_status), nullptr},
      {events, Command::kEvents, view(keel::daemon::print_events), nullptr},
      {stop, Command::kStop, print_message, nullptr},
      {restart, Command::kRestart, print_message, nullptr},
      {now, Command::kCheckpointNow, print_message, nullptr},
      {health, Command::kHealth, view(keel::daemon::print_health), nullptr},
      {diagnose, Command::kDiagnose, view(keel::daemon::print_diagnose), nullptr},
      {stragglers, Command::kStragglers, view(keel::daemon::print_stragglers), draw},
      {inject, Command::kInject, print_message, nullptr},
  };
  for (const auto& a : asked) {
    if (!a.command->parsed()) continue;
    request.command = a.request;
    return ask_keeld(socket, request, json, a.show, a.then);
  }
  if (run_dir.empty() == checkpoints.empty()) {
    std::cerr << "keelctl: give exactly one of --run-dir and --checkpoints\n";
    return kBadInput;
  }
  keel::daemon::CheckpointTarget target{checkpoints.empty() ? std::filesystem::path(run_dir) / "checkpoints"
                                                            : std::filesystem::path(checkpoints),
                                        step >= 0 ? std::optional<int64_t>(step) : std::nullopt, json};
  if (list->parsed()) return keel::daemon::checkpoint_list(target, snapshot_source(socket, target.root), std::cout, std::cerr);
  if (verify->parsed()) return keel::daemon::checkpoint_verify(target, all, std::cout, std::cerr);
  if (inspect->parsed()) return keel::daemon::checkpoint_inspect(target, tensor, limit, std::cout, std::cerr);
  return keel::daemon::checkpoint_prune(target, keep, keep_every, dry_run, std::cout, std::cerr);
}
