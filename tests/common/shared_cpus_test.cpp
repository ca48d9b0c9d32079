#include "common/shared_cpus.h"

#include <doctest/doctest.h>
#include <sched.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

using keel::common::format_cpu_list;
using keel::common::kSharedCpusVariable;
using keel::common::parse_cpu_list;
using keel::common::SharedCpuScope;

namespace {

std::vector<int> affinity_of_this_thread() {
  cpu_set_t set;
  REQUIRE(sched_getaffinity(0, sizeof(set), &set) == 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

void pin_this_thread(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (const int c : cpus) CPU_SET(c, &set);
  REQUIRE(sched_setaffinity(0, sizeof(set), &set) == 0);
}

// The affinity a thread started inside a SharedCpuScope gets, from a
// thread pinned to the first allowed CPU with KEEL_SHARED_CPUS = `shared`
// (unset: nullopt); and the starting thread's own after the scope.
struct Started {
  std::vector<int> inside, after;
};
Started start_pinned_thread(const std::optional<std::string>& shared) {
  Started seen;
  std::thread([&] {
    pin_this_thread({affinity_of_this_thread().front()});
    if (shared) {
      setenv(kSharedCpusVariable, shared->c_str(), 1);
    } else {
      unsetenv(kSharedCpusVariable);
    }
    {
      const SharedCpuScope scope;
      std::thread([&] { seen.inside = affinity_of_this_thread(); }).join();
    }
    seen.after = affinity_of_this_thread();
    unsetenv(kSharedCpusVariable);
  }).join();
  return seen;
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("a CPU list reads as taskset writes it and anything else reads as none") {
    struct Case {
      const char* list;
      std::optional<std::vector<int>> cpus;
    };
    const Case cases[] = {
        {"0", std::vector<int>{0}},
        {"0,1", std::vector<int>{0, 1}},
        {"0-3,8", std::vector<int>{0, 1, 2, 3, 8}},
        {"3,1,1-2", std::vector<int>{1, 2, 3}},
        {"", std::nullopt},
        {"a", std::nullopt},
        {"1-", std::nullopt},
        {"-1", std::nullopt},
        {"3-1", std::nullopt},
        {"0,", std::nullopt},
        {",0", std::nullopt},
        {"1,,2", std::nullopt},
        {"0 1", std::nullopt},
        {"99999", std::nullopt},
        {"0-99999", std::nullopt},
    };
    for (const auto& c : cases) {
      CAPTURE(c.list);
      CHECK(parse_cpu_list(c.list) == c.cpus);
    }
    CHECK(format_cpu_list({0, 2, 5}) == "0,2,5");
    CHECK(parse_cpu_list(format_cpu_list({0, 2, 5})) == std::vector<int>{0, 2, 5});
  }

  TEST_CASE("threads started in a shared CPU scope run on the shared CPUs and the starter gets its own back") {
    const std::vector<int> allowed = affinity_of_this_thread();
    const std::vector<int> first = {allowed.front()};
    const Started shared = start_pinned_thread(format_cpu_list(allowed));
    CHECK(shared.inside == allowed);
    CHECK(shared.after == first);

    // Not started by a pinning keeld, or with a list that does not parse:
    // the thread stays where its starter is.
    for (const std::optional<std::string>& value : {std::optional<std::string>(), std::optional<std::string>("x-1")}) {
      CAPTURE(value.value_or("(unset)"));
      const Started pinned = start_pinned_thread(value);
      CHECK(pinned.inside == first);
      CHECK(pinned.after == first);
    }
  }
}
