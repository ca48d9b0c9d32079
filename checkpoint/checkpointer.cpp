#include "checkpoint/checkpointer.h"

#include "checkpoint/catalog.h"
#include "checkpoint/manifest.h"
#include "checkpoint/paths.h"
#include "checkpoint/reader.h"
#include "common/error.h"
#include "common/events.h"
#include "common/log.h"

#include <fmt/format.h>

#include <chrono>

namespace keel::checkpoint {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

}  // namespace

Checkpointer::Checkpointer(CheckpointerOptions options, common::Store* store)
    : options_(std::move(options)), store_(store), writer_(options_.o_direct) {
  if (options_.world_size > 1 && store_ == nullptr) {
    throw common::Error(common::ErrorCode::kInternal, "a multi-rank checkpointer needs a store");
  }
  if (options_.rank == 0) {
    // Leftovers of saves or removals a crash interrupted are never
    // checkpoints; nothing else writes here before this rank's first save.
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(options_.root, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.starts_with("step_") && (name.ends_with(".partial") || name.ends_with(".deleting"))) {
        std::filesystem::remove_all(entry.path(), ec);
      }
    }
  }
  thread_ = std::thread([this] { writer_loop(); });
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

std::vector<float*> Checkpointer::stage(std::vector<Piece> pieces) {
  wait();
  writer_.prepare(std::move(pieces));
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
  const std::string file = rank_file_name(options_.rank);
  nlohmann::json report;
  try {
    std::filesystem::create_directories(dir);
    const nlohmann::json state = {
        {"step", job.step}, {"tokens", job.tokens}, {"rank", options_.rank}, {"layout", options_.layout}};
    const auto written = writer_.write(dir / file, state);
    report = {{"ok", true}, {"file", file}, {"bytes", written.bytes}, {"xxh3", written.xxh3}};
    if (options_.on_written) options_.on_written(job.step, written.bytes, seconds_since(start));
  } catch (const std::exception& e) {
    log->error("rank file {} of step {} failed: {}", file, job.step, e.what());
    report = {{"ok", false}, {"file", file}, {"error", e.what()}};
  }
  const double write_s = seconds_since(start);
  if (options_.world_size > 1) store_->set(report_key(job.step, options_.rank), report.dump());
  if (options_.rank == 0) return commit(job, report, write_s);
  return report.at("ok").get<bool>();
}

bool Checkpointer::commit(const Job& job, const nlohmann::json& own_report, double write_s) {
  auto log = common::logger("checkpoint");
  const auto start = Clock::now();
  const auto dir = partial_dir(options_.root, job.step);
  std::vector<nlohmann::json> reports = {own_report};
  std::string failure;
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(options_.timeout_s));
  for (int r = 1; r < options_.world_size && failure.empty(); ++r) {
    if (auto value = common::poll(*store_, report_key(job.step, r), deadline)) {
      reports.push_back(nlohmann::json::parse(*value));
      store_->remove(report_key(job.step, r));
    } else {
      failure = fmt::format("rank {} did not report its file within checkpoint.timeout_s = {} s", r,
                            options_.timeout_s);
    }
  }
  for (const auto& report : reports) {
    if (failure.empty() && !report.at("ok").get<bool>()) {
      failure = fmt::format("{}: {}", report.at("file").get<std::string>(), report.at("error").get<std::string>());
    }
  }
  if (options_.world_size > 1) store_->remove(report_key(job.step, 0));

  try {
    if (!failure.empty()) throw common::Error(common::ErrorCode::kCheckpointFailure, failure);
    Manifest manifest;
    manifest.step = job.step;
    manifest.tokens = job.tokens;
    manifest.created = common::utc_now();
    manifest.config = options_.config;
    manifest.layout = options_.layout;
    std::vector<StoredPiece> pieces;
    uint64_t bytes = 0;
    for (const auto& report : reports) {
      const std::string file = report.at("file");
      manifest.files.push_back(ManifestFile{file, report.at("bytes"), report.at("xxh3")});
      bytes += report.at("bytes").get<uint64_t>();
      auto listed = list_pieces(dir, file);
      pieces.insert(pieces.end(), listed.begin(), listed.end());
    }
    write_index(dir, pieces, job.step);
    fsync_path(dir / kIndexFile);
    manifest.files.push_back(
        ManifestFile{kIndexFile, std::filesystem::file_size(dir / kIndexFile), file_xxh3(dir / kIndexFile)});
    write_manifest(dir, manifest);
    fsync_path(dir);
    const auto final_dir = step_dir(options_.root, job.step);
    if (std::filesystem::exists(final_dir)) remove_checkpoint(final_dir);
    std::filesystem::rename(dir, final_dir);
    fsync_path(options_.root);
    const double commit_s = seconds_since(start);
    log->info("checkpoint of step {} committed: {} ({:.1f} MB, write {:.2f} s, commit {:.2f} s)", job.step,
              final_dir.string(), bytes / 1e6, write_s, commit_s);
    common::append_event(options_.run_dir, "checkpoint_committed", options_.generation, options_.rank,
                         {{"step", job.step}, {"dir", final_dir.string()}, {"bytes", bytes}, {"write_s", write_s},
                          {"commit_s", commit_s}});
  } catch (const std::exception& e) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    log->error("checkpoint of step {} abandoned, training goes on: {}", job.step, e.what());
    common::append_event(options_.run_dir, "checkpoint_abandoned", options_.generation, options_.rank,
                         {{"step", job.step}, {"cause", e.what()}});
    return false;
  }
  for (const auto& doomed : prune_candidates(committed(options_.root), options_.keep, options_.keep_every)) {
    try {
      remove_checkpoint(doomed.dir);
    } catch (const std::exception& e) {
      log->warn("retention could not remove {}: {}", doomed.dir.string(), e.what());
    }
  }
  return true;
}

}  // namespace keel::checkpoint
