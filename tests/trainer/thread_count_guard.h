// CpuBackend's constructor sets process-wide thread counts; this puts the
// previous count back when a test that changes it ends.
#pragma once

#include "trainer/kernels/cpu_backend.h"

#include <omp.h>

namespace keel::test {

class ThreadCountGuard {
 public:
  ThreadCountGuard() : saved_(omp_get_max_threads()) {}
  ~ThreadCountGuard() { trainer::CpuBackend restore(saved_); }
  ThreadCountGuard(const ThreadCountGuard&) = delete;
  ThreadCountGuard& operator=(const ThreadCountGuard&) = delete;

 private:
  int saved_;
};

}  // namespace keel::test
