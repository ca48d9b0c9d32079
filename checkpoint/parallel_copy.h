// The snapshot copy into the staging buffer, on every core, and the loop
// under it, which the in-memory snapshots' hashing shares. It is the only
// stall training pays for a checkpoint, and one core moves about half of
// what the memory system can (measured on the CI machine: a 2 GiB snapshot
// in 32 MiB tensors took 0.25 s on one thread, 0.08 s on two).
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

namespace keel::checkpoint {

struct CopyJob {
  void* dst;
  const void* src;
  size_t bytes;
};

// Copies every job, split into chunks over `threads` threads (0: every CPU
// this process may run on).
void parallel_copy(const std::vector<CopyJob>& jobs, unsigned threads = 0);

// Calls work(i) for every i below `count`, over `threads` threads (0: as
// above), each taking the next i when done with one.
void parallel_each(size_t count, unsigned threads, const std::function<void(size_t)>& work);

}  // namespace keel::checkpoint
