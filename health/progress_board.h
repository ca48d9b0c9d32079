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
#include <optional>
#include <string>

namespace keel::health {

// What a rank is doing (docs/architecture.md "Health").
enum class Phase : uint32_t { kInit, kData, kForward, kBackward, kOptimizer, kCheckpoint, kIdle };
inline constexpr uint32_t kPhaseCount = 7;
// "init", "data", "forward", ...; "unknown" for a value out of range (a
// board is read from another process and is not trusted).
const char* phase_name(uint32_t phase);

enum class CollectiveState : uint32_t { kNone, kInFlight, kDone, kFailed };
const char* collective_state_name(uint32_t state);

// Times are nanoseconds on CLOCK_MONOTONIC (std::chrono::steady_clock on
// Linux), comparable between the processes of one machine.
struct CollectiveRecord {
  char group[16] = {};  // process group name, NUL-terminated (truncated if longer)
  char op[16] = {};     // "all_reduce", ...
  int64_t seq = -1;     // the group's sequence number
  uint64_t bytes = 0;   // payload as Communicator counts it
  int64_t start_ns = 0;
  int64_t end_ns = 0;   // 0 while in flight
  uint32_t state = static_cast<uint32_t>(CollectiveState::kNone);
  uint32_t reserved = 0;
};

inline constexpr uint32_t kBoardVersion = 1;
inline constexpr size_t kRecentSteps = 16;

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
  float loss = 0;              // of the last step
  float grad_norm = 0;
  double tokens_per_s = 0;     // of the last step, whole job
  double step_ms = 0;          // of the last step
  double recent_step_ms[kRecentSteps] = {};  // ring: step s at index s % kRecentSteps
  CollectiveRecord collective;  // the collective begun last
  int64_t checkpoint_step = -1;   // the newest checkpoint this rank wrote
  uint64_t checkpoint_bytes = 0;  // this rank's bytes in it
  double checkpoint_write_s = 0;  // its write time on the writer thread
  uint64_t checkpoint_requests_seen = 0;  // the request count the rank acted on last
};

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

 private:
  struct Layout;
  ProgressBoard(std::string name, Layout* layout);
  std::string name_;
  Layout* layout_ = nullptr;
};

// The segment name keeld gives local rank `local_rank` of daemon `pid`.
std::string board_name(int pid, int local_rank);

// Monotonic nanoseconds, the board's clock.
int64_t monotonic_ns();

}  // namespace keel::health
