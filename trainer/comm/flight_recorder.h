// The flight recorder (docs/architecture.md "Parallel layout and communication"): a ring buffer of the last N
// collectives a rank started, shared by all of the rank's process groups.
// When a collective hangs, keeld reads every rank's dump and names the ranks
// that never reached the sequence number the others are stuck in, so the
// recorder must say what was in flight, since when, and what completed.
//
// Thread-safe: communicators record from their calling threads while a
// watchdog may snapshot or dump at any time.
//
// Dump format (dump(), JSON, schema version 1). Times are integer
// nanoseconds: `*_steady_ns` on std::chrono::steady_clock (CLOCK_MONOTONIC on
// Linux, so comparable between processes of one machine), `*_wall_ns` since
// the Unix epoch.
//
//   {
//     "version": 1,
//     "pid": 4242,                     // process that wrote the dump
//     "capacity": 1024,                // N
//     "recorded": 5000,                // calls begun since the recorder was made;
//                                      // recorded - len(entries) were dropped
//     "dump_steady_ns": 123456789,     // when the dump was taken; for an entry
//     "dump_wall_ns": 1790000000000000000,  // in flight, its age is
//                                      // dump_steady_ns - start_steady_ns
//     "entries": [                     // oldest first; ids increase by one
//       {
//         "id": 3976,                  // position in the recorder's history
//         "group": "dp",               // communicator (process group) name
//         "seq": 812,                  // the group's sequence number of the call
//         "op": "all_reduce",          // collective_op_name()
//         "bytes": 4096,               // payload as defined in communicator.h
//         "peer": -1,                  // group rank of the peer (send, recv,
//                                      // broadcast root), -1 if none
//         "state": "in_flight",        // "in_flight", "done" or "failed"
//         "start_steady_ns": 123400000,
//         "start_wall_ns": 1789999999999000000,
//         "end_steady_ns": null,       // null while in flight
//         "error": ""                  // the failure's message, "" unless failed
//       }
//     ]
//   }
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace keel::trainer {

enum class FlightState : int { kInFlight, kDone, kFailed };

// "in_flight", "done" or "failed": the names the dump uses.
const char* flight_state_name(FlightState state);

struct FlightEntry {
  uint64_t id = 0;
  std::string group;
  int64_t seq = 0;
  std::string op;
  uint64_t bytes = 0;
  int peer = -1;
  FlightState state = FlightState::kInFlight;
  std::chrono::steady_clock::time_point start;
  std::chrono::system_clock::time_point wall_start;
  std::optional<std::chrono::steady_clock::time_point> end;
  std::string error;
};

class FlightRecorder {
 public:
  static constexpr size_t kDefaultCapacity = 1024;

  // Keeps the last `capacity` calls; a capacity of 0 is Error(kInternal).
  explicit FlightRecorder(size_t capacity = kDefaultCapacity);

  size_t capacity() const { return slots_.size(); }

  // Records the start of a call, in flight; returns its id for end().
  uint64_t begin(const std::string& group, int64_t seq, const std::string& op, uint64_t bytes, int peer);

  // Records how the call ended. A call that has already left the ring (N
  // newer calls began meanwhile) is not recorded again.
  void end(uint64_t id, FlightState state, const std::string& error = {});

  // The recorded calls, oldest first.
  std::vector<FlightEntry> snapshot() const;

  // Writes the JSON above to `path` atomically: a temporary file beside it,
  // fsync, rename, fsync of the directory, so a reader sees either the old
  // dump or the whole new one. Error(kInternal) if it cannot be written.
  void dump(const std::filesystem::path& path) const;

 private:
  std::vector<FlightEntry> entries_locked() const;

  mutable std::mutex mutex_;
  std::vector<FlightEntry> slots_;  // entry `id` lives at slots_[id % capacity]
  uint64_t next_id_ = 0;
};

}  // namespace keel::trainer
