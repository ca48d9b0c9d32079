#include "daemon/run_history.h"

#include <algorithm>
#include <fstream>

namespace keel::daemon {
namespace {

// Read at a time, and the longest line kept waiting for its newline: a line
// longer than this is not an event and is dropped.
constexpr size_t kChunk = 1 << 20;

}  // namespace

RunHistory::RunHistory(const std::filesystem::path& run_dir) : path_(run_dir / "events.jsonl") {}

void RunHistory::refresh() {
  std::ifstream in(path_, std::ios::binary | std::ios::ate);
  if (!in) return;
  const auto size = static_cast<uint64_t>(in.tellg());
  if (size < offset_) *this = RunHistory(path_.parent_path());  // replaced by a shorter log: start over
  in.seekg(static_cast<std::streamoff>(offset_));
  std::string chunk(kChunk, '\0');
  while (in.read(chunk.data(), static_cast<std::streamsize>(chunk.size())) || in.gcount() > 0) {
    offset_ += static_cast<uint64_t>(in.gcount());
    partial_.append(chunk.data(), static_cast<size_t>(in.gcount()));
    size_t start = 0;
    for (size_t end; (end = partial_.find('\n', start)) != std::string::npos; start = end + 1) {
      take(nlohmann::json::parse(partial_.begin() + static_cast<std::ptrdiff_t>(start),
                                 partial_.begin() + static_cast<std::ptrdiff_t>(end), nullptr, false));
    }
    partial_.erase(0, start);
    if (partial_.size() > kChunk) partial_.clear();
  }
}

void RunHistory::take(const nlohmann::json& event) {
  if (!event.is_object()) return;
  const auto generation = event.find("generation");
  if (generation == event.end() || !generation->is_number_integer()) return;
  const int64_t g = generation->get<int64_t>();
  last_generation_ = std::max(last_generation_, g);
  const auto kind_field = event.find("kind");
  const std::string kind = kind_field != event.end() && kind_field->is_string() ? kind_field->get<std::string>() : "";
  const auto step_field = event.find(kind == "checkpoint_quarantined" ? "last_good_step" : "step");
  if (step_field == event.end() || !step_field->is_number_integer()) return;
  const int64_t step = step_field->get<int64_t>();
  if (kind == "checkpoint_committed") {
    generations_[g].committed.insert(step);
    newest_committed_ = std::max(newest_committed_, step);
  } else if (kind == "checkpoint_abandoned") {
    auto& record = generations_[g];
    record.abandoned = step;
    const auto cause = event.find("cause");
    record.abandoned_cause = cause != event.end() && cause->is_string() ? cause->get<std::string>() : "no cause given";
  } else if (kind == "state_restored") {
    generations_[g].restored = event;
  } else if (kind == "loss_spike") {
    spike_steps_.insert(step);
  } else if (kind == "step_skipped") {
    skipped_steps_.insert(step);
  } else if (kind == "checkpoint_quarantined") {
    newest_committed_ = -1;
    for (auto& [number, record] : generations_) {
      record.committed.erase(record.committed.upper_bound(step), record.committed.end());
      if (!record.committed.empty()) newest_committed_ = std::max(newest_committed_, *record.committed.rbegin());
    }
  }
}

nlohmann::json RunHistory::restored_in(int64_t generation) const {
  const auto it = generations_.find(generation);
  return it == generations_.end() ? nlohmann::json() : it->second.restored;
}

StepTally RunHistory::tally(const std::set<int64_t>& steps) {
  return {static_cast<int64_t>(steps.size()), steps.empty() ? -1 : *steps.rbegin()};
}

int64_t RunHistory::committed_in(int64_t generation) const {
  const auto it = generations_.find(generation);
  return it == generations_.end() || it->second.committed.empty() ? -1 : *it->second.committed.rbegin();
}

std::string RunHistory::abandoned_in(int64_t generation) const {
  const auto it = generations_.find(generation);
  if (it == generations_.end() || it->second.abandoned <= committed_in(generation)) return "";
  return it->second.abandoned_cause;
}

}  // namespace keel::daemon
