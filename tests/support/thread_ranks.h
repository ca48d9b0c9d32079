// Threads of one process acting as the ranks of a group, for tests of
// communicators and of what is built on them.
#pragma once

#include <exception>
#include <functional>
#include <thread>
#include <vector>

namespace keel::test {

// Runs body(rank) on `size` threads and returns what each rank threw (null
// when it did not): no exception escapes a thread, and assertions run on the
// test's own thread.
inline std::vector<std::exception_ptr> run_ranks(int size, const std::function<void(int)>& body) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        body(rank);
      } catch (...) {
        errors[static_cast<size_t>(rank)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace keel::test
