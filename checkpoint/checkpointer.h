// One rank's asynchronous checkpoint saves, and their commit (docs/architecture.md "Checkpoints").
//
// The training thread pays only for the snapshot: stage() waits for the
// previous save (back-pressure, so a save in flight is never overwritten)
// and hands out the staging buffer; the caller copies its state in and
// calls save_async(). A writer thread then writes the rank file into
// step_%08d.partial/ and reports it (size and XXH3) through the Store.
//
// Global rank 0 commits: once every rank's file is in, it writes index.h5
// and the manifest, fsyncs them and the directory, renames it to
// step_%08d (exchanging it atomically with an older save of the same step),
// fsyncs the parent and applies retention. If any rank failed, did not
// report within the timeout, or the commit was cancelled, it abandons the
// save (the .partial directory is removed) and training goes on. Every
// outcome is an event in run_dir/events.jsonl (docs/architecture.md
// "Commit protocol").
//
// No checkpoint is written from non-finite state: a staged value that is
// NaN or infinite fails this rank's file.
#pragma once

#include "checkpoint/catalog.h"
#include "checkpoint/file_system.h"
#include "checkpoint/piece.h"
#include "checkpoint/rank_report.h"
#include "checkpoint/shard_writer.h"
#include "store/store.h"

#include <nlohmann/json.hpp>

#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace keel::checkpoint {

struct CheckpointerOptions {
  std::filesystem::path root;     // the checkpoint directory
  std::filesystem::path run_dir;  // events.jsonl goes here
  bool o_direct = true;
  int64_t keep = 3;
  int64_t keep_every = 0;
  double timeout_s = 600;  // rank 0's wait for the other ranks' files
  nlohmann::json config;   // stored in the manifest
  nlohmann::json layout;   // {"world_size", "dp", "tp", ...}
  int rank = 0;
  int world_size = 1;
  int64_t generation = 0;
  // Called on the writer thread once this rank's file is written: its step,
  // bytes and write time. keel-trainer shows them on the progress board.
  std::function<void(int64_t step, uint64_t bytes, double write_s)> on_written;
  // How retention checks the checkpoints it counts as good.
  Depth retention_depth = Depth::kSizes;
  FileSystem* fs = &FileSystem::real();
  // A Store key whose appearance cancels the commit in flight, as cancel()
  // does: keeld sets it when a rank of the generation dies (a rank killed
  // between two collectives tells nobody). Empty: none.
  std::string cancel_key;
  // Pins the staging buffer for the caller's copies into it (GPU state).
  StagingPinning staging_pinning;
};

class Checkpointer {
 public:
  // `store` carries the ranks' reports to rank 0; nullptr with one rank.
  // Rank 0 cleans up after interrupted saves: a .deleting directory and a
  // .partial one without a manifest go; a .partial one with a manifest
  // (a save that crashed between its manifest and its rename, or the old
  // side of an exchange) is checked in full and committed when no
  // step_%08d of its step exists, removed otherwise.
  Checkpointer(CheckpointerOptions options, store::Store* store);
  // Finishes the save in flight.
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Lays the staging buffer out for `pieces` ahead of the first save, so
  // that its stall is the copy alone and not the buffer's allocation and
  // pinning (the first save of a 124M run on an H200 stalled 904 ms with
  // them, 084b7bf). The buffer only grows: stage() reuses it.
  void reserve(std::vector<Piece> pieces);
  // Waits for the save in flight, then lays the staging buffer out for
  // `pieces`; returns where each piece's floats go. Also the pinned host
  // buffer a load from disk into device memory reads through (nothing is
  // in flight before the first save).
  std::vector<float*> stage(std::vector<Piece> pieces);
  // Saves what was staged as step `step` (steps completed) on the writer
  // thread; returns at once.
  void save_async(int64_t step, int64_t tokens);
  // Waits for the save in flight, if any. False when it failed: this
  // rank's file, or on rank 0 the commit.
  bool wait();
  // Abandons the commit in flight at once, and any later one, with `cause`
  // (a peer failed: its report will never come). Safe from any thread.
  void cancel(const std::string& cause);
  // Retention keeps the checkpoint of `step` (the one the run resumed
  // from) until a newer one has committed.
  void protect(int64_t step);

  const CheckpointerOptions& options() const { return options_; }

 private:
  struct Job {
    int64_t step;
    int64_t tokens;
  };
  void writer_loop();
  bool run(const Job& job);
  // Rank 0: gathers every rank's report and commits or abandons.
  bool commit(const Job& job, RankReport own_report, double write_s);
  std::string report_key(int64_t step, int rank) const;
  void recover_interrupted_saves();
  // Renames the finished .partial directory into place; returns whether
  // the parent directory's fsync succeeded (the rename is durable).
  bool publish(const std::filesystem::path& partial, const std::filesystem::path& final_dir);
  void apply_retention();

  CheckpointerOptions options_;
  store::Store* store_;
  ShardWriter writer_;
  std::mutex mutex_;
  std::condition_variable wakeup_;
  std::optional<Job> job_;  // set while a save is pending or running
  bool last_ok_ = true;
  bool stopping_ = false;
  std::string cancelled_;     // why commits are cancelled; empty: they are not
  int64_t protect_step_ = -1;
  std::thread thread_;
};

}  // namespace keel::checkpoint
