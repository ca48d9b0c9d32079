// keeld's reading of events.jsonl on its own: the generations and the
// checkpoints rank 0 committed or abandoned, taken in as the log grows,
// half-written lines and garbage included, and the tally of loss spikes and
// skipped steps.
#include "daemon/run_history.h"
#include "tests/support/temp_dir.h"

#include <doctest/doctest.h>

#include <fstream>
#include <string>

namespace keel::daemon {

TEST_SUITE("unit") {
  TEST_CASE("the run history follows the event log and keeps each generation's checkpoints") {
    test::TempDir dir;
    RunHistory history(dir.path());
    history.refresh();  // no log yet: a new run
    CHECK(history.last_generation() == -1);
    CHECK(history.newest_committed() == -1);

    auto append = [&](const std::string& text) {
      std::ofstream(dir / "events.jsonl", std::ios::app) << text;
      history.refresh();
    };
    append(R"({"kind":"generation_started","generation":0,"rank":-1})" "\n"
           R"({"kind":"checkpoint_committed","generation":0,"rank":0,"step":5})" "\n"
           R"({"kind":"checkpoint_committed","generation":0,"rank":0,"step":10})" "\n");
    CHECK(history.last_generation() == 0);
    CHECK(history.committed_in(0) == 10);
    CHECK(history.committed_in(1) == -1);
    CHECK(history.newest_committed() == 10);

    // Half a line is taken once its newline arrives.
    append(R"({"kind":"checkpoint_abandoned","generation":1,"rank":0,"step":15,)");
    CHECK(history.last_generation() == 0);
    CHECK(history.abandoned_in(1).empty());
    append(R"("cause":"rank-00001.h5: File too large"})" "\n");
    CHECK(history.last_generation() == 1);
    CHECK(history.abandoned_in(1) == "rank-00001.h5: File too large");
    CHECK(history.committed_in(1) == -1);
    CHECK(history.newest_committed() == 10);

    // An abandoned save followed by a newer commit is no longer the last word.
    append(R"({"kind":"checkpoint_committed","generation":1,"rank":0,"step":20})" "\n");
    CHECK(history.committed_in(1) == 20);
    CHECK(history.abandoned_in(1).empty());
    CHECK(history.newest_committed() == 20);

    // Lines that are not events change nothing.
    append("garbage\n[1,2]\n{\"kind\":\"checkpoint_committed\",\"generation\":\"two\",\"step\":30}\n"
           "{\"kind\":7,\"generation\":2,\"step\":30}\n{\"kind\":\"checkpoint_committed\",\"generation\":2}\n");
    CHECK(history.last_generation() == 2);
    CHECK(history.committed_in(2) == -1);
    CHECK(history.newest_committed() == 20);

    // A second reader of the same log sees the same history at once.
    RunHistory again(dir.path());
    again.refresh();
    CHECK(again.last_generation() == 2);
    CHECK(again.committed_in(0) == 10);
    CHECK(again.committed_in(1) == 20);
  }

  TEST_CASE("checkpoints keeld moved aside as suspect leave the run history") {
    test::TempDir dir;
    RunHistory history(dir.path());
    std::ofstream(dir / "events.jsonl")
        << R"({"kind":"checkpoint_committed","generation":0,"rank":0,"step":5})" "\n"
           R"({"kind":"checkpoint_committed","generation":1,"rank":0,"step":10})" "\n"
           R"({"kind":"checkpoint_committed","generation":1,"rank":0,"step":15})" "\n"
           R"({"kind":"checkpoint_abandoned","generation":1,"rank":0,"step":20,"cause":"killed"})" "\n"
           R"({"kind":"checkpoint_quarantined","generation":1,"rank":-1,"last_good_step":8,"steps":[10,15]})" "\n";
    history.refresh();
    CHECK(history.committed_in(0) == 5);
    CHECK(history.committed_in(1) == -1);
    CHECK(history.newest_committed() == 5);
    CHECK(history.abandoned_in(1) == "killed");
    // The next generation commits the same step again.
    std::ofstream(dir / "events.jsonl", std::ios::app)
        << R"({"kind":"checkpoint_committed","generation":2,"rank":0,"step":10})" "\n"
           R"({"kind":"checkpoint_quarantined","generation":2,"rank":-1,"last_good_step":"eight"})" "\n";
    history.refresh();
    CHECK(history.committed_in(2) == 10);
    CHECK(history.newest_committed() == 10);
  }

  TEST_CASE("loss spikes and skipped steps are tallied once per step however many generations replayed it") {
    test::TempDir dir;
    RunHistory history(dir.path());
    history.refresh();
    CHECK(history.loss_spikes().count == 0);
    CHECK(history.loss_spikes().last_step == -1);
    CHECK(history.skipped_steps().count == 0);
    std::ofstream(dir / "events.jsonl")
        << R"({"kind":"loss_spike","generation":0,"rank":-1,"step":40,"action":"skipped"})" "\n"
           R"({"kind":"step_skipped","generation":0,"rank":-1,"step":40})" "\n"
           R"({"kind":"loss_spike","generation":0,"rank":-1,"step":70,"action":"applied"})" "\n"
           // The next generation resumed from before step 40 and met it again.
           R"({"kind":"loss_spike","generation":1,"rank":-1,"step":40,"action":"skipped"})" "\n"
           R"({"kind":"step_skipped","generation":1,"rank":-1,"step":40})" "\n"
           R"({"kind":"loss_spike","generation":1,"rank":-1,"step":"forty"})" "\n"
           R"({"kind":"step_skipped","generation":1,"rank":-1})" "\n";
    history.refresh();
    CHECK(history.loss_spikes().count == 2);
    CHECK(history.loss_spikes().last_step == 70);
    CHECK(history.skipped_steps().count == 1);
    CHECK(history.skipped_steps().last_step == 40);
  }
}

}  // namespace keel::daemon
