#pragma once

#include <sys/types.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace keel::test {

struct ProcessResult {
  int exit_code = -1;   // exit status, or 128 + signal when killed
  std::string output;   // stdout and stderr together
};

// A program running as a real child process (fork/exec, no shell; a name
// without a slash is looked up on PATH) with its
// stdout and stderr captured together. `env` entries are added to the
// inherited environment. The destructor kills a child still running, and
// the kernel kills it when the thread that made it ends (PR_SET_PDEATHSIG),
// so a test killed mid-way leaves nothing running: make children on the
// test's own thread.
class ChildProcess {
 public:
  ChildProcess(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {});
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  void signal(int signo);
  // Reads output until the child exits, killing it after timeout_s.
  ProcessResult wait(double timeout_s = 300);

 private:
  pid_t pid_ = -1;
  int output_fd_ = -1;
  bool reaped_ = false;
};

// Runs a program to completion: ChildProcess(argv, env).wait(timeout_s).
ProcessResult run_process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {},
                          double timeout_s = 300);

// Runs `body` in a forked child process (no exec) and returns the text it
// returned, passed back through a pipe: for what must not happen to the
// test process itself, such as changing its uid or its namespaces. An
// exception from body comes back as "exception: <what>"; a child that died
// returns what it had written, usually nothing.
std::string run_in_child(const std::function<std::string()>& body);

// The last line of a process's output parsed as JSON: the summary that
// keel's programs print on stdout with --json.
nlohmann::json last_json_line(const std::string& output);

// A keel executable from the build tree this test was built in, or from
// $KEEL_BIN_DIR where the binaries were moved (scripts/gpu-check's bundle).
std::filesystem::path keel_binary(const std::string& name);

}  // namespace keel::test
