#include "checkpoint/parallel_copy.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

namespace keel::checkpoint {

void parallel_copy(const std::vector<CopyJob>& jobs, unsigned threads) {
  // Chunks big enough that scheduling costs nothing, small enough to
  // balance tensors of very different sizes.
  constexpr size_t kChunk = size_t{8} << 20;
  std::vector<CopyJob> chunks;
  for (const CopyJob& job : jobs) {
    for (size_t at = 0; at < job.bytes; at += kChunk) {
      chunks.push_back(CopyJob{static_cast<std::byte*>(job.dst) + at, static_cast<const std::byte*>(job.src) + at,
                               std::min(kChunk, job.bytes - at)});
    }
  }
  parallel_each(chunks.size(), threads,
                [&](size_t i) { std::memcpy(chunks[i].dst, chunks[i].src, chunks[i].bytes); });
}

void parallel_each(size_t count, unsigned threads, const std::function<void(size_t)>& work) {
  if (threads == 0) {
    // The CPUs this process may run on (keeld pins each rank to its share),
    // not every CPU of the machine.
    cpu_set_t cpus;
    threads = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? static_cast<unsigned>(CPU_COUNT(&cpus))
                                                             : std::thread::hardware_concurrency();
    threads = std::max(1u, threads);
  }
  threads = static_cast<unsigned>(std::min<size_t>(threads, count));
  std::atomic<size_t> next{0};
  auto loop = [&] {
    for (size_t i = next++; i < count; i = next++) work(i);
  };
  std::vector<std::thread> helpers;
  for (unsigned t = 1; t < threads; ++t) helpers.emplace_back(loop);
  loop();
  for (auto& h : helpers) h.join();
}

}  // namespace keel::checkpoint
