#include "tests/support/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <stdexcept>

namespace keel::test {

ChildProcess::ChildProcess(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env) {
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
  const pid_t parent = getpid();
  pid_ = fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    // A test killed by ctest's timeout runs no destructor: without this its
    // etcd members and keelds would live on and hold their ports.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the test died before prctl took
    dup2(pipe_fds[1], STDOUT_FILENO);
    dup2(pipe_fds[1], STDERR_FILENO);
    for (const auto& [key, value] : env) setenv(key.c_str(), value.c_str(), 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    _exit(127);
  }
  close(pipe_fds[1]);
  output_fd_ = pipe_fds[0];
}

ChildProcess::~ChildProcess() {
  if (!reaped_) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (output_fd_ >= 0) close(output_fd_);
}

void ChildProcess::signal(int signo) { kill(pid_, signo); }

ProcessResult ChildProcess::wait(double timeout_s) {
  ProcessResult result;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  bool killed = false;
  char buffer[4096];
  for (;;) {
    pollfd pfd{output_fd_, POLLIN, 0};
    if (poll(&pfd, 1, 200) > 0) {
      ssize_t n = read(output_fd_, buffer, sizeof(buffer));
      if (n <= 0) break;
      result.output.append(buffer, static_cast<size_t>(n));
    }
    if (!killed && std::chrono::steady_clock::now() > deadline) {
      kill(pid_, SIGKILL);
      killed = true;
      result.output += "\n[ChildProcess: killed after timeout]\n";
    }
  }
  int status = 0;
  waitpid(pid_, &status, 0);
  reaped_ = true;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

ProcessResult run_process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                          double timeout_s) {
  return ChildProcess(argv, env).wait(timeout_s);
}

std::string run_in_child(const std::function<std::string()>& body) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
  const pid_t child = fork();
  if (child < 0) throw std::runtime_error("fork failed");
  if (child == 0) {
    close(fds[0]);
    std::string text;
    try {
      text = body();
    } catch (const std::exception& e) {
      text = std::string("exception: ") + e.what();
    }
    (void)!write(fds[1], text.data(), text.size());
    _exit(0);
  }
  close(fds[1]);
  std::string text;
  char chunk[4096];
  ssize_t n;
  while ((n = read(fds[0], chunk, sizeof(chunk))) > 0) text.append(chunk, static_cast<size_t>(n));
  close(fds[0]);
  waitpid(child, nullptr, 0);
  return text;
}

nlohmann::json last_json_line(const std::string& output) {
  const auto end = output.find_last_not_of('\n');
  if (end == std::string::npos) throw std::runtime_error("the process printed nothing");
  const auto start = output.rfind('\n', end);
  const auto first = start == std::string::npos ? 0 : start + 1;
  return nlohmann::json::parse(output.substr(first, end - first + 1));
}

std::filesystem::path keel_binary(const std::string& name) {
  const char* moved = std::getenv("KEEL_BIN_DIR");
  return std::filesystem::path(moved != nullptr && *moved != '\0' ? moved : KEEL_BIN_DIR) / name;
}

}  // namespace keel::test
