// Asking keeld's control socket as another user, for the tests of who may
// use it (root only: taking an identity needs CAP_SETUID and CAP_SETGID).
#pragma once

#include "daemon/protocol.h"

#include <doctest/doctest.h>
#include <grp.h>
#include <sys/wait.h>
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
  int pipe_fds[2];
  REQUIRE(pipe(pipe_fds) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    close(pipe_fds[0]);
    std::string reply;
    if (setgroups(who.groups.size(), who.groups.data()) == 0 && setgid(who.gid) == 0 && setuid(who.uid) == 0) {
      try {
        reply = daemon::call_daemon(socket, daemon::Request{}, std::chrono::seconds(30)).dump();
      } catch (const std::exception& e) {
        reply = std::string("exception: ") + e.what();
      }
    } else {
      reply = std::string("could not take the identity: ") + std::strerror(errno);
    }
    (void)!write(pipe_fds[1], reply.data(), reply.size());
    _exit(0);
  }
  close(pipe_fds[1]);
  std::string reply;
  char chunk[4096];
  ssize_t n;
  while ((n = read(pipe_fds[0], chunk, sizeof(chunk))) > 0) reply.append(chunk, static_cast<size_t>(n));
  close(pipe_fds[0]);
  waitpid(child, nullptr, 0);
  return reply;
}

}  // namespace keel::test
