#include "health/board_summary.h"

#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace keel::health {
namespace {

using nlohmann::json;

// Ranks a summary may carry: more than any node has GPUs or cores to run.
constexpr size_t kMaxRanksPerSummary = 4096;

// A time as its age at `now` (null: never); a garbage time in the future
// has a negative age and stays in the future once decoded.
json age_of(int64_t t, int64_t now) { return t == 0 ? json(nullptr) : json(now - t); }
int64_t time_of(const json& age, int64_t now) { return age.is_null() ? 0 : now - age.get<int64_t>(); }

// Copies `text` into a fixed field, refusing what does not fit with its NUL.
template <size_t N>
void copy_text(const json& text, char (&field)[N]) {
  const auto s = text.get<std::string>();
  if (s.size() >= N) throw std::out_of_range("text field too long");
  std::memset(field, 0, N);
  std::memcpy(field, s.data(), s.size());
}

// The slot an entry names, within a table of `slots`.
size_t slot_of(const json& slot, size_t slots) {
  const auto s = slot.get<int64_t>();
  if (s < 0 || static_cast<size_t>(s) >= slots) throw std::out_of_range("slot out of range");
  return static_cast<size_t>(s);
}

json encode_board(const BoardSnapshot& b, int64_t now) {
  json steps = json::array();
  for (const StepTiming& t : b.steps) {
    if (t.step >= 0) {
      steps.push_back(
          {t.step, t.total_ms, t.compute_ms, t.wait_ms, t.data_ms, t.cpu_wait_ms, t.own_cpu_wait_ms, t.stalled_ms});
    }
  }
  json groups = json::array();
  for (size_t slot = 0; slot < kMaxGroups; ++slot) {
    const GroupRecord& g = b.groups[slot];
    if (g.name[0] == '\0') continue;
    groups.push_back({slot, board_text(g.name), board_text(g.op), g.size, g.index, g.seq_begun, g.seq_done,
                      age_of(g.begin_ns, now), age_of(g.done_ns, now), g.bytes, g.state, g.step_bytes});
  }
  json digests = json::array();
  for (size_t slot = 0; slot < kDigestSlots; ++slot) {
    const ReplicaDigest& d = b.digests[slot];
    if (d.step >= 0) digests.push_back({slot, d.step, d.replica_set, d.digest});
  }
  return {{"rank", b.rank},
          {"phase", b.phase},
          {"pid", b.pid},
          {"generation", b.generation},
          {"first_step", b.first_step},
          {"steps_done", b.steps_done},
          {"total_steps", b.total_steps},
          {"update", age_of(b.update_ns, now)},
          {"step_start", age_of(b.step_start_ns, now)},
          {"phase_start", age_of(b.phase_start_ns, now)},
          {"loss", b.loss},
          {"grad_norm", b.grad_norm},
          {"tokens_per_s", b.tokens_per_s},
          {"step_ms", b.step_ms},
          {"phase_last_ms", b.phase_last_ms},
          {"phase_count", b.phase_count},
          {"steps", std::move(steps)},
          {"groups", std::move(groups)},
          {"digests", std::move(digests)},
          {"digest_count", b.digest_count},
          {"sdc", {b.sdc.count, b.sdc.step, b.sdc.rank, b.sdc.method, b.sdc.verdict}},
          {"checkpoint_step", b.checkpoint_step}};
}

BoardSnapshot decode_board(const json& j, int64_t now) {
  BoardSnapshot b;
  b.rank = j.at("rank").get<int32_t>();
  b.phase = j.at("phase").get<uint32_t>();
  b.pid = j.at("pid").get<int32_t>();
  b.generation = j.at("generation").get<int64_t>();
  b.first_step = j.at("first_step").get<int64_t>();
  b.steps_done = j.at("steps_done").get<int64_t>();
  b.total_steps = j.at("total_steps").get<int64_t>();
  b.update_ns = time_of(j.at("update"), now);
  b.step_start_ns = time_of(j.at("step_start"), now);
  b.phase_start_ns = time_of(j.at("phase_start"), now);
  b.loss = j.at("loss").get<float>();
  b.grad_norm = j.at("grad_norm").get<float>();
  b.tokens_per_s = j.at("tokens_per_s").get<double>();
  b.step_ms = j.at("step_ms").get<double>();
  const json& last_ms = j.at("phase_last_ms");
  const json& count = j.at("phase_count");
  if (last_ms.size() != kPhaseCount || count.size() != kPhaseCount) throw std::out_of_range("phase tables");
  for (size_t p = 0; p < kPhaseCount; ++p) {
    b.phase_last_ms[p] = last_ms.at(p).get<float>();
    b.phase_count[p] = count.at(p).get<uint32_t>();
  }
  for (const json& t : j.at("steps")) {
    const auto step = t.at(0).get<int64_t>();
    if (step < 0) throw std::out_of_range("step");
    StepTiming& s = b.steps[static_cast<size_t>(step) % kRecentSteps];
    s = {step,
         t.at(1).get<float>(),
         t.at(2).get<float>(),
         t.at(3).get<float>(),
         t.at(4).get<float>(),
         t.at(5).get<float>(),
         t.at(6).get<float>(),
         t.at(7).get<float>()};
  }
  for (const json& g : j.at("groups")) {
    GroupRecord& r = b.groups[slot_of(g.at(0), kMaxGroups)];
    copy_text(g.at(1), r.name);
    copy_text(g.at(2), r.op);
    r.size = g.at(3).get<int32_t>();
    r.index = g.at(4).get<int32_t>();
    r.seq_begun = g.at(5).get<int64_t>();
    r.seq_done = g.at(6).get<int64_t>();
    r.begin_ns = time_of(g.at(7), now);
    r.done_ns = time_of(g.at(8), now);
    r.bytes = g.at(9).get<uint64_t>();
    r.state = g.at(10).get<uint32_t>();
    r.step_bytes = g.at(11).get<uint64_t>();
  }
  for (const json& d : j.at("digests")) {
    b.digests[slot_of(d.at(0), kDigestSlots)] = {d.at(1).get<int64_t>(), d.at(2).get<uint64_t>(),
                                                 d.at(3).get<uint64_t>()};
  }
  b.digest_count = j.at("digest_count").get<uint64_t>();
  const json& sdc = j.at("sdc");
  b.sdc.count = sdc.at(0).get<uint64_t>();
  b.sdc.step = sdc.at(1).get<int64_t>();
  b.sdc.rank = sdc.at(2).get<int32_t>();
  b.sdc.method = sdc.at(3).get<uint32_t>();
  b.sdc.verdict = sdc.at(4).get<uint32_t>();
  b.checkpoint_step = j.at("checkpoint_step").get<int64_t>();
  return b;
}

}  // namespace

std::string encode_summary(int64_t generation, const RankSamples& ranks, int64_t now_ns) {
  json out_ranks = json::array();
  for (const RankSample& s : ranks) {
    out_ranks.push_back({{"rank", s.rank},
                         {"running", s.running},
                         {"heartbeat", age_of(s.heartbeat_ns, now_ns)},
                         {"board", s.board ? encode_board(*s.board, now_ns) : json(nullptr)}});
  }
  const json summary = {{"version", kBoardVersion}, {"generation", generation}, {"ranks", std::move(out_ranks)}};
  const std::vector<uint8_t> bytes = json::to_msgpack(summary);
  return std::string(bytes.begin(), bytes.end());
}

std::optional<NodeSummary> decode_summary(const std::string& bytes, int64_t now_ns) {
  const json j = json::from_msgpack(bytes, /*strict=*/true, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  try {
    // Another build's boards may mean other things by the same fields.
    if (j.at("version").get<uint32_t>() != kBoardVersion) return std::nullopt;
    NodeSummary out;
    out.generation = j.at("generation").get<int64_t>();
    out.as_of_ns = now_ns;
    const json& ranks = j.at("ranks");
    if (!ranks.is_array() || ranks.size() > kMaxRanksPerSummary) return std::nullopt;
    for (const json& r : ranks) {
      RankSample s;
      s.rank = r.at("rank").get<int>();
      s.running = r.at("running").get<bool>();
      s.heartbeat_ns = time_of(r.at("heartbeat"), now_ns);
      if (!r.at("board").is_null()) s.board = decode_board(r.at("board"), now_ns);
      out.ranks.push_back(std::move(s));
    }
    return out;
  } catch (const json::exception&) {
    return std::nullopt;
  } catch (const std::out_of_range&) {
    return std::nullopt;
  }
}

void shift_times(RankSample& sample, int64_t delta_ns) {
  auto shift = [delta_ns](int64_t& t) {
    if (t != 0) t += delta_ns;
  };
  shift(sample.heartbeat_ns);
  if (!sample.board) return;
  BoardSnapshot& b = *sample.board;
  shift(b.update_ns);
  shift(b.step_start_ns);
  shift(b.phase_start_ns);
  for (GroupRecord& g : b.groups) {
    shift(g.begin_ns);
    shift(g.done_ns);
  }
}

}  // namespace keel::health
