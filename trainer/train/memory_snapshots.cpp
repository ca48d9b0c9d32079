#include "trainer/train/memory_snapshots.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <stdexcept>

#include "checkpoint/parallel_copy.h"
#include "common/error.h"
#include "common/log.h"

namespace keel::trainer {

using common::Error;
using common::ErrorCode;

nlohmann::json SnapshotReport::to_json() const { return {{"steps", steps}, {"problems", problems}}; }

SnapshotReport SnapshotReport::from_json(const nlohmann::json& json, int rank) {
  try {
    // nlohmann would take 1.5 for step 1.
    for (const auto& step : json.at("steps")) {
      if (!step.is_number_integer() || step.get<int64_t>() < 0) throw std::invalid_argument("a step is not a step");
    }
    return SnapshotReport{json.at("steps").get<std::vector<int64_t>>(),
                          json.at("problems").get<std::vector<std::string>>()};
  } catch (const std::exception& e) {
    throw Error(ErrorCode::kPeerFailure,
                fmt::format("rank {}'s report of its in-memory snapshots cannot be read: {}", rank, e.what()));
  }
}

SnapshotChoice choose_snapshot(const std::vector<std::optional<SnapshotReport>>& reports) {
  std::optional<std::set<int64_t>> common;
  for (size_t r = 0; r < reports.size(); ++r) {
    const auto& report = reports[r];
    if (!report) return {std::nullopt, fmt::format("rank {} keeps no in-memory snapshots", r)};
    if (report->steps.empty()) {
      // The first problem says why the newest did not verify; an empty
      // area (a new keeld, the job's first generation) has none.
      return {std::nullopt,
              report->problems.empty()
                  ? fmt::format("rank {} holds no in-memory snapshot", r)
                  : fmt::format("rank {} holds no in-memory snapshot that verifies: {}", r, report->problems.front())};
    }
    const std::set<int64_t> steps(report->steps.begin(), report->steps.end());
    if (!common) {
      common = steps;
      continue;
    }
    std::set<int64_t> both;
    std::set_intersection(common->begin(), common->end(), steps.begin(), steps.end(),
                          std::inserter(both, both.begin()));
    if (both.empty()) {
      return {std::nullopt, fmt::format("no step is held in memory by every rank: rank {} holds [{}], the ranks "
                                        "before it [{}]",
                                        r, fmt::join(steps, ", "), fmt::join(*common, ", "))};
    }
    common = std::move(both);
  }
  if (!common) return {std::nullopt, "no rank keeps in-memory snapshots"};
  // A rank whose newest did not verify still holds an older one in common.
  std::string why;
  for (size_t r = 0; r < reports.size() && why.empty(); ++r) {
    if (!reports[r]->problems.empty()) why = fmt::format("rank {}: {}", r, reports[r]->problems.front());
  }
  return {*common->rbegin(), why};
}

void copy_state_to_host(Backend& backend, const std::vector<Backend::HostCopy>& copies, unsigned threads) {
  if (!backend.host_memory()) {
    backend.snapshot_to_host(copies);
    return;
  }
  std::vector<checkpoint::CopyJob> jobs;
  for (const auto& c : copies) jobs.push_back({c.host, c.src, c.bytes});
  checkpoint::parallel_copy(jobs, threads);
}

MemorySnapshots::MemorySnapshots(int fd, const Options& options, Backend& backend)
    : options_(options), area_(fd, options.keep, options.copied), backend_(backend) {}

bool MemorySnapshots::due(int64_t steps_done, double step_s) const {
  if (options_.every_steps > 0) return steps_done % options_.every_steps == 0;
  if (last_step_ < 0) return true;
  return last_stall_s_ <= options_.stall_budget * step_s * static_cast<double>(steps_done - last_step_);
}

bool MemorySnapshots::ready_to_copy() const {
  if (!options_.copied) return false;
  if (last_copy_step_ < 0) return true;
  const auto complete = area_.list();
  return std::any_of(complete.begin(), complete.end(), [&](const checkpoint::SnapshotArea::Listed& l) {
    return l.step == last_copy_step_ && l.copy_step && l.copied;
  });
}

MemorySnapshots::~MemorySnapshots() {
  try {
    wait();
  } catch (const std::exception& e) {
    common::logger("checkpoint")->error("the last in-memory snapshot's commit failed: {}", e.what());
  }
  if (pinned_ != nullptr) backend_.unpin_host(pinned_);
}

void MemorySnapshots::wait() {
  if (commit_.valid()) commit_.get();
}

void MemorySnapshots::pin() {
  if (backend_.host_memory() || area_.mapping() == pinned_) return;
  if (pinned_ != nullptr) backend_.unpin_host(pinned_);
  pinned_ = area_.mapping();
  backend_.pin_host(pinned_, area_.mapping_bytes());
}

void MemorySnapshots::save(const std::vector<checkpoint::Piece>& pieces, const std::vector<float*>& local, int64_t step,
                           int64_t tokens, bool copy_step, const Faults& faults) {
  wait();
  // A new slot's pointers replace the last report's, which may be in it.
  found_.clear();
  const std::vector<float*> slot = area_.begin(pieces, options_.layout, copy_step);
  if (copy_step) last_copy_step_ = step;
  pin();
  // The schedule goes by the copy: the area's first lay-out (its pages
  // taken, a second or more for gigabytes) happens once.
  const auto start = std::chrono::steady_clock::now();
  // In two halves, so that a fault can land between them.
  const size_t half = pieces.size() / 2;
  for (const auto& [first, last] : {std::pair{size_t{0}, half}, std::pair{half, pieces.size()}}) {
    std::vector<Backend::HostCopy> copies;
    for (size_t i = first; i < last; ++i) copies.push_back({slot[i], local[i], pieces[i].bytes()});
    copy_state_to_host(backend_, copies, options_.threads);
    if (first == 0 && faults.halfway) faults.halfway();
  }
  last_step_ = step;
  last_stall_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The hash reads the slot, not the state, so training goes on meanwhile.
  auto* first = pieces.empty() || pieces.front().numel() == 0 ? nullptr : slot.front();
  commit_ = std::async(std::launch::async, [this, step, tokens, corrupt = faults.corrupt, first] {
    if (const auto problem = area_.commit(step, tokens)) {
      common::logger("checkpoint")->error("in-memory snapshot not kept: {}", *problem);
    } else if (corrupt && first != nullptr) {
      reinterpret_cast<unsigned char*>(first)[0] ^= 0x01;
    }
  });
}

SnapshotReport MemorySnapshots::report(const std::vector<checkpoint::Piece>& pieces) {
  wait();
  auto verified = area_.verified(options_.layout, options_.threads);
  SnapshotReport report;
  report.problems = std::move(verified.problems);
  found_.clear();
  for (auto& snapshot : verified.snapshots) {
    // The layout hash matched, so this is a bug or a file from another
    // keel; it is still never loaded.
    if (snapshot.pieces != pieces) {
      report.problems.push_back(fmt::format(
          "the in-memory snapshot of step {} holds other pieces than this rank's state", snapshot.listed.step));
      continue;
    }
    report.steps.push_back(snapshot.listed.step);
    found_.push_back(std::move(snapshot));
  }
  return report;
}

void MemorySnapshots::restore(int64_t step, const std::vector<float*>& local) {
  const auto it = std::find_if(found_.begin(), found_.end(),
                               [&](const checkpoint::SnapshotArea::Snapshot& s) { return s.listed.step == step; });
  if (it == found_.end()) {
    throw Error(ErrorCode::kCheckpointFailure,
                fmt::format("rank 0 chose the in-memory snapshot of step {}, which this rank did not report", step));
  }
  if (backend_.host_memory()) {
    std::vector<checkpoint::CopyJob> copies;
    for (size_t i = 0; i < local.size(); ++i) copies.push_back({local[i], it->data[i], it->pieces[i].bytes()});
    checkpoint::parallel_copy(copies, options_.threads);
  } else {
    for (size_t i = 0; i < local.size(); ++i) backend_.copy_from_host(local[i], it->data[i], it->pieces[i].bytes());
  }
}

}  // namespace keel::trainer
