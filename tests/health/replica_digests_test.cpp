#include "health/replica_digests.h"

#include "common/clock.h"
#include "tests/health/synthetic_boards.h"

#include <doctest/doctest.h>

#include <random>
#include <vector>

namespace keel::health {
namespace {

using test::SyntheticJob;

constexpr uint64_t kSetA = 0xA, kSetB = 0xB;
constexpr uint64_t kGood = 0x600d, kBad = 0xbad;

// Every rank publishes the digest of step `step` (digests[r]; its set is
// sets[r]) and keeld compares; returns what it found.
std::vector<DigestFinding> publish(ReplicaDigests& digests, SyntheticJob& job, int64_t step,
                                   const std::vector<uint64_t>& values, const std::vector<uint64_t>& sets,
                                   common::FakeClock& clock) {
  for (size_t r = 0; r < values.size(); ++r) job.publish_digest(static_cast<int>(r), step, sets[r], values[r]);
  clock.advance_s(1);
  return digests.observe(job.samples(), clock.now_ns());
}

std::vector<uint64_t> same_set(size_t ranks, uint64_t set = kSetA) { return std::vector<uint64_t>(ranks, set); }

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("replica digests name the rank a majority disagrees with") {
    struct Case {
      const char* what;
      std::vector<uint64_t> digests;
      std::vector<int> odd;
      std::vector<int> disagreeing;
    };
    const Case cases[] = {
        {"3 replicas agree", {kGood, kGood, kGood}, {}, {}},
        {"majority of 3 names the odd rank", {kGood, kBad, kGood}, {1}, {}},
        {"majority of 5 names two odd ranks", {kBad, kGood, kGood, 0x1, kGood}, {0, 3}, {}},
        {"2 replicas that disagree name nobody", {kGood, kBad}, {}, {0, 1}},
        {"a tie of 2 against 2 names nobody", {kGood, kGood, kBad, kBad}, {}, {0, 1, 2, 3}},
        {"3 replicas all different name nobody", {0x1, 0x2, 0x3}, {}, {0, 1, 2}},
        {"2 against 1 against 1 is no strict majority", {kGood, kGood, 0x1, 0x2}, {}, {0, 1, 2, 3}},
    };
    for (const auto& c : cases) {
      CAPTURE(c.what);
      common::FakeClock clock;
      SyntheticJob job(static_cast<int>(c.digests.size()));
      ReplicaDigests digests;
      CHECK(publish(digests, job, 10, same_set(c.digests.size()), same_set(c.digests.size()), clock).empty());
      const auto found = publish(digests, job, 20, c.digests, same_set(c.digests.size()), clock);
      CHECK(digests.comparisons() == 2);
      if (c.odd.empty() && c.disagreeing.empty()) {
        CHECK(found.empty());
        continue;
      }
      REQUIRE(found.size() == 1);
      CHECK(found[0].step == 20);
      CHECK(found[0].odd_ranks == c.odd);
      CHECK(found[0].disagreeing == c.disagreeing);
      CHECK(found[0].replicas == c.digests.size());
      CHECK(found[0].last_agreed_step == 10);
      for (int r : c.odd) {
        CHECK(found[0].event_for(r) == nlohmann::json{{"rank", r},
                                                       {"step", 20},
                                                       {"method", "replica_digest"},
                                                       {"verdict", "persistent"},
                                                       {"replicas", c.digests.size()},
                                                       {"last_agreed_step", 10}});
      }
    }
  }

  TEST_CASE("an odd rank is reported once while it keeps differing") {
    common::FakeClock clock;
    SyntheticJob job(5);
    ReplicaDigests digests;
    CHECK(publish(digests, job, 10, {1, 1, 1, 1, 1}, same_set(5), clock).empty());
    const auto first = publish(digests, job, 20, {2, 2, 2, 2, 9}, same_set(5), clock);
    REQUIRE(first.size() == 1);
    CHECK(first[0].odd_ranks == std::vector<int>{4});
    CHECK(publish(digests, job, 30, {3, 3, 3, 3, 9}, same_set(5), clock).empty());
    // A second rank goes bad: only it is new.
    const auto second = publish(digests, job, 40, {4, 4, 4, 8, 9}, same_set(5), clock);
    REQUIRE(second.size() == 1);
    CHECK(second[0].odd_ranks == std::vector<int>{3});
    CHECK(second[0].last_agreed_step == 10);
    CHECK(publish(digests, job, 50, {5, 5, 5, 8, 9}, same_set(5), clock).empty());
    // Rolled back and agreeing again: a new corruption is a new finding.
    CHECK(publish(digests, job, 60, {6, 6, 6, 6, 6}, same_set(5), clock).empty());
    const auto again = publish(digests, job, 70, {7, 7, 7, 7, 9}, same_set(5), clock);
    REQUIRE(again.size() == 1);
    CHECK(again[0].odd_ranks == std::vector<int>{4});
    CHECK(again[0].last_agreed_step == 60);
    CHECK(digests.comparisons() == 7);
  }

  TEST_CASE("a disagreement without a majority is reported once until the set agrees") {
    common::FakeClock clock;
    SyntheticJob job(2);
    ReplicaDigests digests;
    CHECK(publish(digests, job, 10, {1, 2}, same_set(2), clock).size() == 1);
    CHECK(publish(digests, job, 20, {1, 2}, same_set(2), clock).empty());
    CHECK(publish(digests, job, 30, {3, 3}, same_set(2), clock).empty());
    const auto again = publish(digests, job, 40, {4, 5}, same_set(2), clock);
    REQUIRE(again.size() == 1);
    CHECK(again[0].disagreeing == std::vector<int>{0, 1});
    CHECK(again[0].last_agreed_step == 30);
  }

  TEST_CASE("the last agreed step is minus one when a set never agreed") {
    common::FakeClock clock;
    SyntheticJob job(3);
    ReplicaDigests digests;
    const auto found = publish(digests, job, 10, {kGood, kBad, kGood}, same_set(3), clock);
    REQUIRE(found.size() == 1);
    CHECK(found[0].last_agreed_step == -1);
  }

  TEST_CASE("different replica sets are compared separately") {
    common::FakeClock clock;
    SyntheticJob job(6);
    ReplicaDigests digests;
    const std::vector<uint64_t> sets = {kSetA, kSetB, kSetA, kSetB, kSetA, kSetB};
    // The sets hold different bytes: their digests differ, which is no fault.
    CHECK(publish(digests, job, 10, {0xA0, 0xB0, 0xA0, 0xB0, 0xA0, 0xB0}, sets, clock).empty());
    // Until every rank has finished step 20, it may still publish a
    // digest of the other set (a rank can hold bytes of two sets).
    CHECK(publish(digests, job, 20, {0xA1, 0xB1, 0xA1, 0xB2, 0xA1, 0xB1}, sets, clock).empty());
    for (int r = 0; r < 6; ++r) job.board(r).steps_done = 21;
    const auto found = digests.observe(job.samples(), clock.now_ns());
    REQUIRE(found.size() == 1);
    CHECK(found[0].odd_ranks == std::vector<int>{3});
    CHECK(found[0].replicas == 3);
    CHECK(digests.comparisons() == 4);
  }

  TEST_CASE("a comparison waits for a rank that has not published the step yet") {
    common::FakeClock clock;
    SyntheticJob job(3);
    ReplicaDigests digests;
    job.publish_digest(0, 10, kSetA, kGood);
    job.publish_digest(1, 10, kSetA, kBad);
    job.board(2).steps_done = 10;  // rank 2 is at step 10 but has not published yet
    CHECK(digests.observe(job.samples(), clock.now_ns()).empty());
    CHECK(digests.comparisons() == 0);
    job.publish_digest(2, 10, kSetA, kGood);
    const auto found = digests.observe(job.samples(), clock.now_ns());
    REQUIRE(found.size() == 1);
    CHECK(found[0].odd_ranks == std::vector<int>{1});
  }

  TEST_CASE("a step whose digest a member's ring lost is not compared") {
    common::FakeClock clock;
    SyntheticJob job(3);
    ReplicaDigests digests;
    // Rank 2 published steps 10..100 before keeld looked: its ring of 8
    // no longer holds 10 and 20, which ranks 0 and 1 still show.
    for (int64_t step = 10; step <= 100; step += 10) job.publish_digest(2, step, kSetA, kGood);
    job.publish_digest(0, 10, kSetA, kGood);
    job.publish_digest(1, 10, kSetA, kBad);
    CHECK(digests.observe(job.samples(), clock.now_ns()).empty());
    CHECK(digests.comparisons() == 0);
  }

  TEST_CASE("a rank that never published and a rank that exited do not hold a set back") {
    common::FakeClock clock;
    SyntheticJob job(5);
    job.sample(3).board.reset();
    job.sample(4).running = false;
    ReplicaDigests digests;
    for (int r = 0; r < 3; ++r) job.publish_digest(r, 10, kSetA, r == 0 ? kBad : kGood);
    const auto found = digests.observe(job.samples(), clock.now_ns());
    REQUIRE(found.size() == 1);
    CHECK(found[0].odd_ranks == std::vector<int>{0});
    CHECK(found[0].replicas == 3);
  }

  TEST_CASE("a replica that exited still votes with the digests it published") {
    // The end of a run: rank 0 has published step 40 and exited, ranks 1
    // and 2 are still running; without rank 0 the two would be a split.
    common::FakeClock clock;
    SyntheticJob job(3);
    for (int r = 0; r < 3; ++r) job.publish_digest(r, 40, kSetA, r == 1 ? kBad : kGood);
    job.sample(0).running = false;
    ReplicaDigests digests;
    const auto found = digests.observe(job.samples(), clock.now_ns());
    REQUIRE(found.size() == 1);
    CHECK(found[0].odd_ranks == std::vector<int>{1});
    CHECK(found[0].replicas == 3);
  }

  TEST_CASE("a restarted generation's digests are compared again") {
    common::FakeClock clock;
    ReplicaDigests digests;
    SyntheticJob first(3, 0);
    REQUIRE(publish(digests, first, 10, {kGood, kGood, kBad}, same_set(3), clock).size() == 1);
    // Generation 1 resumed from an earlier checkpoint and redoes step 10.
    SyntheticJob second(3, 1);
    CHECK(publish(digests, second, 10, {kGood, kGood, kGood}, same_set(3), clock).empty());
    CHECK(digests.comparisons() == 2);
  }

  TEST_CASE("garbage boards name nobody and crash nothing") {
    for (bool plausible_header : {false, true}) {
      CAPTURE(plausible_header);
      std::mt19937_64 rng(13);
      common::FakeClock clock;
      SyntheticJob job(4);
      ReplicaDigests digests;
      for (int64_t step = 10; step <= 2000; step += 10) {
        job.sample(0).board = test::garbage_board(rng, 0, plausible_header);
        // The sane ranks agree; a garbage rank must not make them look odd.
        for (int r = 1; r < 4; ++r) job.publish_digest(r, step, kSetA, static_cast<uint64_t>(step));
        for (const auto& f : digests.observe(job.samples(), static_cast<int64_t>(rng()))) {
          CHECK(f.odd_ranks.empty());
          CHECK(f.disagreeing.empty());
        }
      }
      CHECK(digests.comparisons() > 0);
    }
  }
}

}  // namespace keel::health
