// The pure parts of keeld: request parsing, who may use the control
// socket, how CPUs are shared among ranks.
#include "daemon/control_server.h"
#include "daemon/protocol.h"
#include "daemon/rank_spawner.h"

#include <doctest/doctest.h>
#include <unistd.h>

#include <string>
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
