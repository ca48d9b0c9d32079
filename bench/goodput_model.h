// The goodput projection of keel-bench-goodput (bench/README.md): the share
// of wall time a synchronous run spends on training that it keeps, given
// how often it fails and what each failure and each save costs.
//
// Failures arrive at `failures_per_gpu_hour` x GPUs. Each costs what it
// takes to notice it and restart, plus the work since the state the run
// restarts from: half the interval between saves of that state on
// average. Saves cost their stall all the time. With snapshots, the
// failures after which the node's keeld lives (`memory_share`) restart
// from memory; the others from disk. First order: goodput = (1 - stall
// shares) x (1 - failure rate x mean cost), floored at 0.
#pragma once

#include <algorithm>

namespace keel::bench {

struct GoodputInputs {
  double failures_per_gpu_hour = 0;
  double memory_share = 0;  // of failures that leave the node's keeld and its snapshots alive
  double detect_s = 0;      // beyond what the restart figures include
  double restart_disk_s = 0;
  double restart_memory_s = 0;
  double step_s = 0;
  double checkpoint_every_s = 0;
  double checkpoint_stall_s = 0;  // per save
  double snapshot_every_steps = 1;
  double snapshot_stall_share = 0;  // of the step time
};

struct Goodput {
  double disk_only = 0;
  double with_snapshots = 0;
};

// What a run keeps of its wall time when saves stall it `stall_share` of
// the time and failures arrive `failures_per_s`, each costing `cost_s`.
inline double kept_share(double stall_share, double failures_per_s, double cost_s) {
  return std::max(0.0, (1 - stall_share) * (1 - failures_per_s * cost_s));
}

inline Goodput project_goodput(const GoodputInputs& in, double gpus) {
  const double failures_per_s = in.failures_per_gpu_hour * gpus / 3600.0;
  const double checkpoint_share = in.checkpoint_stall_s / in.checkpoint_every_s;
  const double disk_cost = in.detect_s + in.restart_disk_s + in.checkpoint_every_s / 2;
  const double memory_cost = in.detect_s + in.restart_memory_s + in.snapshot_every_steps * in.step_s / 2;
  const double mixed_cost = in.memory_share * memory_cost + (1 - in.memory_share) * disk_cost;
  return {kept_share(checkpoint_share, failures_per_s, disk_cost),
          kept_share(checkpoint_share + in.snapshot_stall_share, failures_per_s, mixed_cost)};
}

}  // namespace keel::bench
