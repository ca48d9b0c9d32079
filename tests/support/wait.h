// Waiting for a condition instead of for a time: the tests share a loaded
// machine, so nothing may assume how fast a run, a daemon or a thread gets
// somewhere.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <thread>

namespace keel::test {

// Polls `done` every few milliseconds until it holds: true then, false once
// timeout_s has passed without it (a deadline for a failure, not a pace).
inline bool wait_until(const std::function<bool()>& done, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

// The whole lines of a file another process may be appending to: its
// newlines (0 before it exists).
inline int64_t complete_lines(const std::filesystem::path& path) {
  std::ifstream in(path);
  return std::count(std::istreambuf_iterator<char>(in), {}, '\n');
}

}  // namespace keel::test
