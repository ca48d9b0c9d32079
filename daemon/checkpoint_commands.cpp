#include "daemon/checkpoint_commands.h"

#include "common/human_format.h"

#include "checkpoint/catalog.h"
#include "checkpoint/manifest.h"
#include "checkpoint/paths.h"
#include "checkpoint/reader.h"
#include "common/error.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>

namespace keel::daemon {
namespace {

using checkpoint::CatalogEntry;

// Whether the checkpoint directory exists; says what to pass when not.
bool root_exists(const CheckpointTarget& target, std::ostream& err) {
  if (std::filesystem::is_directory(target.root)) return true;
  err << "keelctl: " << target.root.string() << " is not a directory; pass --run-dir or --checkpoints\n";
  return false;
}

// The checkpoint `target` names, or a message saying why there is none.
std::optional<CatalogEntry> pick(const CheckpointTarget& target, std::ostream& err) {
  if (!root_exists(target, err)) return std::nullopt;
  const auto entries = checkpoint::committed(target.root);
  if (entries.empty()) {
    err << "keelctl: no committed checkpoint in " << target.root.string() << "\n";
    return std::nullopt;
  }
  if (!target.step) return entries.back();
  for (const auto& e : entries) {
    if (e.step == *target.step) return e;
  }
  err << fmt::format("keelctl: no committed checkpoint of step {} in {}; `keelctl checkpoint list` shows them\n",
                     *target.step, target.root.string());
  return std::nullopt;
}

// "dp2 tp1 pp2 cp2 zero1 (8 ranks)": dp and tp always, the other axes
// where the layout uses them.
std::string layout_text(const nlohmann::json& layout) {
  std::string axes = fmt::format("dp{} tp{}", layout.value("dp", 1), layout.value("tp", 1));
  for (const char* axis : {"pp", "cp", "ep"}) {
    if (layout.value(axis, 1) > 1) axes += fmt::format(" {}{}", axis, layout.value(axis, 1));
    // Interleaved: the pipeline's model chunks per stage.
    if (axis == std::string("pp") && layout.value("pp_virtual", 1) > 1) {
      axes += fmt::format(" (interleaved x{})", layout.value("pp_virtual", 1));
    }
  }
  return fmt::format("{} zero{} ({} ranks)", axes, layout.value("zero", 0), layout.value("world_size", 1));
}

}  // namespace

int checkpoint_list(const CheckpointTarget& target, const SnapshotSource& memory, std::ostream& out,
                    std::ostream& err) {
  if (!root_exists(target, err)) return 2;
  nlohmann::json rows = nlohmann::json::array();
  std::vector<std::filesystem::path> dirs;
  for (const auto& entry : std::filesystem::directory_iterator(target.root)) {
    if (entry.is_directory() && entry.path().filename().string().starts_with("step_")) dirs.push_back(entry.path());
  }
  std::sort(dirs.begin(), dirs.end());
  for (const auto& dir : dirs) {
    nlohmann::json row = {{"dir", dir.filename().string()}};
    if (const auto step = checkpoint::step_of(dir)) row["step"] = *step;
    try {
      const auto m = checkpoint::read_manifest(dir);
      uint64_t bytes = 0;
      for (const auto& f : m.files) bytes += f.bytes;
      row.update({{"step", m.step}, {"created", m.created}, {"bytes", bytes}, {"layout", m.layout},
                  {"status", "committed"}});
    } catch (const common::Error& e) {
      row["status"] = dir.extension() == ".partial" ? "incomplete (being written or interrupted)" : "not a checkpoint";
      row["why"] = e.what();
    }
    rows.push_back(row);
  }
  // Oldest first, as the directories are.
  nlohmann::json snapshots = nlohmann::json::array();
  size_t local_ranks = 0;
  if (memory.status.is_object()) {
    local_ranks = memory.status.value("ranks", nlohmann::json::array()).size();
    const auto listed = memory.status.value("snapshots", nlohmann::json::array());
    for (auto it = listed.rbegin(); it != listed.rend(); ++it) snapshots.push_back(*it);
  }
  if (target.json) {
    nlohmann::json reply = {{"checkpoints", rows}};
    reply["snapshots"] = memory.status.is_object() ? snapshots : nlohmann::json(nullptr);
    if (!memory.absent.empty()) reply["snapshots_absent"] = memory.absent;
    out << reply.dump() << "\n";
    return 0;
  }
  out << fmt::format("{:>10}  {:<24}  {:>10}  {:<24}  {}\n", "STEP", "CREATED", "SIZE", "LAYOUT", "STATUS");
  for (const auto& r : rows) {
    out << fmt::format("{:>10}  {:<24}  {:>10}  {:<24}  {}\n", r.contains("step") ? r["step"].dump() : "-",
                       r.value("created", "-"), r.contains("bytes") ? common::format_bytes(r["bytes"]) : "-",
                       r.contains("layout") ? layout_text(r["layout"]) : "-", r.value("status", ""));
  }
  for (const auto& r : snapshots) {
    out << fmt::format("{:>10}  {:<24}  {:>10}  {:<24}  in memory on {} of {} ranks of this node (keeld)\n",
                       r.value("step", int64_t{0}), "-", common::format_bytes(r.value("bytes", uint64_t{0})), "-",
                       r.value("ranks", 0), local_ranks);
  }
  if (rows.empty()) out << "(no checkpoints in " << target.root.string() << ")\n";
  if (!memory.absent.empty()) out << "(in-memory snapshots not shown: " << memory.absent << ")\n";
  return 0;
}

int checkpoint_verify(const CheckpointTarget& target, bool all, std::ostream& out, std::ostream& err) {
  std::vector<CatalogEntry> entries;
  if (all) {
    if (!root_exists(target, err)) return 2;
    entries = checkpoint::committed(target.root);
  } else if (auto one = pick(target, err)) {
    entries.push_back(*one);
  } else {
    return 2;
  }
  nlohmann::json results = nlohmann::json::array();
  bool ok = true;
  for (const auto& e : entries) {
    std::vector<std::string> problems;
    try {
      problems = checkpoint::verify_files(e.dir, checkpoint::read_manifest(e.dir));
    } catch (const common::Error& error) {
      problems.push_back(error.what());
    }
    ok = ok && problems.empty();
    results.push_back({{"step", e.step}, {"dir", e.dir.string()}, {"ok", problems.empty()}, {"problems", problems}});
    if (!target.json) {
      out << fmt::format("step {}: {}\n", e.step, problems.empty() ? "ok" : "FAILED");
      for (const auto& p : problems) out << "  " << p << "\n";
    }
  }
  if (target.json) out << nlohmann::json{{"ok", ok}, {"checkpoints", results}}.dump() << "\n";
  return ok ? 0 : 1;
}

int checkpoint_inspect(const CheckpointTarget& target, const std::string& tensor, int64_t limit, std::ostream& out,
                       std::ostream& err) {
  const auto entry = pick(target, err);
  if (!entry) return 2;
  try {
    checkpoint::CheckpointReader reader(entry->dir);
    if (tensor.empty()) {
      nlohmann::json tensors = nlohmann::json::array();
      for (const auto& name : reader.tensors()) {
        tensors.push_back({{"name", name.substr(1)}, {"shape", reader.global_shape(name)}, {"dtype", "float32"}});
      }
      const auto& layout = reader.manifest().layout;
      if (target.json) {
        out << nlohmann::json{{"step", entry->step},
                              {"dir", entry->dir.string()},
                              {"layout", layout},
                              {"tensors", tensors}}
                   .dump()
            << "\n";
        return 0;
      }
      out << fmt::format("checkpoint {} (step {}), saved by {}, {} tensors\n", entry->dir.string(), entry->step,
                         layout_text(layout), tensors.size());
      for (const auto& t : tensors) out << fmt::format("  {:<48} {:<14} float32\n", t["name"].get<std::string>(), t["shape"].dump());
      return 0;
    }
    const std::string path = "/" + (tensor.starts_with("/") ? tensor.substr(1) : tensor);
    const auto names = reader.tensors();
    if (std::find(names.begin(), names.end(), path) == names.end()) {
      err << fmt::format("keelctl: checkpoint {} has no tensor {}; `keelctl checkpoint inspect` lists them\n",
                         entry->dir.string(), tensor);
      return 2;
    }
    const auto shape = reader.global_shape(path);
    const int64_t cols = shape.size() == 2 ? shape[1] : 1;
    std::vector<float> values(static_cast<size_t>(shape[0] * cols));
    reader.read(path, 0, 0, shape[0], cols, values.data());
    if (limit > 0 && static_cast<size_t>(limit) < values.size()) values.resize(static_cast<size_t>(limit));
    if (target.json) {
      out << nlohmann::json{{"step", entry->step}, {"tensor", path.substr(1)}, {"shape", shape}, {"dtype", "float32"},
                            {"values", values}}.dump()
          << "\n";
      return 0;
    }
    out << fmt::format("{} {} float32, step {}{}\n", path.substr(1), nlohmann::json(shape).dump(), entry->step,
                       limit > 0 ? fmt::format(" (first {} values)", values.size()) : "");
    for (size_t i = 0; i < values.size(); ++i) out << fmt::format("{:.8g}{}", values[i], (i + 1) % 8 == 0 ? "\n" : " ");
    out << "\n";
    return 0;
  } catch (const common::Error& e) {
    err << "keelctl: " << e.what() << "\n";
    return 2;
  }
}

int checkpoint_prune(const CheckpointTarget& target, int64_t keep, int64_t keep_every, bool dry_run, std::ostream& out,
                     std::ostream& err) {
  if (!root_exists(target, err)) return 2;
  if (keep < 1 || keep_every < 0) {
    err << "keelctl: --keep must be at least 1 and --keep-every at least 0\n";
    return 2;
  }
  // The same rule as a run's retention: only checkpoints older than the
  // newest `keep` whose files are all there at their sizes.
  const auto doomed = checkpoint::prune_candidates(
      checkpoint::committed(target.root), checkpoint::RetentionPolicy{keep, keep_every},
      [](const checkpoint::CatalogEntry& e) {
        return checkpoint::inspect(e, checkpoint::Depth::kSizes).state == checkpoint::Inspection::State::kGood;
      });
  nlohmann::json removed = nlohmann::json::array();
  for (const auto& e : doomed) {
    if (!dry_run) {
      try {
        checkpoint::remove_checkpoint(e.dir);
      } catch (const common::Error& error) {
        err << "keelctl: " << error.what() << "\n";
        return 2;
      }
    }
    removed.push_back(e.step);
    if (!target.json) out << (dry_run ? "would remove " : "removed ") << e.dir.string() << "\n";
  }
  if (target.json) out << nlohmann::json{{"dry_run", dry_run}, {"removed_steps", removed}}.dump() << "\n";
  else if (doomed.empty()) out << "nothing to remove\n";
  return 0;
}

}  // namespace keel::daemon
