// Threads with names, as `top -H`, `ps -L` and /proc/<pid>/task/<tid>/comm
// show them, so that an operator (or a test reading schedstat) can tell
// which of a rank's or keeld's threads takes the CPU; the threads libraries
// start (Gloo's, OpenBLAS's) keep the process's name. Linux keeps the first
// 15 characters.
#pragma once

#include <pthread.h>

#include <string>
#include <thread>
#include <utility>

namespace keel::common {

inline void name_this_thread(const std::string& name) {
  ::pthread_setname_np(::pthread_self(), name.substr(0, 15).c_str());
}

// A std::thread named `name` that runs `body`.
template <class Body>
std::thread named_thread(std::string name, Body body) {
  return std::thread([name = std::move(name), body = std::move(body)]() mutable {
    name_this_thread(name);
    body();
  });
}

}  // namespace keel::common
