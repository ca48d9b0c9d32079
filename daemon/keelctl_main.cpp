// keelctl: the operator's command line (DESIGN §8). The checkpoint commands
// work on a run directory directly; the commands that talk to keeld come
// with the Daemon issue.
#include "daemon/checkpoint_commands.h"

#include <CLI/CLI.hpp>

#include <iostream>

int main(int argc, char** argv) {
  CLI::App app{"keelctl: operate keel training runs"};
  app.require_subcommand(1);
  auto* checkpoint = app.add_subcommand("checkpoint", "list, verify, inspect or prune a run's checkpoints");
  checkpoint->require_subcommand(1);

  std::string run_dir, checkpoints, tensor;
  int64_t step = -1, limit = 64, keep = 3, keep_every = 0;
  bool json = false, all = false, dry_run = false;
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
  app.footer("Exit codes: 0 fine, 1 a checkpoint failed verification, 2 bad usage or input.");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  if (run_dir.empty() == checkpoints.empty()) {
    std::cerr << "keelctl: give exactly one of --run-dir and --checkpoints\n";
    return 2;
  }
  keel::daemon::CheckpointTarget target{checkpoints.empty() ? std::filesystem::path(run_dir) / "checkpoints"
                                                            : std::filesystem::path(checkpoints),
                                        step >= 0 ? std::optional<int64_t>(step) : std::nullopt, json};
  if (list->parsed()) return keel::daemon::checkpoint_list(target, std::cout, std::cerr);
  if (verify->parsed()) return keel::daemon::checkpoint_verify(target, all, std::cout, std::cerr);
  if (inspect->parsed()) return keel::daemon::checkpoint_inspect(target, tensor, limit, std::cout, std::cerr);
  return keel::daemon::checkpoint_prune(target, keep, keep_every, dry_run, std::cout, std::cerr);
}
