// A node's boards as another node's keeld reads them (health/board_summary.h):
// every field a detector reads comes across, times keep their ages on the
// reader's clock, and bytes that are no summary are refused, never a crash.
#include "health/board_summary.h"

#include <doctest/doctest.h>

#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

using keel::health::BoardSnapshot;
using keel::health::decode_summary;
using keel::health::encode_summary;
using keel::health::GroupRecord;
using keel::health::RankSample;
using keel::health::RankSamples;

namespace {

constexpr int64_t kSecond = 1'000'000'000;

// A rank's sample with every carried field set, as a busy rank publishes
// it: a full step ring, a group table, digests and an SDC report.
RankSample busy_rank(int rank, int64_t now) {
  RankSample s;
  s.rank = rank;
  s.heartbeat_ns = now - kSecond / 10;
  BoardSnapshot& b = s.board.emplace();
  b.rank = rank;
  b.phase = 3;
  b.pid = 4242 + rank;
  b.generation = 7;
  b.first_step = 100;
  b.steps_done = 140;
  b.total_steps = 1000;
  b.update_ns = now - kSecond / 5;
  b.step_start_ns = now - kSecond;
  b.phase_start_ns = now - kSecond / 2;
  b.loss = 3.25f;
  b.grad_norm = 0.5f;
  b.tokens_per_s = 12345.5;
  b.step_ms = 250.25;
  for (uint32_t p = 0; p < keel::health::kPhaseCount; ++p) {
    b.phase_last_ms[p] = 10.5f * static_cast<float>(p);
    b.phase_count[p] = 3 * p;
  }
  for (int64_t step = 108; step < 140; ++step) {
    b.steps[static_cast<size_t>(step) % keel::health::kRecentSteps] = {step, 250, 200, 40, 9, 1, 0.5f, 2.25f};
  }
  const char* names[] = {"g7.tp.12", "g7.dp.0", "g7.pp.3", "g7.dp_cp.0", "g7.expert_dp.120"};
  for (size_t slot = 0; slot < 5; ++slot) {
    GroupRecord& g = b.groups[slot];
    std::strcpy(g.name, names[slot]);
    std::strcpy(g.op, "all_reduce");
    g.size = 8;
    g.index = rank % 8;
    g.seq_begun = 1000 + static_cast<int64_t>(slot);
    g.seq_done = 999 + static_cast<int64_t>(slot);
    g.begin_ns = now - 3 * kSecond;
    g.done_ns = now - 4 * kSecond;
    g.bytes = 1u << 20;
    g.step_bytes = (3u << 20) + slot;
    g.state = 1;
  }
  for (size_t d = 0; d < keel::health::kDigestSlots; ++d) {
    b.digests[d] = {130 + static_cast<int64_t>(d), 0xabcdef0123456789ull, 0xfedcba9876543210ull + d};
  }
  b.digest_count = 17;
  b.sdc = {2, 120, rank, 2, 1, 0};
  b.checkpoint_step = 100;
  return s;
}

// The bytes of `a` and `b` are the same but for the reserved fields and
// the flight records and BLAS core a summary leaves on the node.
void check_same_carried(const BoardSnapshot& a, const BoardSnapshot& b) {
  CHECK(a.rank == b.rank);
  CHECK(a.phase == b.phase);
  CHECK(a.pid == b.pid);
  CHECK(a.generation == b.generation);
  CHECK(a.first_step == b.first_step);
  CHECK(a.steps_done == b.steps_done);
  CHECK(a.total_steps == b.total_steps);
  CHECK(a.update_ns == b.update_ns);
  CHECK(a.step_start_ns == b.step_start_ns);
  CHECK(a.phase_start_ns == b.phase_start_ns);
  CHECK(a.loss == b.loss);
  CHECK(a.grad_norm == b.grad_norm);
  CHECK(a.tokens_per_s == b.tokens_per_s);
  CHECK(a.step_ms == b.step_ms);
  CHECK(std::memcmp(a.phase_last_ms, b.phase_last_ms, sizeof(a.phase_last_ms)) == 0);
  CHECK(std::memcmp(a.phase_count, b.phase_count, sizeof(a.phase_count)) == 0);
  CHECK(std::memcmp(a.steps, b.steps, sizeof(a.steps)) == 0);
  CHECK(std::memcmp(a.groups, b.groups, sizeof(a.groups)) == 0);
  CHECK(std::memcmp(a.digests, b.digests, sizeof(a.digests)) == 0);
  CHECK(a.digest_count == b.digest_count);
  CHECK(std::memcmp(&a.sdc, &b.sdc, sizeof(a.sdc)) == 0);
  CHECK(a.checkpoint_step == b.checkpoint_step);
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("a node's boards read on another node carry every field a detector reads with the same ages") {
    const int64_t sent = 1000 * kSecond;  // the publishing node's clock
    const int64_t read = 77 * kSecond;    // the reading node's, unrelated
    RankSamples ranks = {busy_rank(8, sent), busy_rank(9, sent)};
    ranks[1].running = false;
    ranks.push_back(RankSample{10, std::nullopt, 0, true});  // never published
    const std::string bytes = encode_summary(3, ranks, sent);
    MESSAGE("a summary of a busy rank: " << bytes.size() / 2 << " bytes");
    CHECK(bytes.size() / 2 < 2048);
    const auto got = decode_summary(bytes, read);
    REQUIRE(got.has_value());
    CHECK(got->generation == 3);
    CHECK(got->as_of_ns == read);
    REQUIRE(got->ranks.size() == 3);
    for (size_t i = 0; i < 2; ++i) {
      CAPTURE(i);
      RankSample expected = ranks[i];
      keel::health::shift_times(expected, read - sent);
      CHECK(got->ranks[i].rank == expected.rank);
      CHECK(got->ranks[i].running == expected.running);
      CHECK(got->ranks[i].heartbeat_ns == expected.heartbeat_ns);
      REQUIRE(got->ranks[i].board.has_value());
      check_same_carried(*got->ranks[i].board, *expected.board);
    }
    CHECK(got->ranks[2].rank == 10);
    CHECK_FALSE(got->ranks[2].board.has_value());
    CHECK(got->ranks[2].heartbeat_ns == 0);  // never beaten stays never
  }

  TEST_CASE("bytes that are no summary of this build's boards are refused and never crash the reader") {
    const int64_t now = 500 * kSecond;
    const std::string good = encode_summary(1, {busy_rank(0, now)}, now);
    // The summary as JSON, edited by `edit`, in MessagePack again.
    auto edited = [&](const std::function<void(nlohmann::json&)>& edit) {
      auto j = nlohmann::json::from_msgpack(good);
      edit(j);
      const auto bytes = nlohmann::json::to_msgpack(j);
      return std::string(bytes.begin(), bytes.end());
    };
    struct Row {
      const char* name;
      std::string bytes;
    };
    const std::vector<Row> rows = {
        {"nothing", ""},
        {"text", "hello, etcd"},
        {"cut short", good.substr(0, good.size() / 2)},
        {"trailing bytes", good + "x"},
        {"not an object", edited([](auto& j) {
           j = nlohmann::json::array({1, 2});
         })},
        {"another board version", edited([](auto& j) { j["version"] = 3; })},
        {"no generation", edited([](auto& j) { j.erase("generation"); })},
        {"ranks not a list", edited([](auto& j) { j["ranks"] = "many"; })},
        {"a rank without a board field", edited([](auto& j) { j["ranks"][0].erase("board"); })},
        {"a heartbeat that is text", edited([](auto& j) { j["ranks"][0]["heartbeat"] = "soon"; })},
        {"a group name too long for a board",
         edited([](auto& j) { j["ranks"][0]["board"]["groups"][0][1] = std::string(200, 'g'); })},
        {"a group slot out of the table", edited([](auto& j) { j["ranks"][0]["board"]["groups"][0][0] = 8; })},
        {"a negative digest slot", edited([](auto& j) { j["ranks"][0]["board"]["digests"][0][0] = -1; })},
        {"a step timing cut short", edited([](auto& j) {
           j["ranks"][0]["board"]["steps"][0] = {5, 1.0};
         })},
        {"a negative step", edited([](auto& j) { j["ranks"][0]["board"]["steps"][0][0] = -3; })},
        {"a phase table too short", edited([](auto& j) {
           j["ranks"][0]["board"]["phase_count"] = {1, 2};
         })},
        {"an SDC report that is an object", edited([](auto& j) {
           j["ranks"][0]["board"]["sdc"] = {{"count", 1}};
         })},
        {"more ranks than any node runs", edited([](auto& j) {
           j["ranks"] = nlohmann::json::array();
           for (int r = 0; r < 5000; ++r)
             j["ranks"].push_back({{"rank", r}, {"running", true}, {"heartbeat", nullptr}, {"board", nullptr}});
         })},
    };
    for (const Row& row : rows) {
      CAPTURE(row.name);
      CHECK_FALSE(decode_summary(row.bytes, now).has_value());
    }
    std::mt19937_64 random(11);
    for (int i = 0; i < 2000; ++i) {
      std::string bytes = good;
      for (int flips = 0; flips < 4; ++flips) bytes[random() % bytes.size()] = static_cast<char>(random());
      (void)decode_summary(bytes, now);  // anything but a crash
    }
    CHECK(decode_summary(good, now).has_value());
  }

  TEST_CASE("a time moved keeps never as never") {
    RankSample s = busy_rank(0, 100 * kSecond);
    s.board->groups[7] = GroupRecord{};
    keel::health::shift_times(s, 5 * kSecond);
    CHECK(s.heartbeat_ns == 100 * kSecond - kSecond / 10 + 5 * kSecond);
    CHECK(s.board->groups[0].begin_ns == 102 * kSecond);
    CHECK(s.board->groups[7].begin_ns == 0);
  }
}

