// The pure parts of keeld: request parsing, who may use the control
// socket, how CPUs are shared among ranks.
#include "daemon/control_server.h"
#include "daemon/protocol.h"
#include "daemon/rank_spawner.h"

#include <doctest/doctest.h>
#include <unistd.h>

#include <string>
#include <utility>
#include <vector>

namespace keel::daemon {

TEST_SUITE("unit") {
  TEST_CASE("control requests parse into commands and bad ones are refused with a reason") {
    struct Good {
      std::string line;
      Command command;
      int64_t limit;
      bool checkpoint;
    };
    const std::vector<Good> good = {
        {R"({"command": "status"})", Command::kStatus, 20, true},
        {R"({"command": "events", "limit": 5})", Command::kEvents, 5, true},
        {R"({"command": "checkpoint_now"})", Command::kCheckpointNow, 20, true},
        {R"({"command": "stop", "checkpoint": false})", Command::kStop, 20, false},
        {R"({"command": "restart"})", Command::kRestart, 20, true},
    };
    for (const auto& g : good) {
      INFO(g.line);
      const Request r = parse_request(g.line);
      CHECK(r.command == g.command);
      CHECK(r.limit == g.limit);
      CHECK(r.checkpoint == g.checkpoint);
      // What keelctl sends parses back to the same request.
      std::string line = request_line(r);
      line.pop_back();
      CHECK(parse_request(line).command == g.command);
    }
    struct Bad {
      std::string line;
      std::string says;
    };
    const std::vector<Bad> bad = {
        {"", "not a JSON line"},
        {"status", "not a JSON line"},
        {"[1]", "must be a JSON object"},
        {"{}", "needs \"command\""},
        {R"({"command": 1})", "needs \"command\""},
        {R"({"command": "reboot"})", "unknown command"},
        {R"({"command": "status", "limit": 3})", "unknown field"},
        {R"({"command": "events", "limit": 0})", "\"limit\" must be"},
        {R"({"command": "events", "limit": 2.5})", "\"limit\" must be"},
        {R"({"command": "stop", "checkpoint": 1})", "\"checkpoint\" must be"},
    };
    for (const auto& b : bad) {
      INFO(b.line);
      try {
        parse_request(b.line);
        FAIL("accepted");
      } catch (const ProtocolError& e) {
        CHECK(std::string(e.what()).find(b.says) != std::string::npos);
      }
    }
  }

  TEST_CASE("the health commands parse and inject requests carry their fault or a reason why not") {
    for (const auto& [line, command] : {std::pair{R"({"command": "health"})", Command::kHealth},
                                        {R"({"command": "diagnose"})", Command::kDiagnose},
                                        {R"({"command": "stragglers"})", Command::kStragglers}}) {
      CAPTURE(line);
      CHECK(parse_request(line).command == command);
    }
    const Request hang = parse_request(R"({"command": "inject", "kind": "hang", "rank": 1, "step": 30, "group": "tp"})");
    CHECK(hang.command == Command::kInject);
    CHECK(hang.fault.kind == "hang");
    CHECK(hang.fault.rank == 1);
    CHECK(hang.fault.step == 30);
    CHECK(hang.fault.group == "tp");
    CHECK(!hang.fault.factor);
    const Request flip = parse_request(
        R"({"command": "inject", "kind": "bitflip", "rank": 2, "bit": 30, "target": "exp_avg", "tensor": "wte"})");
    CHECK(flip.fault.bit == 30);
    CHECK(flip.fault.target == "exp_avg");
    CHECK(flip.fault.tensor == "wte");
    CHECK(!flip.fault.step);
    // What keelctl sends parses back to the same fault.
    for (const Request& r : {hang, flip, parse_request(R"({"command": "inject", "kind": "slow", "factor": 1.5})")}) {
      std::string line = request_line(r);
      line.pop_back();
      const Request back = parse_request(line);
      CHECK(fault_json(back.fault) == fault_json(r.fault));
    }

    struct Bad {
      std::string line;
      std::string says;
    };
    const std::vector<Bad> bad = {
        {R"({"command": "inject"})", "needs \"kind\""},
        {R"({"command": "inject", "kind": "meteor"})", "unknown fault \"meteor\"; faults: crash, hang, slow"},
        {R"({"command": "inject", "kind": 3})", "\"kind\" must be a string"},
        {R"({"command": "inject", "kind": "crash", "rank": "one"})", "\"rank\" must be an integer"},
        {R"({"command": "inject", "kind": "crash", "rank": -1})", "--rank must be a rank"},
        {R"({"command": "inject", "kind": "crash", "step": -3})", "--step must be 0 or more"},
        {R"({"command": "inject", "kind": "crash", "step": 2.5})", "\"step\" must be an integer"},
        {R"({"command": "inject", "kind": "hang", "factor": 2})", "--factor applies to slow only"},
        {R"({"command": "inject", "kind": "slow"})", "slow needs --factor"},
        {R"({"command": "inject", "kind": "slow", "factor": 0.5})", "--factor must be a number more than 1"},
        {R"({"command": "inject", "kind": "slow", "factor": "fast"})", "\"factor\" must be a number"},
        {R"({"command": "inject", "kind": "bitflip", "bit": 32})", "--bit must be a bit of a float32"},
        {R"({"command": "inject", "kind": "bitflip", "target": "loss"})", "--target of bitflip must be one of param"},
        {R"({"command": "inject", "kind": "nan", "target": "param"})", "--target of nan must be one of gradient, loss"},
        {R"({"command": "inject", "kind": "crash", "target": "param"})", "--target applies to bitflip and nan only"},
        {R"({"command": "inject", "kind": "nan", "bit": 3})", "--bit applies to bitflip only"},
        {R"({"command": "inject", "kind": "hang", "group": ""})", "--group must name a mesh axis"},
        {R"({"command": "inject", "kind": "hang", "group": "a_group_name_too_long"})", "--group must name a mesh axis"},
        {R"({"command": "inject", "kind": "bitflip", "tensor": ")" + std::string(64, 'w') + R"("})",
         "--tensor must name a tensor"},
        {R"({"command": "inject", "kind": "slow", "factor": 2, "tensor": "wte"})", "--tensor applies to bitflip only"},
        {R"({"command": "inject", "kind": "crash", "limit": 3})", "unknown field for command inject"},
        {R"({"command": "health", "kind": "hang"})", "unknown field for command health"},
    };
    for (const auto& b : bad) {
      CAPTURE(b.line);
      try {
        parse_request(b.line);
        FAIL("accepted");
      } catch (const ProtocolError& e) {
        CAPTURE(e.what());
        CHECK(std::string(e.what()).find(b.says) != std::string::npos);
      }
    }
  }

  TEST_CASE("a fault is refused for a rank or group the job does not have or a step that has passed") {
    common::ParallelConfig layout;
    layout.dp = 2;
    layout.tp = 2;
    struct Case {
      FaultSpec spec;
      int64_t steps_done;
      std::string refused;  // a part of the sentence; empty: accepted
    };
    auto spec = [](std::string kind, int64_t rank, std::optional<int64_t> step = {}, std::optional<int64_t> bit = {},
                   std::optional<std::string> group = {}) {
      FaultSpec s;
      s.kind = std::move(kind);
      s.rank = rank;
      s.step = step;
      s.bit = bit;
      s.group = std::move(group);
      return s;
    };
    const std::vector<Case> cases = {
        {spec("hang", 1), 10, ""},
        {spec("hang", 3, 12, {}, "tp"), 10, ""},
        {spec("hang", 4), 10, "rank 4 is not a rank of this job: it has 4 ranks, 0-3"},
        {spec("hang", 0, {}, {}, "pp"), 10, "no \"pp\" group of more than one rank to hang in; groups: dp, tp"},
        {spec("crash", 0, 5), 10, "rank 0 has done 10 steps: step 5 has passed"},
        {spec("crash", 0, 5), -1, ""},  // the rank has not published yet
        {spec("bitflip", 2, 11, 30), 10, ""},
        {spec("meteor", 0), 10, "unknown fault"},
    };
    for (const auto& c : cases) {
      CAPTURE(c.spec.kind);
      CAPTURE(c.spec.rank);
      try {
        const auto request = fault_request(c.spec, 4, layout, c.steps_done);
        CHECK(c.refused.empty());
        CHECK(health::fault_kind_name(request.kind) == c.spec.kind);
        CHECK(request.step == c.spec.step.value_or(-1));
      } catch (const FaultRefused& e) {
        CAPTURE(e.what());
        CHECK(!c.refused.empty());
        CHECK(std::string(e.what()).find(c.refused) != std::string::npos);
      }
    }
    // The defaults a rank gets when keelctl leaves an option out.
    const auto flip = fault_request(spec("bitflip", 1), 4, layout, -1);
    CHECK(std::string(flip.target) == "param");
    CHECK(flip.bit == 22);
    CHECK(flip.step == -1);
    const auto hang = fault_request(spec("hang", 1), 4, layout, -1);
    CHECK(std::string(hang.group) == "dp");
    CHECK(std::string(fault_request(spec("nan", 1), 4, layout, -1).target) == "gradient");
    auto slow = spec("slow", 1);
    slow.factor = 1.25;
    CHECK(fault_request(slow, 4, layout, -1).factor == 1.25);
  }

  TEST_CASE("replies with bytes that are not UTF-8 still make one JSON line") {
    const std::string line = reply_line(error_reply(std::string("bad \xff byte")));
    CHECK(line.back() == '\n');
    CHECK(line.find('\n') == line.size() - 1);
    CHECK(nlohmann::json::parse(line).at("ok") == false);
  }

  TEST_CASE("root keeld's user and members of the control group may use the socket and nobody else") {
    const uid_t me = 1000;
    struct Case {
      PeerCredentials peer;
      std::optional<gid_t> group;
      bool allowed;
    };
    const std::vector<Case> cases = {
        {{1, 0, 0, {}}, std::nullopt, true},              // root
        {{1, me, 1000, {}}, std::nullopt, true},          // keeld's own user
        {{1, 4242, 4242, {}}, std::nullopt, false},       // anyone else
        {{1, 4242, 777, {}}, gid_t{777}, true},           // primary group is the control group
        {{1, 4242, 4242, {}}, gid_t{777}, false},         // not a member
        {{1, 4242, 4242, {5, 777}}, gid_t{777}, true},    // a supplementary group of the process
        {{1, 4242, 4242, {5, 6}}, gid_t{777}, false},     // other supplementary groups only
        {{1, 4242, 4242, {777}}, std::nullopt, false},    // groups count only with a control group
    };
    for (const auto& c : cases) {
      INFO("uid " << c.peer.uid << " gid " << c.peer.gid);
      CHECK(peer_allowed(c.peer, me, c.group) == c.allowed);
    }
  }

  TEST_CASE("ranks get equal contiguous shares of the cpus and are not pinned when there are fewer cpus") {
    using Shares = std::vector<std::vector<int>>;
    CHECK(cpu_shares({0, 1, 2, 3, 4, 5, 6, 7}, 4) == Shares{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
    CHECK(cpu_shares({0, 1, 2, 3, 4}, 2) == Shares{{0, 1}, {2, 3}});
    CHECK(cpu_shares({0, 1}, 4) == Shares{{}, {}, {}, {}});
    CHECK(cpu_shares({2, 5, 9}, 3) == Shares{{2}, {5}, {9}});
    CHECK(cpu_shares({}, 2) == Shares{{}, {}});
    CHECK_FALSE(allowed_cpus().empty());
  }
}

}  // namespace keel::daemon
