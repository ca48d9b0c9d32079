#include "common/error.h"
#include "trainer/train/worker_env.h"

#include <doctest/doctest.h>

#include <map>
#include <string>

using keel::trainer::WorkerEnv;

namespace {

const std::string kSecret(64, 'a');

WorkerEnv read_env(const std::map<std::string, std::string>& vars) {
  return WorkerEnv::read([&vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("without the worker environment a trainer is a single rank") {
    WorkerEnv env = read_env({});
    CHECK(env.rank == 0);
    CHECK(env.world_size == 1);
    CHECK(env.local_world_size == 1);
    CHECK(env.generation == 0);
    CHECK(env.bind_address == "127.0.0.1");
    CHECK_FALSE(env.run_dir.has_value());
    CHECK_FALSE(env.snapshot_fd.has_value());
    CHECK_FALSE(env.snapshot_buddy);
  }

  TEST_CASE("the full worker environment is read as keeld sets it") {
    WorkerEnv env = read_env({{"KEEL_RANK", "5"},
                              {"KEEL_WORLD_SIZE", "8"},
                              {"KEEL_LOCAL_RANK", "1"},
                              {"KEEL_LOCAL_WORLD_SIZE", "4"},
                              {"KEEL_GENERATION", "3"},
                              {"KEEL_STORE", "tcp://127.0.0.1:29500"},
                              {"KEEL_STORE_SECRET", kSecret},
                              {"KEEL_BOARD", "/keel-board-5"},
                              {"KEEL_BIND_ADDRESS", "10.1.2.3"},
                              {"KEEL_RUN_DIR", "/runs/a"},
                              {"KEEL_SNAPSHOT_FD", "3"},
                              {"KEEL_SNAPSHOT_BUDDY", "1"}});
    CHECK(env.rank == 5);
    CHECK(env.world_size == 8);
    CHECK(env.local_rank == 1);
    CHECK(env.local_world_size == 4);
    CHECK(env.generation == 3);
    CHECK(env.store == "tcp://127.0.0.1:29500");
    CHECK(env.store_secret == kSecret);
    CHECK(env.board == "/keel-board-5");
    CHECK(env.bind_address == "10.1.2.3");
    CHECK(env.run_dir == "/runs/a");
    CHECK(env.snapshot_fd == 3);
    CHECK(env.snapshot_buddy);
  }

  TEST_CASE("ranks on an etcd store need no TCP store secret and take etcd's credential as it is") {
    WorkerEnv env = read_env({{"KEEL_RANK", "1"}, {"KEEL_WORLD_SIZE", "2"}, {"KEEL_STORE", "etcd://10.0.0.1:2379/keel/a"}});
    CHECK(env.store == "etcd://10.0.0.1:2379/keel/a");
    CHECK(env.store_secret.empty());
    env = read_env({{"KEEL_WORLD_SIZE", "2"}, {"KEEL_STORE", "etcd://h:1"}, {"KEEL_STORE_SECRET", "keel:hunter2"}});
    CHECK(env.store_secret == "keel:hunter2");
  }

  TEST_CASE("a malformed worker environment is a config error naming the variable") {
    struct Row {
      std::map<std::string, std::string> vars;
      const char* expected;
    };
    const Row rows[] = {
        {{{"KEEL_RANK", "two"}}, "KEEL_RANK=two is not an integer"},
        {{{"KEEL_RANK", "3x"}}, "KEEL_RANK=3x is not an integer"},
        {{{"KEEL_WORLD_SIZE", "0"}}, "KEEL_WORLD_SIZE=0 is outside"},
        {{{"KEEL_RANK", "-1"}}, "KEEL_RANK=-1 is outside"},
        {{{"KEEL_RANK", "99999999999999999999"}}, "KEEL_RANK=99999999999999999999 is not an integer"},
        {{{"KEEL_RANK", "2"}, {"KEEL_WORLD_SIZE", "2"}, {"KEEL_STORE", "tcp://h:1"}, {"KEEL_STORE_SECRET", kSecret}},
         "must be below KEEL_WORLD_SIZE=2"},
        {{{"KEEL_WORLD_SIZE", "2"}}, "needs KEEL_STORE,"},
        {{{"KEEL_WORLD_SIZE", "2"}, {"KEEL_STORE", "tcp://h:1"}}, "needs KEEL_STORE_SECRET"},
        {{{"KEEL_WORLD_SIZE", "2"}, {"KEEL_STORE", "tcp://h:1"}, {"KEEL_STORE_SECRET", ""}}, "needs KEEL_STORE_SECRET"},
        {{{"KEEL_WORLD_SIZE", "2"}, {"KEEL_STORE", "tcp://h:1"}, {"KEEL_STORE_SECRET", "hunter2"}},
         "KEEL_STORE_SECRET is not a store secret: it has 7 characters"},
        {{{"KEEL_STORE_SECRET", std::string(64, 'G')}}, "KEEL_STORE_SECRET is not a store secret: it has characters"},
        {{{"KEEL_WORLD_SIZE", "2"}, {"KEEL_LOCAL_WORLD_SIZE", "4"}, {"KEEL_STORE", "tcp://h:1"},
          {"KEEL_STORE_SECRET", kSecret}},
         "KEEL_LOCAL_WORLD_SIZE=4 exceeds"},
        {{{"KEEL_LOCAL_RANK", "1"}, {"KEEL_LOCAL_WORLD_SIZE", "1"}}, "KEEL_LOCAL_RANK=1 must be below"},
        {{{"KEEL_GENERATION", "-4"}}, "KEEL_GENERATION=-4 is outside"},
        {{{"KEEL_BIND_ADDRESS", ""}}, "KEEL_BIND_ADDRESS='' is not an address"},
        {{{"KEEL_BIND_ADDRESS", "10.0.0.1 10.0.0.2"}}, "KEEL_BIND_ADDRESS='10.0.0.1 10.0.0.2' is not an address"},
        {{{"KEEL_SNAPSHOT_FD", "1"}}, "KEEL_SNAPSHOT_FD=1 is outside"},
        {{{"KEEL_SNAPSHOT_FD", "area"}}, "KEEL_SNAPSHOT_FD=area is not an integer"},
        {{{"KEEL_SNAPSHOT_FD", "3"}, {"KEEL_SNAPSHOT_BUDDY", "2"}}, "KEEL_SNAPSHOT_BUDDY=2 is outside [0, 1]"},
        {{{"KEEL_SNAPSHOT_BUDDY", "1"}}, "KEEL_SNAPSHOT_BUDDY=1 needs KEEL_SNAPSHOT_FD"},
    };
    for (const Row& row : rows) {
      CAPTURE(row.expected);
      try {
        read_env(row.vars);
        FAIL("accepted");
      } catch (const keel::common::Error& e) {
        CHECK(e.code() == keel::common::ErrorCode::kBadConfig);
        CHECK(std::string(e.what()).find(row.expected) != std::string::npos);
        CHECK(std::string(e.what()).find("hunter2") == std::string::npos);
      }
    }
  }
}
