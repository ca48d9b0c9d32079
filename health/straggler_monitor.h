// The straggler monitor (docs/architecture.md "Health": stragglers). Fed
// every poll of the boards, it gathers each rank's per-step compute time
// (StepTiming::compute_ms: the step's wall time minus collective wait, data
// time and time waiting for a CPU, so the ranks that wait for a slow one are
// not blamed: their wait rises, their compute does not) and judges the ranks
// against each other, with no collective in the training stream.
//
// Each step that every running rank (with a trusted board, rank_sample.h)
// has timed gives each rank x = log(its compute / the step's median
// rank's): a load that slows every rank at once cancels out step by step.
// A rank's evidence is two CUSUMs of those (tiers); the steady tier's is
//   S = min(h, max(0, S + clamp(x - c, -U, U) - k)),
// where c is the normal level of the rank's pipeline stage (the median over
// the stage's ranks of each one's median x over the last 200 steps),
// k = log(1 + `straggler_threshold`) is the
// slowness a rank may have for free, and U = 2.5k bounds what one step may
// add or take (a preempted step counts as a slow one, not as ten; a 1.10x
// rank's steps, 1.7-2.5k above the median, mostly pass whole). The
// rank is flagged (once) when S reaches the decision interval h; the flag
// clears when S is back at 0, which the cap at h keeps within h/k steps of
// the rank's recovery.
//
// Why a level per stage: the stages of a pipeline do different work (the
// last holds the head and the loss, the first the embedding), so a stage
// that is slower by design is no straggler; with one level for all, the
// last stage of a fault-free PP2 run of the quickstart model (its head 7% of
// a stage) was flagged. Without a pipeline every rank is of stage 0. With
// one rank per stage a rank is held to its own past: one that slows down is
// seen, one slow from its start is not.
//
// h comes from the ranks' own noise, not from a model of it. Every
// `straggler_window` steps from the 20th, over the last 200 steps of the
// ranks that do not look slow (own median below c + k), theta solves
// mean(exp(theta (y - k))) = 1 for their clipped excess y, and
// h = ln(`straggler_false_alarm_steps` x ranks) / theta: by Wald's bound an
// excursion of S reaches h with probability at most exp(-theta h), so
// noise alone flags about once in that many steps of the whole job, or
// less. h is at least 16 (U - k) = 24k: no fewer than 16 steps at the
// clip flag a rank. Wald's bound takes the steps as independent, and
// compute noise comes in bursts: in fault-free runs of 2 ranks with a core
// each on the 2-core VM, a rank's compute ran 15-40% above its peer's for
// 3 to 12 steps (1-2 s) every 20-40 steps, with no CPU wait to show for
// it. With U = 3k and at least 4 steps, such bursts flagged a rank in 5 of
// 25 runs of the false-alarm sweep (bench/README.md), and with at least 12
// in 1 of 25. Over six recorded fault-free 2-rank runs the largest burst
// reached 0.53 of this h (0.66 of that 12-step one), and replayed, a
// recorded 1.10x rank of four is still flagged at step 19 (what caused the
// bursts, and its fix, below). Why not a Gaussian h: compute noise on CPUs
// is heavy-tailed (its standard deviation was 1.2 to 3 times 1.4826 x its
// MAD in recorded runs), and an h made for Gaussian noise of that MAD
// flagged unslowed ranks 4 times in 10 replays of 3 ranks, where this one
// flagged none. Noise that drowns the
// threshold (mean y >= k) leaves h infinite: nobody gathers evidence and
// the report says so. The warm-up delays the verdict, not the evidence:
// when h is first learned, the steps held so far count at once.
//
// Why a second tier: a rank stopped from outside for 20 ms of every
// 200 ms (SIGSTOP, as a throttled node would be) is slow only on the steps
// a stop lands in, by a lot. In DP4 and DP2 x TP2 keeld jobs on the 2-core
// VM, a third to three fifths of its steps ran 1.3-1.9x, the rest normal:
// each slow step passes k by up to 2.5k - k, each normal one takes k back,
// and the steady tier reached its interval at step 94 of one such run and
// never in three others. The bursts tier,
//   S2 = min(h2, max(0, S2 + clamp(x - c, -10k, 10k) - 1.5k)),
// with h2 learned the same way and at least 6 steps at its clip, flagged
// all four 16-36 steps after the first stop when replayed (steps 38-58);
// over nine recorded fault-free DP2, DP4 and DP2 x TP2 runs its largest
// excursion reached 0.27 of h2, and the steady tier's 0.47 of h. A
// preempted step still counts as one slow step, not as one tenth of a
// flag. Under keeld with this code it flagged the quickstart's job 15-16
// steps after the first stop, and tests/timing's job of the same shape
// 14-66 steps after; a rank stopped from its first step counts among the
// noise it is judged against, and was flagged later (step 79).
//
// Two ranks are told apart later. Their median is their mean, so a rank
// shows half of its slowdown: stopped 20 ms in 200 in a DP2 keeld job, it
// was flagged 59 steps after its first stop on compute alone (its stalls,
// below, flag it sooner). Judging each rank against the
// other instead (its full slowdown) was replayed on the recorded runs: it
// flagged a 1.10x DP2 rank at step 32 rather than 131 and the stopped DP2
// ranks at steps 62 and 80, but lifted fault-free DP2 runs to 0.94 of h
// (from 0.70): one rank's burst of 12 steps at +30%, seen in fault-free
// runs, carries the evidence of 30 steps of a rank slowed on every other
// step, so no CUSUM parts them within 50 steps without false flags.
//
// Why not W consecutive slow windows: at the per-step noise of a loaded
// 2-core machine (sd 6-10%), windows of 10 steps judged one by one threw
// away the evidence of every window that fell short, and a 1.10x rank was
// flagged within 50 steps in as few as 4-6 of 10 runs. The windows remain
// for the table's score (a rank's median compute over the window, relative
// to each step's median rank, over the median rank's, minus 1) and for
// when h is learned. With two ranks the median is their mean, so the
// slower one looks about half the gap slower. The synchronisation tax is
// the mean over steps of the slowest rank's compute over the median
// rank's (1 before any step). Only step numbers order the evidence, never
// the time, so a clock that jumps changes nothing.
//
// A rank stopped or blocked is a finding of its own too. The SIGSTOP duty
// cycle above costs the rank no CPU: its training thread is neither
// running nor waiting for a CPU while stopped, which its board counts
// (StepTiming::stalled_ms: compute less the thread's CPU time, read from
// CLOCK_THREAD_CPUTIME_ID, since schedstat's on-CPU time lags by up to a
// tick, and less its run-queue wait). Computing on the CPU hardly stalls
// on its own: in fault-free DP2 and DP2 x TP2 keeld jobs on the 2-core VM
// a rank's stalls were 0.02-0.14% of its step time. A stop is seen only
// when it begins in the rank's compute; one that begins in a collective is
// wait, for it and for the ranks waiting for it, which nothing tells
// apart. Stopped 20 ms of every 200 in a DP2 job (steps of 37 ms, 16 of
// them compute), a rank had one step in 5 to 30 stalled about as long as
// it worked (1-1.3x), the stops that began in its collectives between.
// A third stream judges x = stalled / (compute - stalled), linear (a step
// stalled as long as it worked counts 1), less the median of the other
// ranks' (not of all: with two ranks that is their mean, which would
// halve the victim's stalls), with a tier of its own:
//   S3 = min(h3, max(0, S3 + clamp(x - c, -25k, 25k) - k/2)),
// 25k about 1 (a step counts at most as stalled as long as it worked), h3
// learned as the others' and at least 1.5 steps at its clip, so that two
// such steps flag a rank and one does not. Half of k is allowed for free,
// not k: about half of a stopped rank's stops are hidden in its
// collectives, so it shows half of what it loses. With k a second stall
// had to come within 12 steps of the first; with k/2 it may come within
// 24. Its noise is learned from the quieter half of the ranks by the mean
// of their increments, not from those whose median is normal: the median
// of a rank stalled one step in seven is 0, and its stalls would be
// learned as noise and push h3 out of reach. Under keeld a rank so
// stopped was flagged 5-39 steps after the first stop in twelve DP2 jobs
// and 9-37 in four DP2 x TP2 jobs; replayed, 44 recorded fault-free DP2
// and DP2 x TP2 runs of 300 steps raised no stall flag. Ranks that
// compute on a device stall by design (the training thread waits for
// it), so their boards report no stall and this stream stays silent. The
// cause is then "stalled": its stall tier crossed h3, or its compute is
// slow by stalls past the threshold and without them would be within it.
//
// Host contention is a finding of its own. compute leaves out the
// training thread's run-queue wait, so a rank whose core is shared with a
// process outside the job (a CPU hog) is not slow by compute: it is slowed
// by its host's scheduler, which an operator fixes on the host, not by
// replacing the rank's device. A second CUSUM, the same in every respect
// (its own levels and h), runs on each rank's busy time, compute +
// run-queue wait. A flagged rank's cause is "host" when its busy time
// crossed h with its own compute within the threshold, or when its share
// of step time waiting for a CPU exceeds the other ranks' median by more
// than its compute is slow: a process sharing a core also slows the work
// it lets through (caches, switches). In a fault-free DP2 run on the
// 2-core VM beside a test polling keeld's status every 10 ms, the rank
// whose core took the polling waited 14.5% of its step time against its
// peer's 6%, its compute ran 6% above, and it was flagged at step 23;
// otherwise the cause is "compute". Contention keel causes by design is
// not counted: ranks that share cores wait alike and cancel step by step
// against the median, keeld's own threads took 0.15 s of CPU in a 26 s
// DP2 run (0.6% of a core), and the part of a rank's run-queue wait its
// own other threads ran in (StepTiming::own_cpu_wait_ms: its communication
// threads, overlapped with its compute on its core) is left out of its CPU
// wait. That part was 80-100% of a DP2 rank's run-queue wait on the 2-core
// VM while those threads were pinned beside its training thread.
//
// Pinned there, they were also what made a fault-free rank slow: the
// bursts above. Gloo's socket loop woke some 30 times a step and took a
// third of its core; the rank later to its collectives received while it
// computed, ran 30% slower for tens of steps, and so stayed later (its
// compute rose 1.5 ms for each ms its own threads ran in it: caches, not
// CPU time). 7 of 12 fault-free 300-step DP2 keeld jobs flagged a rank for
// its compute, 2 of 6 with overlap_comm off, 3 of 6 without memory
// buddies. keeld now starts those threads on the CPUs all ranks share
// (common/shared_cpus.h), where a peer waiting in a collective leaves its
// core idle: 0 of 10 such jobs flagged anyone, at 1.4x the throughput.
// The price: a rank whose host starves it drives them onto its peers'
// cores and slows their compute (a peer was flagged for it first in one
// of five runs beside CPU hogs), so a compute verdict waits while another
// rank waits for a CPU more than the rank by more than the rank is slow.
//
// The defaults (threshold 0.04, 10^6 steps per false flag) were chosen by
// replaying 20 recorded 4-rank CPU jobs (270-300 steps, one rank 1.10x
// from the start, per-step noise sd 6-10%): all 20 flagged by step 47 and
// no other rank; threshold 0.05 flagged 18 of 20 by step 50. With the
// slowed rank left out, none of the 20 three-rank runs that remain
// flagged anyone. A 1.10x rank measured only 7-10% slower than the step's
// median in these jobs (mean log ratio 0.067-0.097), so k is set well
// under half of log 1.10.
#pragma once

#include "common/config.h"
#include "health/rank_sample.h"

#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <utility>
#include <vector>

namespace keel::health {

// Why a rank is slow: its own compute, its host's scheduler, or stalls (the
// rank stopped or blocked in the kernel).
enum class StragglerCause { kCompute, kHost, kStalled };
const char* straggler_cause_name(StragglerCause cause);  // "compute", "host", "stalled"

struct StragglerFinding {
  int rank = -1;
  double score = 0;   // its slowness since its evidence last was 0: exp(mean x - c) - 1
  int64_t step = -1;  // the step whose evidence reached the decision interval
  StragglerCause cause = StragglerCause::kCompute;
  double cpu_wait_share = 0;         // its run-queue wait over its step time, lately
  double peers_cpu_wait_share = 0;  // the median of the other ranks' (0 alone)
  double stalled_share = 0;          // the part of its compute it was stalled, lately
  double peers_stalled_share = 0;    // the median of the other ranks' (0 alone)
  // {"rank", "score", "step", "cause", "cpu_wait_share", "peers_cpu_wait_share", "stalled_share",
  //  "peers_stalled_share"}: the fields of the straggler_flagged event.
  nlohmann::json to_json() const;
};

class StragglerMonitor {
 public:
  // `history_steps`: how many steps of per-rank compute times report()
  // keeps for the heat map.
  explicit StragglerMonitor(const common::HealthConfig& config, size_t history_steps = 2000);

  // Takes the steps of `samples` not seen before; returns the ranks flagged
  // now. Steps a rank's ring no longer holds are skipped, never guessed.
  std::vector<StragglerFinding> observe(const RankSamples& samples, int64_t now_ns);

  // Whether `rank` is flagged now.
  bool flagged(int rank) const;
  // The newest window score of `rank` (0 before the first window).
  double score(int rank) const;
  double sync_tax() const;

  // The reply to `keelctl stragglers`:
  // {"window": N, "threshold": t, "false_alarm_steps": A, "sync_tax": x,
  //  "noise": the standard deviation of the clipped excess of the ranks not slow,  // null before it is learned
  //  "decision_interval": h,                       // the steady tier's; null before it is learned, or while
  //                                               // noise drowns t
  //  "ranks": [{"rank", "median_compute_ms", "score", "slowdown", "cpu_wait_share", "stalled_share", "evidence",
  //             "host_evidence", "stall_evidence", "flagged", "cause"}, ...],
  //      // median ms and score of the newest window (null ms before one); slowdown: its compute over its
  //      // stage's level, minus 1, lately (what its evidence gathers); cpu_wait_share: its run-queue wait
  //      // over its step time, lately; stalled_share: its stalls over its compute, lately; evidence,
  //      // host_evidence and stall_evidence: S / h of the tier nearest h on compute, busy time and
  //      // stalls, 0..1; cause null unless flagged
  //  "steps": [s0, s1, ...],                      // the steps of the heat map, ascending
  //  "compute_ms": [[rank 0's per step], ...]}    // null where a rank's step was not seen
  nlohmann::json report() const;

 private:
  // The three things judged: compute, busy time (compute + run-queue wait)
  // and stalls (log(compute / (compute - stalled))).
  enum Stream { kCompute, kBusy, kStalled, kStreams };
  // The shapes of slowness a stream has a CUSUM for: every step a little
  // slow, some steps much slower (compute and busy time), and some steps
  // stalled (stalls).
  enum Tier { kSteady, kBursts, kStalls, kTiers };
  // A tier's CUSUM in log ratios: a step adds its excess past `allowance`,
  // at most `clip`; the decision interval is at least `least_interval`.
  struct Cusum {
    double allowance = 0, clip = 0, least_interval = 0;
  };
  // A rank's CUSUM on one stream.
  struct Evidence {
    double sum = 0;         // S, 0..h
    double excess_sum = 0;  // x - c summed over the steps since S was last 0
    int64_t excess_steps = 0;
    bool flagged = false;
  };
  struct Timing {
    float compute_ms = 0, cpu_wait_ms = 0, total_ms = 0, stalled_ms = 0;  // cpu_wait_ms: the host's part
  };
  struct RankState {
    int stage = 0;                      // its pipeline stage (pipeline_stage())
    int64_t generation = -1;            // of the board its steps came from
    int64_t newest = -1;                // the newest step it timed in that generation
    std::map<int64_t, Timing> pending;  // steps timed and not yet taken, by step
    std::vector<double> ratios;         // its compute / the step's median, in the current window
    std::vector<double> computes;       // its compute in the current window
    double window_ms = -1;              // median compute of its newest window; -1: none yet
    double score = 0;
    double recent_excess = 0;           // x - c of compute, averaged over about a window of steps
    double cpu_wait_share = 0;          // run-queue wait / step time, averaged the same way
    double recent_stall_excess = 0;     // x - c of stalls, averaged the same way
    double stalled_share = 0;           // stalled / compute, averaged the same way
    Evidence evidence[kStreams][kTiers];
    std::optional<StragglerCause> cause;  // set while flagged
  };
  // What the noise of the ranks that are not slow allows on one stream,
  // learned every window.
  struct Noise {
    std::map<int, double> centres;  // c, by pipeline stage
    double spread = 0;                            // the standard deviation of the steady tier's clipped excess
    std::array<double, kTiers> decision_interval{};  // h by tier; infinite while the noise drowns its allowance,
                                                     // and for a tier the stream has not
  };
  // One step's log ratios by rank (NaN: not in it), per stream.
  using StepRatios = std::array<std::vector<double>, kStreams>;
  // Takes the steps up to `newest` (the newest every participant timed).
  void take_steps(const std::vector<int>& participants, int64_t newest, std::vector<StragglerFinding>& found);
  // Adds the step's log ratios `x` to every participant's evidence.
  void add_evidence(const std::vector<int>& participants, const StepRatios& x, int64_t step,
                    std::vector<StragglerFinding>& found);
  void close_window(const std::vector<int>& participants);
  // Learns both streams' noise; false while a stream cannot be learned yet.
  bool learn_noise(const std::vector<int>& participants);
  std::optional<Noise> learn_stream(const std::vector<int>& participants, Stream stream) const;
  // c of `stream` for `stage`, once learned.
  std::optional<double> centre_of(Stream stream, int stage) const;
  // The tier of `rank`'s evidence on `stream` nearest its decision interval
  // (a flagged one first), and that share of h, 0..1.
  std::pair<Tier, double> strongest(const RankState& rank, Stream stream) const;
  // The largest run-queue wait share of `participants` other than `rank` (0: none).
  double most_waiting(const std::vector<int>& participants, int rank) const;
  // The median of `share` over `participants` other than `rank` (0: none).
  double peers_median(const std::vector<int>& participants, int rank, double RankState::*share) const;

  common::HealthConfig config_;
  double allowed_ = 0;              // k = log(1 + threshold)
  Cusum tiers_[kTiers];
  size_t history_steps_;
  std::vector<RankState> ranks_;
  int64_t next_step_ = 0;           // every step before it was taken or skipped
  std::vector<int> window_ranks_;   // the participants of the current window
  int64_t window_steps_ = 0;
  std::deque<StepRatios> recent_x_;  // per recent step
  std::optional<std::array<Noise, kStreams>> noise_;
  double tax_sum_ = 0;
  int64_t tax_steps_ = 0;
  // The heat map: steps ascending, each with every rank's compute (NaN: not seen).
  std::deque<std::pair<int64_t, std::vector<float>>> history_;
};

}  // namespace keel::health
