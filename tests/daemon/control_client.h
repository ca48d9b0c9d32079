// Asking keeld's control socket as another user, for the tests of who may
// use it (root only: taking an identity needs CAP_SETUID and CAP_SETGID).
#pragma once

#include "daemon/protocol.h"
#include "tests/support/process.h"

#include <grp.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

namespace keel::test {

struct Identity {
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // the supplementary groups, exactly these
};

// The reply line a forked process running as `who` gets to a status request
// on the control socket at `socket`, or a sentence saying why it got none.
inline std::string status_reply_as(const Identity& who, const std::string& socket) {
  return run_in_child([&]() -> std::string {
    if (setgroups(who.groups.size(), who.groups.data()) != 0 || setgid(who.gid) != 0 || setuid(who.uid) != 0) {
      return std::string("could not take the identity: ") + std::strerror(errno);
    }
    return daemon::call_daemon(socket, daemon::Request{}, std::chrono::seconds(30)).dump();
  });
}

}  // namespace keel::test
