// Who may use the control socket, asked of a real ControlServer by real
// processes: the groups that count are the ones the kernel gives the
// connecting process (SO_PEERGROUPS), not the ones the user database lists.
#include "daemon/control_server.h"
#include "tests/daemon/control_client.h"
#include "tests/support/temp_dir.h"

#include <doctest/doctest.h>
#include <grp.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace keel::test {
namespace {

// What a process running as `who` hears back from a control server in this
// process whose control group is `group`.
nlohmann::json reply_as(const Identity& who, const std::string& group) {
  TempDir dir;
  // The other user must reach the socket to be judged by the server rather
  // than refused by the filesystem.
  std::filesystem::permissions(dir.path(), std::filesystem::perms::owner_all | std::filesystem::perms::group_exec |
                                               std::filesystem::perms::others_exec);
  const std::string socket = (dir / "keeld.sock").string();
  boost::asio::io_context io;
  daemon::ControlServer server(io, daemon::ControlServerOptions{socket, group},
                               [](const daemon::Request&) { return nlohmann::json{{"ok", true}}; });
  std::thread loop([&io] { io.run(); });
  const std::string reply = status_reply_as(who, socket);
  io.stop();
  loop.join();
  INFO(reply);
  const auto parsed = nlohmann::json::parse(reply, nullptr, false);
  REQUIRE(parsed.is_object());
  return parsed;
}

bool allowed(const nlohmann::json& reply) { return reply.at("ok") == true; }

struct Group {
  std::string name;
  gid_t gid = 0;
};

// A group that exists by name, is not `primary` and does not list `user`.
std::optional<Group> group_without(const std::string& user, gid_t primary) {
  std::optional<Group> found;
  setgrent();
  while (const group* g = getgrent()) {
    if (g->gr_gid == 0 || g->gr_gid == primary) continue;
    bool listed = false;
    for (char** member = g->gr_mem; *member != nullptr; ++member) listed = listed || user == *member;
    if (!listed) {
      found = Group{g->gr_name, g->gr_gid};
      break;
    }
  }
  endgrent();
  return found;
}

// A user (not root, not us) that the group database lists as a
// supplementary member of `group`.
struct ListedMember {
  std::string user;
  uid_t uid = 0;
  gid_t primary = 0;
  Group group;
};
std::optional<ListedMember> listed_member() {
  std::optional<ListedMember> found;
  setgrent();
  while (const group* g = getgrent()) {
    for (char** member = g->gr_mem; *member != nullptr && !found; ++member) {
      const passwd* user = getpwnam(*member);
      if (user != nullptr && user->pw_uid != 0 && user->pw_uid != geteuid() && user->pw_gid != g->gr_gid) {
        found = ListedMember{*member, user->pw_uid, user->pw_gid, Group{g->gr_name, g->gr_gid}};
      }
    }
    if (found) break;
  }
  endgrent();
  return found;
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("a peer's credentials come from the kernel with every supplementary group") {
    // The peer of one end of a socket pair is this process.
    auto ours = [] {
      int fds[2];
      REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
      const auto peer = daemon::peer_credentials(fds[0]);
      close(fds[0]);
      close(fds[1]);
      REQUIRE(peer.has_value());
      return *peer;
    };
    std::vector<gid_t> groups(static_cast<size_t>(getgroups(0, nullptr)));
    REQUIRE(getgroups(static_cast<int>(groups.size()), groups.data()) == static_cast<int>(groups.size()));
    daemon::PeerCredentials peer = ours();
    CHECK(peer.pid == getpid());
    CHECK(peer.uid == geteuid());
    CHECK(peer.gid == getegid());
    std::sort(groups.begin(), groups.end());
    std::sort(peer.groups.begin(), peer.groups.end());
    CHECK(peer.groups == groups);

    if (geteuid() != 0) {
      MESSAGE("skipped: more groups than the first read holds needs root to set them");
      return;
    }
    // More groups than the first read has room for: the list is read again.
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      int code = 3;  // a failed REQUIRE: the child must not run on into the other tests
      try {
        std::vector<gid_t> many(300);
        for (size_t i = 0; i < many.size(); ++i) many[i] = static_cast<gid_t>(50000 + i);
        if (setgroups(many.size(), many.data()) != 0) _exit(2);
        daemon::PeerCredentials mine = ours();
        std::sort(mine.groups.begin(), mine.groups.end());
        code = mine.groups == many ? 0 : 1;
      } catch (...) {
      }
      _exit(code);
    }
    int status = 0;
    REQUIRE(waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
}

TEST_SUITE("integration") {
  TEST_CASE("a process whose kernel groups hold the control group may use the socket though the user database does not list it") {
    if (geteuid() != 0) {
      MESSAGE("skipped: taking another user's identity needs root");
      return;
    }
    const uid_t nobody = 65534;
    const auto control = group_without("nobody", nobody);
    if (!control) {
      MESSAGE("skipped: the group database has no group that nobody is not listed in");
      return;
    }
    INFO("control group " << control->name);
    CHECK(allowed(reply_as({nobody, nobody, {control->gid}}, control->name)));
    const auto refused = reply_as({nobody, nobody, {}}, control->name);
    CHECK_FALSE(allowed(refused));
    CHECK(refused.at("error").get<std::string>().find("permission denied: uid 65534") != std::string::npos);
  }

  TEST_CASE("a user listed in the control group whose process dropped that group is refused") {
    if (geteuid() != 0) {
      MESSAGE("skipped: taking another user's identity needs root");
      return;
    }
    const auto member = listed_member();
    if (!member) {
      MESSAGE("skipped: the group database lists no user as a supplementary member of a group");
      return;
    }
    INFO("user " << member->user << " listed in group " << member->group.name);
    const auto refused = reply_as({member->uid, member->primary, {}}, member->group.name);
    CHECK_FALSE(allowed(refused));
    CHECK(refused.at("error").get<std::string>().find("permission denied") != std::string::npos);
    CHECK(allowed(reply_as({member->uid, member->primary, {member->group.gid}}, member->group.name)));
  }
}

}  // namespace keel::test
