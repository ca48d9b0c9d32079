#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace keel::test {

struct ProcessResult {
  int exit_code = -1;   // exit status, or 128 + signal when killed
  std::string output;   // stdout and stderr together
};

// Runs a program as a real child process (fork/exec, no shell), waits for it
// and returns its exit status and output. `env` entries are added to the
// inherited environment. Gives up and kills it after timeout_s.
ProcessResult run_process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {},
                          double timeout_s = 300);

// A keel executable from the build tree this test was built in.
std::filesystem::path keel_binary(const std::string& name);

// The source tree this test was built from.
std::filesystem::path keel_source_dir();

}  // namespace keel::test
