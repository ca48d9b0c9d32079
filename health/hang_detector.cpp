#include "health/hang_detector.h"

#include "common/clock.h"
#include "common/log.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>

namespace keel::health {
namespace {

// A board written just before keeld read the time may carry a time a
// little after it on another core's view of the clock; more than this is
// not a race but garbage.
constexpr int64_t kFutureSlackNs = 1'000'000'000;
// Far beyond any run (10^5 collectives a second for 80 years), far below
// any overflow.
constexpr int64_t kMaxSeq = int64_t{1} << 48;
// Garbage that passes every check could otherwise grow the learned state.
constexpr size_t kMaxKinds = 64;

// The longest gap between two observations that counts in full
// (health/watched_time.h): a quarter of the shortest limit, so that a clock
// jump moves no age across one, and at most 2 s; far above keeld's 200 ms
// poll with the default limits.
int64_t max_credited_gap_ns(const common::HealthConfig& config) {
  return common::seconds_to_ns(std::min(2.0, std::min(config.hang_timeout_floor_s, config.heartbeat_timeout_s) / 4));
}

int64_t plus(int64_t a, int64_t b) {
  int64_t sum = 0;
  return __builtin_add_overflow(a, b, &sum) ? INT64_MAX : sum;
}

bool printable(const char* field, size_t bytes, bool empty_ok) {
  const size_t n = strnlen(field, bytes);
  if (n == bytes) return false;  // no NUL: a name that runs on
  if (n == 0) return empty_ok;
  return std::all_of(field, field + n, [](char c) { return c > ' ' && c < 0x7f; });
}

bool in_flight(const GroupRecord& g) { return g.state == static_cast<uint32_t>(CollectiveState::kInFlight); }

// Whether the sequence numbers agree with the state, as BoardPublisher
// keeps them: nothing begun, one in flight past the last done, or the last
// begun done (ok or failed).
bool consistent_sequence(const GroupRecord& g) {
  if (g.seq_begun > kMaxSeq || g.seq_done < -1) return false;
  switch (static_cast<CollectiveState>(g.state)) {
    case CollectiveState::kNone: return g.seq_begun == -1 && g.seq_done == -1;
    case CollectiveState::kInFlight: return g.seq_begun >= 0 && g.seq_done < g.seq_begun;
    case CollectiveState::kDone:
    case CollectiveState::kFailed: return g.seq_begun >= 0 && g.seq_done == g.seq_begun;
  }
  return false;
}

// Why the board of `rank` (of `world` ranks) is not trusted at `now_ns`;
// empty when it is. Only what the detector reads is checked.
std::string distrust(const BoardSnapshot& b, int64_t heartbeat_ns, int rank, size_t world, int64_t now_ns) {
  const int64_t latest = plus(now_ns, kFutureSlackNs);
  auto sane = [&](int64_t t) { return t > 0 && t <= latest; };
  if (b.version != kBoardVersion) return fmt::format("version {}, not {}", b.version, kBoardVersion);
  if (b.rank != rank) return fmt::format("it says it is rank {}", b.rank);
  if (b.phase >= kPhaseCount) return fmt::format("phase {} does not exist", b.phase);
  if (b.generation < 0 || b.first_step < 0 || b.steps_done < b.first_step) {
    return fmt::format("generation {}, first step {}, steps done {}", b.generation, b.first_step, b.steps_done);
  }
  if (!sane(b.update_ns) || !sane(b.phase_start_ns) || b.phase_start_ns > b.update_ns) {
    return fmt::format("published at {} ns, phase started at {} ns, now {} ns", b.update_ns, b.phase_start_ns, now_ns);
  }
  if (heartbeat_ns > latest) return fmt::format("heartbeat at {} ns, now {} ns", heartbeat_ns, now_ns);
  for (uint32_t p = 0; p < kPhaseCount; ++p) {
    if (!std::isfinite(b.phase_last_ms[p]) || b.phase_last_ms[p] < 0) {
      return fmt::format("phase {} lasted {} ms", phase_name(p), b.phase_last_ms[p]);
    }
  }
  for (size_t slot = 0; slot < kMaxGroups; ++slot) {
    const GroupRecord& g = b.groups[slot];
    if (g.name[0] == '\0') continue;
    if (!printable(g.name, kGroupNameBytes, false) || !printable(g.op, kOpNameBytes, true)) {
      return fmt::format("group slot {}: the name or op is not a printable NUL-terminated string", slot);
    }
    const std::string name = group_name(g);
    for (size_t other = 0; other < slot; ++other) {
      if (b.groups[other].name[0] != '\0' && group_name(b.groups[other]) == name) {
        return fmt::format("group {} is listed twice", name);
      }
    }
    if (g.size < 1 || static_cast<size_t>(g.size) > world || g.index < 0 || g.index >= g.size) {
      return fmt::format("group {}: index {} of size {} in a job of {} ranks", name, g.index, g.size, world);
    }
    if (!consistent_sequence(g)) {
      return fmt::format("group {}: state {}, begun {}, done {}", name, g.state, g.seq_begun, g.seq_done);
    }
    if ((g.seq_begun >= 0 && !sane(g.begin_ns)) || (g.seq_done >= 0 && !sane(g.done_ns))) {
      return fmt::format("group {}: began at {} ns, done at {} ns, now {} ns", name, g.begin_ns, g.done_ns, now_ns);
    }
  }
  return {};
}

std::string ranks_text(const std::set<int>& ranks) {
  return fmt::format("{} {}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ", "));
}

std::vector<int> sorted(const std::set<int>& ranks) { return {ranks.begin(), ranks.end()}; }

using Key = std::pair<std::string, int64_t>;  // (group, seq)

// What one observation says about one collective.
struct Verdict {
  bool hung = false;
  std::set<int> culprits;
  std::set<int> frozen;
  std::set<int> waiting;
  std::vector<std::string> clauses;  // why each culprit is one
  std::string op;
  double waited_s = 0;
  double budget_s = 0;

  void note(std::string clause) {
    if (std::find(clauses.begin(), clauses.end(), clause) == clauses.end()) clauses.push_back(std::move(clause));
  }
  void blame(int rank, std::string clause, bool is_frozen = false) {
    culprits.insert(rank);
    if (is_frozen) frozen.insert(rank);
    note(std::move(clause));
  }
  // The culprits of a hung collective that a member of this one waits in.
  void adopt(const Verdict& blocking) {
    culprits.insert(blocking.culprits.begin(), blocking.culprits.end());
    frozen.insert(blocking.frozen.begin(), blocking.frozen.end());
    for (const auto& clause : blocking.clauses) note(clause);
  }
};

// The verdicts of one observation: the trusted boards grouped by process
// group, each collective judged once (a wait in one may depend on another).
class Judge {
 public:
  Judge(const RankSamples& samples, const std::vector<bool>& trusted, const HangDetector& detector,
        const WatchedTime& time, const common::HealthConfig& config)
      : samples_(samples), trusted_(trusted), detector_(detector), time_(time), config_(config) {
    for (size_t r = 0; r < samples.size(); ++r) {
      if (!trusted[r]) continue;
      for (const GroupRecord& g : samples[r].board->groups) {
        if (g.name[0] == '\0') continue;
        const std::string name = group_name(g);
        Group& group = groups_[name];
        if (group.members.empty()) {
          group.kind = group_kind(name);
          group.size = g.size;
        }
        group.consistent = group.consistent && group.size == g.size;
        group.members.push_back(Member{static_cast<int>(r), &g});
        kinds_[group.kind].insert(static_cast<int>(r));
      }
    }
  }

  // Every collective some running rank is in flight on, once.
  std::set<Key> in_flight_collectives() const {
    std::set<Key> keys;
    for (const auto& [name, group] : groups_) {
      for (const Member& m : group.members) {
        if (in_flight(*m.record) && samples_[m.rank].running) keys.emplace(name, m.record->seq_begun);
      }
    }
    return keys;
  }

  const Verdict& collective(const Key& key) {
    if (auto it = verdicts_.find(key); it != verdicts_.end()) return it->second;
    deciding_.insert(key);
    Verdict verdict = decide(key);
    deciding_.erase(key);
    return verdicts_[key] = std::move(verdict);
  }

 private:
  struct Member {
    int rank;
    const GroupRecord* record;
  };
  struct Group {
    std::string kind;
    int32_t size = 0;
    bool consistent = true;  // the members agree on the size
    std::vector<Member> members;
  };

  bool frozen(int rank) const {
    const int64_t beat = samples_[rank].heartbeat_ns;
    return beat > 0 && time_.age_s(beat) > config_.heartbeat_timeout_s;
  }
  std::string frozen_clause(int rank) const {
    return fmt::format("rank {} is frozen (heartbeat {:.1f} s old)", rank, time_.age_s(samples_[rank].heartbeat_ns));
  }

  Verdict decide(const Key& key) {
    const auto& [name, seq] = key;
    Verdict v;
    const auto found = groups_.find(name);
    if (found == groups_.end()) return v;
    const Group& group = found->second;
    if (!group.consistent || group.members.size() > static_cast<size_t>(group.size)) return v;
    int64_t oldest_ns = INT64_MAX;
    int64_t newest_ns = INT64_MIN;  // a member began seq no later than this
    for (const Member& m : group.members) {
      const GroupRecord& g = *m.record;
      if (g.seq_begun >= seq) newest_ns = std::max(newest_ns, g.begin_ns);
      if (!in_flight(g) || g.seq_begun != seq || !samples_[m.rank].running || frozen(m.rank)) continue;
      if (v.waiting.empty()) v.op = g.op;
      v.waiting.insert(m.rank);
      oldest_ns = std::min(oldest_ns, g.begin_ns);
    }
    if (v.waiting.empty()) return v;
    v.waited_s = time_.age_s(oldest_ns);
    v.budget_s = detector_.group_budget_s(group.kind);
    if (v.waited_s <= v.budget_s) return v;

    bool explained = false;
    for (const Member& m : group.members) {
      if (m.record->seq_begun < seq) explained |= judge_missing(m.rank, name, true, v);
    }
    if (group.members.size() < static_cast<size_t>(group.size)) {
      // A slot nobody claims: one of the ranks that list no group of this kind.
      const std::set<int>& listing = kinds_[group.kind];
      bool candidates = false;
      for (int r = 0; r < static_cast<int>(samples_.size()); ++r) {
        if (listing.count(r) != 0) continue;
        candidates = true;
        explained |= judge_missing(r, name, false, v);
      }
      if (!candidates) return v;  // the size is wrong: no verdict on it
    }
    if (explained) return v;
    for (const Member& m : group.members) {
      if (frozen(m.rank)) v.blame(m.rank, frozen_clause(m.rank), true);
    }
    // Naming nobody takes more: the collective stalled past the budget
    // since the last member began it (one board's old begin time alone
    // proves nothing; a member that moved on began it before its current
    // collective), and past heartbeat_timeout_s, after which a member
    // stopped inside the collective shows as frozen.
    if (v.culprits.empty() && time_.age_s(newest_ns) <= std::max(v.budget_s, config_.heartbeat_timeout_s)) return v;
    v.hung = true;
    return v;
  }

  // Judges a member that has not begun the collective of `v`: blames it (or
  // the culprits of the hung collective it waits in) and returns false, or
  // returns true when something still explains it.
  bool judge_missing(int rank, const std::string& group, bool joined, Verdict& v) {
    const RankSample& sample = samples_[rank];
    if (!sample.board && sample.known) {
      v.blame(rank, fmt::format("rank {} never published its board", rank));
      return false;
    }
    if (!trusted_[rank]) {
      // It may be the one everybody waits for, or garbage: it holds the
      // verdict up to the ceiling, and is never named.
      if (v.waited_s <= config_.hang_timeout_ceiling_s) return true;
      v.note(sample.known ? fmt::format("rank {}'s board is not trusted", rank)
                          : fmt::format("rank {}'s node has not been heard from", rank));
      return false;
    }
    if (!sample.running) {
      v.blame(rank, fmt::format("rank {} exited", rank));
      return false;
    }
    if (frozen(rank)) {
      v.blame(rank, frozen_clause(rank), true);
      return false;
    }
    const BoardSnapshot& board = *sample.board;
    bool waits = false;
    for (const GroupRecord& g : board.groups) {
      if (g.name[0] == '\0' || !in_flight(g)) continue;
      waits = true;
      const Key key{group_name(g), g.seq_begun};
      // A wait on a collective being decided closes a cycle of waits: every
      // collective in it is hung, and none names a culprit beyond the frozen.
      if (deciding_.count(key) == 0) {
        const Verdict& blocking = collective(key);
        if (!blocking.hung) return true;
        v.adopt(blocking);
      }
      v.note(fmt::format("rank {} waits in {} {} seq {}, itself hung", rank, key.first, g.op, key.second));
    }
    if (waits) return false;
    const bool beating = sample.heartbeat_ns > 0;
    const double in_phase_s = time_.age_s(board.phase_start_ns);
    const double phase_budget_s = detector_.phase_budget_s(static_cast<Phase>(board.phase));
    if (beating && in_phase_s <= phase_budget_s) return true;
    v.blame(rank, fmt::format("rank {} never {} ({} for {:.1f} s, budget {:.1f} s{})", rank,
                              joined ? "began it" : fmt::format("joined {}", group), phase_name(board.phase),
                              in_phase_s, phase_budget_s, beating ? "" : ", no heartbeat"));
    return false;
  }

  const RankSamples& samples_;
  const std::vector<bool>& trusted_;
  const HangDetector& detector_;
  const WatchedTime& time_;
  const common::HealthConfig& config_;
  std::map<std::string, Group> groups_;
  std::map<std::string, std::set<int>> kinds_;  // kind: the ranks that list a group of it
  std::map<Key, Verdict> verdicts_;
  std::set<Key> deciding_;  // the collectives being decided: a wait on one of them closes a cycle
};

}  // namespace

nlohmann::json HangFinding::to_json() const {
  return {{"culprit_ranks", culprit_ranks}, {"group", group},       {"seq", seq},
          {"op", op},                       {"waiting_ranks", waiting_ranks},
          {"frozen_ranks", frozen_ranks},   {"detect_s", detect_s}, {"budget_s", budget_s},
          {"reason", reason}};
}

HangDetector::HangDetector(const common::HealthConfig& config)
    : config_(config),
      rule_{config.hang_timeout_multiple, config.hang_timeout_floor_s, config.hang_timeout_ceiling_s},
      time_(max_credited_gap_ns(config),
            common::seconds_to_ns(std::max(config.hang_timeout_ceiling_s, config.heartbeat_timeout_s)) +
                max_credited_gap_ns(config)),
      phases_(kPhaseCount, DurationBudget(rule_)) {}

double HangDetector::group_budget_s(const std::string& kind) const {
  const auto it = groups_.find(kind);
  return warmed_up_ && it != groups_.end() ? it->second.budget_s() : rule_.ceiling_s;
}

double HangDetector::phase_budget_s(Phase phase) const {
  const auto p = static_cast<size_t>(phase);
  return warmed_up_ && p < phases_.size() ? phases_[p].budget_s() : rule_.ceiling_s;
}

nlohmann::json HangDetector::budgets_json() const {
  nlohmann::json groups = nlohmann::json::object();
  for (const auto& [kind, budget] : groups_) groups[kind] = group_budget_s(kind);
  nlohmann::json phases = nlohmann::json::object();
  for (uint32_t p = 0; p < kPhaseCount; ++p) phases[phase_name(p)] = phase_budget_s(static_cast<Phase>(p));
  return {{"warmed_up", warmed_up_}, {"groups", std::move(groups)}, {"phases", std::move(phases)}};
}

void HangDetector::check_warmup(const RankSamples& samples, const std::vector<bool>& trusted) {
  if (samples.empty() || !trusted[0]) return;
  const BoardSnapshot& board = *samples[0].board;
  if (board.generation != generation_) {
    // A new generation starts slow (rendezvous, loading a checkpoint,
    // cold caches): budgets learned so far stay, but are not applied yet.
    generation_ = board.generation;
    warmed_up_ = false;
  }
  if (board.steps_done - board.first_step >= config_.hang_warmup_steps) warmed_up_ = true;
}

void HangDetector::learn(const RankSamples& samples, const std::vector<bool>& trusted) {
  for (size_t r = 0; r < samples.size(); ++r) {
    if (!trusted[r]) continue;
    const BoardSnapshot& board = *samples[r].board;
    Seen& seen = seen_[r];
    // A new process counts its phases and collectives from zero.
    const bool same = seen.known && seen.generation == board.generation && seen.pid == board.pid;
    for (uint32_t p = 0; p < kPhaseCount; ++p) {
      if (warmed_up_ && same && board.phase_count[p] > seen.phase_count[p]) {
        // The instance that ended began at the start seen last if it was
        // in progress then, else after the snapshot seen last: bounded so,
        // a clock jump in it counts as watched time only.
        const int64_t began_by = seen.phase == p ? seen.phase_start_ns : seen.update_ns;
        phases_[p].add(std::min(board.phase_last_ms[p] / 1e3, time_.age_s(began_by)));
      }
      seen.phase_count[p] = board.phase_count[p];
    }
    seen.phase = board.phase;
    seen.phase_start_ns = board.phase_start_ns;
    seen.update_ns = board.update_ns;
    std::map<std::string, int64_t> seq_done;
    for (const GroupRecord& g : board.groups) {
      if (g.name[0] == '\0') continue;
      const std::string name = group_name(g);
      seq_done[name] = g.seq_done;
      const auto before = seen.seq_done.find(name);
      // done_ns - begin_ns belongs to seq_done only while it is also the
      // collective begun last; a failed one says nothing about how long a
      // good one takes.
      const bool ended = same && before != seen.seq_done.end() && g.seq_done > before->second &&
                         g.seq_done == g.seq_begun && g.state == static_cast<uint32_t>(CollectiveState::kDone);
      if (!warmed_up_ || !ended) continue;
      const std::string kind = group_kind(name);
      auto it = groups_.find(kind);
      if (it == groups_.end() && groups_.size() < kMaxKinds) it = groups_.emplace(kind, DurationBudget(rule_)).first;
      // In watched time, so that a clock jump is not learned as a slow
      // collective; one that ends before it began (a clock gone back) is
      // not learned at all.
      if (it != groups_.end() && g.done_ns >= g.begin_ns) {
        it->second.add(common::ns_to_seconds(time_.age_ns(g.begin_ns) - time_.age_ns(g.done_ns)));
      }
    }
    seen.seq_done = std::move(seq_done);
    seen.known = true;
    seen.generation = board.generation;
    seen.pid = board.pid;
  }
}

std::vector<HangFinding> HangDetector::observe(const RankSamples& samples, int64_t now_ns) {
  time_.observe(now_ns);
  seen_.resize(samples.size());
  std::vector<bool> trusted(samples.size(), false);
  for (size_t r = 0; r < samples.size(); ++r) {
    const RankSample& sample = samples[r];
    if (!sample.known || !sample.board) continue;
    const std::string why =
        distrust(*sample.board, sample.heartbeat_ns, static_cast<int>(r), samples.size(), now_ns);
    trusted[r] = why.empty();
    Seen& seen = seen_[r];
    if (trusted[r] != seen.trusted) {
      // Once per change, not every poll: a board that stays bad says so once.
      if (!trusted[r]) {
        common::logger("hang")->warn("rank {}'s progress board is not trusted ({}); the hang detector names no rank "
                                     "on it",
                                     r, why);
      } else {
        common::logger("hang")->info("rank {}'s progress board is trusted again", r);
      }
      seen.trusted = trusted[r];
    }
  }
  check_warmup(samples, trusted);
  learn(samples, trusted);

  Judge judge(samples, trusted, *this, time_, config_);
  std::vector<HangFinding> findings;
  for (const Key& key : judge.in_flight_collectives()) {
    const Verdict& v = judge.collective(key);
    if (!v.hung || found_.count(key) != 0) continue;
    found_.insert(key);
    HangFinding f;
    f.culprit_ranks = sorted(v.culprits);
    f.waiting_ranks = sorted(v.waiting);
    f.frozen_ranks = sorted(v.frozen);
    f.group = key.first;
    f.seq = key.second;
    f.op = v.op;
    f.detect_s = v.waited_s;
    f.budget_s = v.budget_s;
    f.reason = fmt::format(
        "{} waited {:.1f} s in {} {} seq {} (budget {:.1f} s): {}", ranks_text(v.waiting), v.waited_s, f.group, f.op,
        f.seq, v.budget_s,
        v.clauses.empty()    ? "every member began it and none is frozen, so the boards name nobody (a transport or "
                               "backend fault)"
        : v.culprits.empty() ? fmt::format("{}, so the boards name nobody", fmt::join(v.clauses, "; "))
                             : fmt::format("{}", fmt::join(v.clauses, "; ")));
    findings.push_back(std::move(f));
  }
  return findings;
}

}  // namespace keel::health
