// The progress board (docs/architecture.md "Health"): a fixed-layout POSIX shared-memory
// segment per rank. The rank publishes where it is (step, phase, the
// collective it is in, recent step times); keeld reads it from its event
// loop without ever blocking on the rank. A rank that is stuck simply stops
// updating its board.
//
// Publishing is a seqlock: the writer makes the sequence odd, copies the
// snapshot in, makes it even again. A reader copies the snapshot out and
// keeps it only if the sequence was the same even number before and after,
// so it never sees half an update and never makes the writer wait. The
// payload is copied as 64-bit relaxed atomics, which keeps the racing copy
// defined behaviour.
//
// One word flows the other way: keeld raises `checkpoint_requests` (for
// `keelctl checkpoint now`), and the rank compares it with the last value it
// acted on.
//
// Segment names are POSIX shm names ("/keel.1234.0"): keeld creates the
// segment before it starts the rank and removes it after the rank is gone;
// the rank opens the one KEEL_BOARD names.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace keel::health {

// What a rank is doing (docs/architecture.md "Health"). Each phase has its
// own learned time budget in the hang detector: a slow checkpoint or
// validation pass is a phase, never a hang.
enum class Phase : uint32_t { kInit, kData, kForward, kBackward, kOptimizer, kCheckpoint, kValidation, kIdle };
inline constexpr uint32_t kPhaseCount = 8;
// "init", "data", "forward", ...; "unknown" for a value out of range (a
// board is read from another process and is not trusted).
const char* phase_name(uint32_t phase);

enum class CollectiveState : uint32_t { kNone, kInFlight, kDone, kFailed };
const char* collective_state_name(uint32_t state);

inline constexpr uint32_t kBoardVersion = 7;
// Process groups one rank can belong to: one per mesh axis (tp, cp, dp, pp,
// ep, expert_dp, dp_cp) and one spare.
inline constexpr size_t kMaxGroups = 8;
// A group's whole name with its NUL; BoardPublisher::add_group refuses a
// longer one, so a name on the board is never a truncated copy.
inline constexpr size_t kGroupNameBytes = 64;
inline constexpr size_t kOpNameBytes = 16;
inline constexpr size_t kRecentSteps = 32;
inline constexpr size_t kDigestSlots = 8;
inline constexpr size_t kBlasCoreBytes = 24;  // an OpenBLAS core name and its NUL

// Times are nanoseconds on CLOCK_MONOTONIC (common/clock.h), comparable
// between the processes of one machine.

// One process group the rank belongs to, at slot `id` of the board's group
// table: the id is what the publisher and the detectors compare, the name
// is for people and for matching the same group across ranks.
struct GroupRecord {
  char name[kGroupNameBytes] = {};  // NUL-terminated; empty: slot unused
  char op[kOpNameBytes] = {};       // op of the collective begun last
  int32_t size = 0;                 // ranks in the group
  int32_t index = -1;               // this rank's position in it
  int64_t seq_begun = -1;           // sequence number of the collective begun last
  int64_t seq_done = -1;            // the highest sequence number that ended (ok or failed)
  int64_t begin_ns = 0;             // when seq_begun began
  int64_t done_ns = 0;              // when seq_done ended
  uint64_t bytes = 0;               // payload of seq_begun
  uint32_t state = static_cast<uint32_t>(CollectiveState::kNone);  // of seq_begun
  uint32_t reserved = 0;
  // Payload of the collectives begun during the last step timed: what the
  // axis moves a step (keelctl status; on many nodes, across nodes).
  uint64_t step_bytes = 0;
};

// One collective of the rank's recent history (any group), for keeld's
// flight dumps and `keelctl diagnose`.
struct RecentCollective {
  int32_t group = -1;  // slot in the group table; -1: unused
  uint32_t state = static_cast<uint32_t>(CollectiveState::kNone);
  int64_t seq = -1;
  char op[kOpNameBytes] = {};
  uint64_t bytes = 0;
  int64_t begin_ns = 0;
  int64_t end_ns = 0;  // 0 while in flight
};
inline constexpr size_t kRecentCollectives = 16;

// Where one step's wall time went on this rank. compute = total - wait -
// data: what the rank itself spent, which is what tells a straggler apart
// from the ranks that wait for it.
struct StepTiming {
  int64_t step = -1;     // the step this is (0-based); -1: slot unused
  float total_ms = 0;
  float compute_ms = 0;
  float wait_ms = 0;     // inside collectives
  float data_ms = 0;     // building the batch
  float cpu_wait_ms = 0; // runnable but waiting for a CPU (Clock::ThreadTimes)
  // Of cpu_wait, what the rank's own other threads ran meanwhile (at most
  // all of it): its communication threads on its core, which is keel's
  // contention, not its host's.
  float own_cpu_wait_ms = 0;
  // Of compute, the time the training thread was neither running nor
  // runnable: stopped (SIGSTOP, a cgroup's freezer or CPU quota) or blocked
  // in the kernel (page faults, swap). Compute on the CPU stalls by little
  // of itself; a rank that waits for a device stalls by design.
  float stalled_ms = 0;
};

// A digest of the bytes this rank holds that every rank of the same
// replica set holds too (docs/architecture.md "Health": SDC).
struct ReplicaDigest {
  int64_t step = -1;         // steps done when it was taken; -1: slot unused
  uint64_t replica_set = 0;  // ranks with equal sets must have equal digests
  uint64_t digest = 0;       // XXH3-64
};

// What the rank found itself (the rerun and the known-answer test); keeld
// turns a new one (count changed) into an event.
enum class SdcMethod : uint32_t { kNone, kReplicaDigest, kRerun, kKat };
enum class SdcVerdict : uint32_t { kNone, kTransient, kPersistent };
const char* sdc_method_name(uint32_t method);
const char* sdc_verdict_name(uint32_t verdict);
struct SdcReport {
  uint64_t count = 0;    // reports so far; 0: none
  int64_t step = -1;
  int32_t rank = -1;     // the rank found at fault; -1: none could be named
  uint32_t method = static_cast<uint32_t>(SdcMethod::kNone);
  uint32_t verdict = static_cast<uint32_t>(SdcVerdict::kNone);
  uint32_t reserved = 0;
};

// A fault keeld asks a running rank to inject (`keelctl inject`), the
// one request that flows from keeld to the rank besides checkpoints. The
// rank takes a new one (count changed) at its next step boundary and
// treats it as the [faults] keys of the same names, in its own generation.
enum class FaultKind : uint32_t { kNone, kCrash, kHang, kSlow, kBitflip, kNan };
const char* fault_kind_name(uint32_t kind);
struct FaultRequest {
  uint64_t count = 0;        // requests so far; 0: none
  uint32_t kind = static_cast<uint32_t>(FaultKind::kNone);
  int32_t bit = 22;          // bitflip: bitflip_bit
  int64_t step = -1;         // the step it fires at; -1: the rank's next step
  double factor = 1.0;       // slow: slow_factor
  char target[16] = {};      // bitflip: bitflip_target; nan: nan_target
  char group[16] = {};       // hang: hang_group
  char tensor[64] = {};      // bitflip: bitflip_tensor
};

// Everything a rank publishes. Plain data: the layout is the contract
// between keel-trainer and keeld of the same build (kBoardVersion says so).
struct BoardSnapshot {
  uint32_t version = kBoardVersion;
  uint32_t phase = static_cast<uint32_t>(Phase::kInit);
  int32_t rank = -1;
  int32_t pid = 0;
  int64_t generation = 0;
  int64_t first_step = 0;      // where this generation started (the resumed checkpoint's step)
  int64_t steps_done = 0;      // optimizer steps completed, counted from the run's start
  int64_t total_steps = 0;     // train.steps
  int64_t update_ns = 0;       // when this snapshot was published
  int64_t step_start_ns = 0;   // when the step in progress began
  int64_t phase_start_ns = 0;  // when the current phase began
  float loss = 0;              // of the last step
  float grad_norm = 0;
  double tokens_per_s = 0;     // of the last step, whole job
  double step_ms = 0;          // of the last step
  // Per phase: the duration of its last finished instance and how many
  // finished, so keeld learns each phase's budget without seeing every one.
  float phase_last_ms[kPhaseCount] = {};
  uint32_t phase_count[kPhaseCount] = {};
  StepTiming steps[kRecentSteps];            // ring: step s at index s % kRecentSteps
  GroupRecord groups[kMaxGroups];            // slot = group id
  RecentCollective recent[kRecentCollectives];  // ring, the newest at (recent_count - 1) % kRecentCollectives
  uint64_t recent_count = 0;
  ReplicaDigest digests[kDigestSlots];       // ring, the newest at (digest_count - 1) % kDigestSlots
  uint64_t digest_count = 0;
  SdcReport sdc;                             // the newest finding of the rank itself
  int64_t checkpoint_step = -1;   // the newest checkpoint this rank wrote
  uint64_t checkpoint_bytes = 0;  // this rank's bytes in it
  double checkpoint_write_s = 0;  // its write time on the writer thread
  uint64_t checkpoint_requests_seen = 0;  // the request count the rank acted on last
  int64_t snapshot_step = -1;     // the newest in-memory snapshot this rank took
  uint64_t snapshot_bytes = 0;    // its bytes
  double snapshot_stall_s = 0;    // how long training waited for it
  // The OpenBLAS core the CPU backend runs and whose choice it is
  // (trainer/train/blas_core_start.h); empty on a GPU rank.
  char blas_core[kBlasCoreBytes] = {};
  char blas_chosen_by[kBlasCoreBytes] = {};

  // The step timing of `step` if the ring still holds it.
  const StepTiming* timing_of(int64_t step) const;
  // The group named `name`, or nullptr.
  const GroupRecord* group(std::string_view name) const;
};

// A fixed-size text field of a board as a string: stops at the first NUL
// and never reads past the field (a board is not trusted).
template <size_t N>
std::string board_text(const char (&field)[N]) {
  return std::string(field, strnlen(field, N));
}
// A group's name (board_text of it).
std::string group_name(const GroupRecord& group);

// The kind of a process group: its mesh axis, the name without the
// generation prefix and the index suffix ("dp" of "g3.dp.0", "expert_dp" of
// "g10.expert_dp.12"); a name not of that form is its own kind.
std::string group_kind(std::string_view group);

// The rank's pipeline stage: its index in its "pp" group; 0 without one
// (no pipeline) or when the index is garbage.
int pipeline_stage(const BoardSnapshot& board);

// One mapped segment. Movable, not copyable; unmaps on destruction.
class ProgressBoard {
 public:
  // keeld: creates (or truncates) the segment `name`, mode 0600, zeroed.
  // Error(kInternal) naming the segment on failure.
  static ProgressBoard create(const std::string& name);
  // A rank: maps the segment keeld created. Error(kBadConfig) when it does
  // not exist or has the wrong size (KEEL_BOARD names the wrong thing).
  static ProgressBoard open(const std::string& name);
  // Removes the name; mappings stay valid. Missing names are ignored.
  static void remove(const std::string& name);

  ProgressBoard(ProgressBoard&& other) noexcept;
  ProgressBoard& operator=(ProgressBoard&& other) noexcept;
  ProgressBoard(const ProgressBoard&) = delete;
  ProgressBoard& operator=(const ProgressBoard&) = delete;
  ~ProgressBoard();

  const std::string& name() const { return name_; }

  // Writer side. One writer at a time (BoardPublisher serialises them).
  void publish(const BoardSnapshot& snapshot);
  // Reader side, lock-free. Nothing when the rank has not published yet, or
  // when every attempt raced with a write (the caller simply tries again on
  // its next poll).
  std::optional<BoardSnapshot> read() const;

  // keeld asks for a checkpoint; the rank reads the running count.
  void request_checkpoint();
  uint64_t checkpoint_requests() const;

  // keeld asks for a fault (FaultRequest::count is set from the running
  // count); the rank reads the newest request. Both sides of one build.
  void request_fault(FaultRequest request);
  FaultRequest fault_request() const;

  // The heartbeat, a word outside the snapshot: a live rank beats it from
  // its own thread even while its training thread waits inside a
  // collective, so a rank that is frozen or stopped (its heartbeat stops)
  // is told apart from one that waits for it. 0: never beaten.
  void beat(int64_t now_ns);
  int64_t heartbeat_ns() const;

 private:
  struct Layout;
  ProgressBoard(std::string name, Layout* layout);
  std::string name_;
  Layout* layout_ = nullptr;
};

// The segment name keeld gives local rank `local_rank` of daemon `pid`.
std::string board_name(int pid, int local_rank);


}  // namespace keel::health
