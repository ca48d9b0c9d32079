// keeld reading a rank's last word from its log: the sentence keel-trainer
// printed before it exited, from the current generation only, and from the
// end of a log however long.
#include "daemon/rank_log.h"
#include "tests/support/temp_dir.h"

#include <doctest/doctest.h>

#include <fstream>
#include <string>

namespace keel::daemon {

TEST_SUITE("unit") {
  TEST_CASE("a rank's last sentence is the last keel-trainer error line of its newest generation") {
    test::TempDir dir;
    const auto log = rank_log_path(dir.path(), 1);
    CHECK(log.filename() == "rank-00001.log");
    std::filesystem::create_directories(log.parent_path());
    CHECK(last_error_sentence(log).empty());  // no log yet

    std::ofstream(log, std::ios::app) << rank_log_header(0, 1)
                                      << "keel-trainer: peer_failure: rank 0 left the group\n";
    CHECK(last_error_sentence(log) == "rank 0 left the group");

    // A new generation's part: the one before does not count.
    std::ofstream(log, std::ios::app) << rank_log_header(1, 1) << "[info] training\n";
    CHECK(last_error_sentence(log).empty());

    std::ofstream(log, std::ios::app)
        << "keel-trainer: data_error: train.bin: wrong magic 0 (expected 20240520)\n"
        << "keel-trainer: flight recorder written to run/flight/rank-00001.json\n"
        << "keel-trainer: not_a_code: whatever\n";
    CHECK(last_error_sentence(log) == "train.bin: wrong magic 0 (expected 20240520)");

    // Only the end of a long log is read; the sentence there is found.
    std::ofstream(log, std::ios::app) << std::string(200000, 'x') << "\n"
                                      << "keel-trainer: bad_config: tp=3 does not divide n_head=4\n";
    CHECK(last_error_sentence(log, 4096) == "tp=3 does not divide n_head=4");
    // A sentence beyond the bytes read is not.
    std::ofstream(log, std::ios::app) << std::string(8192, 'y') << "\n";
    CHECK(last_error_sentence(log, 4096).empty());
  }
}

}  // namespace keel::daemon
