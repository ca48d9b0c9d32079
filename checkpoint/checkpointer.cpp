#include "checkpoint/checkpointer.h"

#include "checkpoint/catalog.h"
#include "checkpoint/manifest.h"
#include "checkpoint/paths.h"
#include "checkpoint/rank_report.h"
#include "checkpoint/reader.h"
#include "common/clock.h"
#include "common/error.h"
#include "common/events.h"
#include "common/log.h"
#include "common/thread_name.h"

#include <fmt/format.h>

#include <chrono>

namespace keel::checkpoint {
namespace {

using Clock = std::chrono::steady_clock;

using keel::common::seconds_since;

}  // namespace

Checkpointer::Checkpointer(CheckpointerOptions options, store::Store* store)
    : options_(std::move(options)), store_(store), writer_(options_.o_direct, *options_.fs, options_.staging_pinning) {
  if (options_.world_size > 1 && store_ == nullptr) {
    throw common::Error(common::ErrorCode::kInternal, "a multi-rank checkpointer needs a store");
  }
  // Nothing else writes here before this rank's first save.
  if (options_.rank == 0) recover_interrupted_saves();
  thread_ = common::named_thread("keel-ckpt-write", [this] { writer_loop(); });
}

void Checkpointer::recover_interrupted_saves() {
  auto log = common::logger("checkpoint");
  FileSystem& fs = *options_.fs;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(options_.root, ec)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with("step_")) continue;
    if (name.ends_with(".deleting")) {
      fs.remove_all(entry.path());
      continue;
    }
    if (!name.ends_with(".partial")) continue;
    const auto final_dir = entry.path().parent_path() / name.substr(0, name.size() - std::string(".partial").size());
    const auto step = step_of(final_dir);
    if (step && std::filesystem::exists(entry.path() / kManifestFile) && !std::filesystem::exists(final_dir)) {
      // Every rank's file was in and the manifest written: only the rename
      // was missing. Commit it if every byte is as the manifest says.
      const Inspection found = inspect(CatalogEntry{*step, entry.path()}, Depth::kChecksums, fs);
      if (found.state == Inspection::State::kGood) {
        publish(entry.path(), final_dir);
        log->warn("recovered checkpoint {}: its save was interrupted after the manifest was written",
                  final_dir.string());
        common::append_event(options_.run_dir, "checkpoint_recovered", options_.generation, options_.rank,
                             {{"step", *step}, {"dir", final_dir.string()}});
        continue;
      }
      if (found.state == Inspection::State::kUnreadable) {
        // Nothing is deleted on a read error; the directory stays for an operator.
        log->error("leaving {} in place: {}", entry.path().string(), found.why);
        continue;
      }
      log->warn("removing {}: an interrupted save whose files do not match its manifest ({})", entry.path().string(),
                found.why);
    }
    fs.remove_all(entry.path());
  }
}
Checkpointer::~Checkpointer() {
  wait();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wakeup_.notify_all();
  thread_.join();
}

void Checkpointer::reserve(std::vector<Piece> pieces) {
  wait();
  writer_.prepare(std::move(pieces));
}

std::vector<float*> Checkpointer::stage(std::vector<Piece> pieces) {
  reserve(std::move(pieces));
  std::vector<float*> staging;
  for (size_t i = 0; i < writer_.pieces().size(); ++i) staging.push_back(writer_.staging(i));
  return staging;
}

void Checkpointer::save_async(int64_t step, int64_t tokens) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = Job{step, tokens};
  }
  wakeup_.notify_all();
}

bool Checkpointer::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  wakeup_.wait(lock, [this] { return !job_; });
  return last_ok_;
}

void Checkpointer::cancel(const std::string& cause) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (cancelled_.empty()) cancelled_ = cause.empty() ? std::string("cancelled") : cause;
}

void Checkpointer::protect(int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  protect_step_ = step;
}

void Checkpointer::writer_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wakeup_.wait(lock, [this] { return stopping_ || job_; });
    if (!job_) return;
    const Job job = *job_;
    lock.unlock();
    bool ok = false;
    try {
      ok = run(job);
    } catch (const std::exception& e) {
      // Nothing escapes the thread; a failed save is an event, not a crash.
      common::logger("checkpoint")->error("checkpoint of step {} failed: {}", job.step, e.what());
    }
    lock.lock();
    last_ok_ = ok;
    job_.reset();
    wakeup_.notify_all();
  }
}

std::string Checkpointer::report_key(int64_t step, int rank) const {
  return fmt::format("ckpt/g{}/{}/{}", options_.generation, step, rank);
}

bool Checkpointer::run(const Job& job) {
  auto log = common::logger("checkpoint");
  const auto start = Clock::now();
  const auto dir = partial_dir(options_.root, job.step);
  RankReport report;
  report.file = rank_file_name(options_.rank);
  const std::string& file = report.file;
  try {
    std::filesystem::create_directories(dir);
    if (const auto bad = writer_.first_non_finite()) {
      throw common::Error(common::ErrorCode::kCheckpointFailure,
                          fmt::format("the state to save holds a non-finite value ({} of {}); a checkpoint is never "
                                      "written from non-finite state",
                                      bad->second, bad->first));
    }
    const nlohmann::json state = {
        {"step", job.step}, {"tokens", job.tokens}, {"rank", options_.rank}, {"layout", options_.layout}};
    const auto written = writer_.write(dir / file, state);
    report.ok = true;
    report.bytes = written.bytes;
    report.xxh3 = written.xxh3;
    report.pieces = writer_.pieces();
    if (options_.on_written) options_.on_written(job.step, written.bytes, seconds_since(start));
  } catch (const std::exception& e) {
    log->error("rank file {} of step {} failed: {}", file, job.step, e.what());
    report.ok = false;
    report.error = e.what();
  }
  const double write_s = seconds_since(start);
  if (options_.world_size > 1) store_->set(report_key(job.step, options_.rank), report.to_json().dump());
  if (options_.rank == 0) return commit(job, std::move(report), write_s);
  return report.ok;
}

bool Checkpointer::commit(const Job& job, RankReport own_report, double write_s) {
  auto log = common::logger("checkpoint");
  FileSystem& fs = *options_.fs;
  const auto start = Clock::now();
  const auto dir = partial_dir(options_.root, job.step);
  std::vector<RankReport> reports;
  reports.push_back(std::move(own_report));
  std::string failure;
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(options_.timeout_s));
  auto cancelled = [this] {
    if (!options_.cancel_key.empty()) {
      if (auto why = store_->get(options_.cancel_key)) cancel(*why);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    return cancelled_;
  };
  for (int r = 1; r < options_.world_size && failure.empty(); ++r) {
    // In short polls so that a cancellation (a peer died: its report will
    // never come) abandons the save at once, not after the timeout.
    std::optional<std::string> value;
    while (!value && failure.empty()) {
      if (const auto why = cancelled(); !why.empty()) {
        failure = "the commit was cancelled: " + why;
      } else if (Clock::now() > deadline) {
        failure = fmt::format("rank {} did not report its file within checkpoint.timeout_s = {} s", r,
                              options_.timeout_s);
      } else {
        value = store::poll(*store_, report_key(job.step, r),
                             std::min(deadline, Clock::now() + std::chrono::milliseconds(200)));
      }
    }
    if (value) {
      store_->remove(report_key(job.step, r));
      try {
        reports.push_back(RankReport::parse(*value, r));
      } catch (const common::Error& e) {
        failure = e.what();
      }
    }
  }
  for (const auto& report : reports) {
    if (failure.empty() && !report.ok) failure = fmt::format("{}: {}", report.file, report.error);
  }
  if (options_.world_size > 1) store_->remove(report_key(job.step, 0));

  const auto final_dir = step_dir(options_.root, job.step);
  uint64_t bytes = 0;
  try {
    if (!failure.empty()) throw common::Error(common::ErrorCode::kCheckpointFailure, failure);
    Manifest manifest;
    manifest.step = job.step;
    manifest.tokens = job.tokens;
    manifest.created = common::utc_now();
    manifest.config = options_.config;
    manifest.layout = options_.layout;
    std::vector<StoredPiece> pieces;
    for (const auto& report : reports) {
      manifest.files.push_back(ManifestFile{report.file, report.bytes, report.xxh3});
      bytes += report.bytes;
      auto listed = report.stored_pieces();
      pieces.insert(pieces.end(), listed.begin(), listed.end());
    }
    write_index(dir, pieces, job.step);
    fs.sync(dir / kIndexFile);
    manifest.files.push_back(
        ManifestFile{kIndexFile, std::filesystem::file_size(dir / kIndexFile), fs.checksum(dir / kIndexFile)});
    write_manifest(dir, manifest);
    fs.sync(dir);
  } catch (const std::exception& e) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    log->error("checkpoint of step {} abandoned, training goes on: {}", job.step, e.what());
    common::append_event(options_.run_dir, "checkpoint_abandoned", options_.generation, options_.rank,
                         {{"step", job.step}, {"cause", e.what()}});
    return false;
  }
  // From the rename on, the checkpoint is committed: nothing below may
  // remove it or report it abandoned.
  bool durable = false;
  try {
    durable = publish(dir, final_dir);
  } catch (const std::exception& e) {
    log->error("checkpoint of step {} was not committed: {}; {} is left for inspection", job.step, e.what(),
               dir.string());
    common::append_event(options_.run_dir, "checkpoint_abandoned", options_.generation, options_.rank,
                         {{"step", job.step}, {"cause", e.what()}});
    return false;
  }
  const double commit_s = seconds_since(start);
  log->info("checkpoint of step {} committed: {} ({:.1f} MB, write {:.2f} s, commit {:.2f} s)", job.step,
            final_dir.string(), bytes / 1e6, write_s, commit_s);
  common::append_event(options_.run_dir, "checkpoint_committed", options_.generation, options_.rank,
                       {{"step", job.step}, {"dir", final_dir.string()}, {"bytes", bytes}, {"write_s", write_s},
                        {"commit_s", commit_s}, {"durable", durable}});
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (job.step > protect_step_) protect_step_ = -1;
  }
  // The older checkpoints are the durable ones while this one may not be.
  if (durable) apply_retention();
  return true;
}

bool Checkpointer::publish(const std::filesystem::path& partial, const std::filesystem::path& final_dir) {
  auto log = common::logger("checkpoint");
  FileSystem& fs = *options_.fs;
  // An earlier save of the same step (a run resumed from an older
  // checkpoint reaches it again) is swapped out atomically, never removed
  // first: at every instant step_N is one complete checkpoint.
  const bool replacing = std::filesystem::exists(final_dir);
  if (replacing) {
    fs.exchange(partial, final_dir);
  } else {
    fs.rename(partial, final_dir);
  }
  bool durable = true;
  try {
    fs.sync(options_.root);
  } catch (const common::Error& e) {
    durable = false;
    log->error("{} is in place but may not survive a crash of the machine: {}; retention is skipped so that the "
               "older checkpoints stay",
               final_dir.string(), e.what());
  }
  if (replacing) {
    try {
      fs.remove_all(partial);  // the old copy, now under the .partial name
    } catch (const common::Error& e) {
      log->warn("could not remove the replaced copy {}: {}", partial.string(), e.what());
    }
  }
  return durable;
}

void Checkpointer::apply_retention() {
  auto log = common::logger("checkpoint");
  RetentionPolicy policy{options_.keep, options_.keep_every};
  {
    std::lock_guard<std::mutex> lock(mutex_);
    policy.protect_step = protect_step_;
  }
  auto good = [&](const CatalogEntry& e) {
    return inspect(e, options_.retention_depth, *options_.fs).state == Inspection::State::kGood;
  };
  for (const auto& doomed : prune_candidates(committed(options_.root), policy, good)) {
    try {
      remove_checkpoint(doomed.dir, *options_.fs);
    } catch (const std::exception& e) {
      log->warn("retention could not remove {}: {}", doomed.dir.string(), e.what());
    }
  }
}

}  // namespace keel::checkpoint
