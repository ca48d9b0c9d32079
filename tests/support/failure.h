// How a call failed: its keel error code (none if it did not fail), the
// message and how long it took, for tests of timeouts and typed errors.
#pragma once

#include "common/error.h"

#include <chrono>
#include <functional>
#include <optional>
#include <string>

namespace keel::test {

struct Failure {
  std::optional<common::ErrorCode> code;
  std::string message;
  std::chrono::milliseconds elapsed{0};
};

inline Failure failure_of(const std::function<void()>& call) {
  const auto start = std::chrono::steady_clock::now();
  auto since_start = [&] {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  };
  try {
    call();
  } catch (const common::Error& e) {
    return {e.code(), e.what(), since_start()};
  }
  return {std::nullopt, "the call did not fail", since_start()};
}

inline std::string describe(const Failure& f) {
  return std::string(f.code ? common::error_code_name(*f.code) : "no error") + " after " +
         std::to_string(f.elapsed.count()) + " ms: " + f.message;
}

inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace keel::test
