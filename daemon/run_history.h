// What keeld knows of a run from its event log, run_dir/events.jsonl
// (docs/architecture.md "Run directory"): the generations so far, and the
// checkpoints rank 0 committed (checkpoint_committed) or abandoned
// (checkpoint_abandoned) in each, less those keeld moved aside as suspect
// (checkpoint_quarantined: every step after its last_good_step). keeld goes by these, the ranks' own word,
// rather than by the names of the checkpoint directories: a directory that
// looks committed may not verify, and then the ranks pass it over.
//
// It also keeps where each generation's ranks restored their state from
// (state_restored: memory, disk or the start, and why not memory), and tallies the run's records that are no alarms (docs/architecture.md
// "Health"): the loss spikes the ranks recorded (loss_spike) and the steps
// they skipped (step_skipped). A step counts once however many
// generations replayed it.
//
// The log is followed: each refresh() reads only what was appended since
// the one before, and only whole lines (a line being appended is taken
// next time), so keeld reads a long history once.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <set>
#include <string>

namespace keel::daemon {

// Distinct steps of one kind of record.
struct StepTally {
  int64_t count = 0;
  int64_t last_step = -1;  // the newest; -1: none
};

class RunHistory {
 public:
  explicit RunHistory(const std::filesystem::path& run_dir);

  // Takes in the events appended since the last call.
  void refresh();

  // The newest generation an event names; -1 for a new run.
  int64_t last_generation() const { return last_generation_; }
  // The newest step committed by any generation; -1 when none was.
  int64_t newest_committed() const { return newest_committed_; }
  // The newest step committed in `generation`; -1 when none was.
  int64_t committed_in(int64_t generation) const;
  // Why rank 0 abandoned the last checkpoint of `generation`, when no
  // newer one was committed after it; empty otherwise.
  std::string abandoned_in(int64_t generation) const;
  // Rank 0's state_restored record of `generation` ({"from", "step",
  // "why"?, ...}); null when rank 0 wrote none here (yet, or it runs on
  // another node).
  nlohmann::json restored_in(int64_t generation) const;
  StepTally loss_spikes() const { return tally(spike_steps_); }
  StepTally skipped_steps() const { return tally(skipped_steps_); }

 private:
  struct Generation {
    std::set<int64_t> committed;
    int64_t abandoned = -1;
    std::string abandoned_cause;
    nlohmann::json restored;
  };
  void take(const nlohmann::json& event);
  static StepTally tally(const std::set<int64_t>& steps);

  std::filesystem::path path_;
  uint64_t offset_ = 0;   // bytes of the file taken in so far
  std::string partial_;   // a last line without its newline yet
  int64_t last_generation_ = -1;
  int64_t newest_committed_ = -1;
  std::map<int64_t, Generation> generations_;
  std::set<int64_t> spike_steps_, skipped_steps_;
};

}  // namespace keel::daemon
