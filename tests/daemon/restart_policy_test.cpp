// keeld's restart policy on its own: the back-off and the crash-loop guard
// as arithmetic on the generations' outcomes.
#include "daemon/restart_policy.h"

#include <doctest/doctest.h>

#include <string>

namespace keel::daemon {
namespace {

common::DaemonConfig daemon_config(int64_t crash_loop_generations) {
  common::DaemonConfig d;
  d.crash_loop_generations = crash_loop_generations;
  d.restart_backoff_s = 1;
  d.restart_backoff_max_s = 3;
  return d;
}

RestartPolicy::Failure stuck() { return {.cause = "rank 1 killed by SIGKILL", .checkpoint_step = 10}; }

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("the back-off doubles per generation without progress and stops at its cap") {
    RestartPolicy policy(daemon_config(10));
    CHECK(policy.after(stuck()).delay_s == 2);
    CHECK(policy.after(stuck()).delay_s == 3);
    CHECK(policy.after(stuck()).delay_s == 3);
    auto progressed = stuck();
    progressed.progressed = true;
    const auto decision = policy.after(progressed);
    CHECK_FALSE(decision.give_up);
    CHECK(decision.delay_s == 1);
  }

  TEST_CASE("K generations in a row without a checkpoint give up with the last failure in the reason") {
    RestartPolicy policy(daemon_config(3));
    CHECK_FALSE(policy.after(stuck()).give_up);
    CHECK_FALSE(policy.after(stuck()).give_up);
    const auto decision = policy.after(stuck());
    CHECK(decision.give_up);
    CHECK(decision.reason.find("crash loop: 3 generations") != std::string::npos);
    CHECK(decision.reason.find("newer than step 10") != std::string::npos);
    CHECK(decision.reason.find("rank 1 killed by SIGKILL") != std::string::npos);
  }

  TEST_CASE("a rank that refused the config or the data fails the job at once with its sentence") {
    for (const int code : {2, 3}) {
      CAPTURE(code);
      RestartPolicy policy(daemon_config(3));
      auto refused = stuck();
      refused.cause = "rank 0 exited 3 (data_error): train.bin: wrong magic";
      refused.exit_code = code;
      refused.progressed = true;
      const auto decision = policy.after(refused);
      CHECK(decision.give_up);
      CHECK(decision.reason.find(refused.cause) == 0);
      CHECK(decision.reason.find("restarting cannot help") != std::string::npos);
    }
    // Every other failure is worth a retry.
    for (const int code : {10, 11, 12, 13, 70, 128 + 9}) {
      CAPTURE(code);
      RestartPolicy policy(daemon_config(3));
      auto failure = stuck();
      failure.exit_code = code;
      CHECK_FALSE(policy.after(failure).give_up);
    }
  }

  TEST_CASE("a generation that committed a checkpoint or an operator restart starts the count afresh") {
    RestartPolicy policy(daemon_config(2));
    CHECK_FALSE(policy.after(stuck()).give_up);
    auto progressed = stuck();
    progressed.progressed = true;
    CHECK_FALSE(policy.after(progressed).give_up);
    CHECK_FALSE(policy.after(stuck()).give_up);
    policy.forgive();
    CHECK_FALSE(policy.after(stuck()).give_up);
    CHECK(policy.after(stuck()).give_up);
  }
}

}  // namespace keel::daemon
