#include "trainer/train/rank_state.h"

#include "checkpoint/catalog.h"
#include "checkpoint/manifest.h"
#include "checkpoint/parallel_copy.h"
#include "checkpoint/reader.h"
#include "common/clock.h"
#include "common/error.h"
#include "common/events.h"
#include "common/log.h"
#include "interop/hf_import.h"
#include "trainer/kernels/dtype.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <set>
#include <span>

namespace keel::trainer {
namespace {

// The groups of a checkpoint (docs/architecture.md "Checkpoints"). /model
// holds the weights the model computes with; a run whose GEMMs take bf16
// also saves its float32 master weights as /master, which is then what any
// run loads (/model being their bf16 rounding).
constexpr const char* kModel = "model";
constexpr const char* kMaster = "master";
constexpr const char* kExpAvg = "optim/exp_avg";
constexpr const char* kExpAvgSq = "optim/exp_avg_sq";

bool holds_weights(const std::string& group) { return group == kModel || group == kMaster; }

// A snapshot holds what the rank holds, as it holds it: /model is the
// float32 weights whatever the GEMMs take, so no /master beside it.
const std::vector<std::string> kSnapshotGroups = {kModel, kExpAvg, kExpAvgSq};

// A list of RankState::StateBlock's pieces, and where each lives.
template <class Blocks>
std::vector<checkpoint::Piece> pieces_of(const Blocks& blocks) {
  std::vector<checkpoint::Piece> pieces;
  for (const auto& b : blocks) pieces.push_back(b.piece);
  return pieces;
}
template <class Blocks>
std::vector<float*> locals_of(const Blocks& blocks) {
  std::vector<float*> local;
  for (const auto& b : blocks) local.push_back(b.local);
  return local;
}
// Rounds every span to bf16 in place, in 1 Mi-float chunks over `threads`
// threads: one core would hold training up for the whole model.
void round_to_bf16_in_place(const std::vector<std::span<float>>& spans, unsigned threads) {
  constexpr size_t kChunk = size_t{1} << 20;
  std::vector<std::span<float>> chunks;
  for (const auto& s : spans) {
    for (size_t at = 0; at < s.size(); at += kChunk) chunks.push_back(s.subspan(at, std::min(kChunk, s.size() - at)));
  }
  checkpoint::parallel_each(chunks.size(), threads, [&](size_t i) {
    for (float& value : chunks[i]) value = bf16_rounded(value);
  });
}

size_t bytes_of(const std::vector<checkpoint::Piece>& pieces) {
  size_t bytes = 0;
  for (const auto& p : pieces) bytes += p.bytes();
  return bytes;
}

std::string snapshot_report_key(int64_t generation, int rank) {
  return fmt::format("ckpt/g{}/memory/{}", generation, rank);
}

}  // namespace

RankState::RankState(const common::Config& config, Backend& backend, const ParameterTable& table,
                     ZeroStorage& storage, AdamW& optimizer, int tp_rank, const RankContext& rank,
                     health::BoardPublisher& board, health::FaultInjector& faults)
    : config_(config),
      backend_(backend),
      table_(table),
      storage_(storage),
      optimizer_(optimizer),
      tp_rank_(tp_rank),
      rank_(rank),
      board_(board),
      faults_(faults),
      checkpoint_faults_(checkpoint::FileSystem::real(), faults) {
  const auto& c = config.checkpoint;
  // What a checkpoint records of the layout, and what a snapshot must fit.
  const nlohmann::json saved_layout{{"world_size", rank_.world_size}, {"dp", config.parallel.dp},
                                    {"tp", config.parallel.tp},       {"pp", config.parallel.pp},
                                    {"pp_virtual", config.parallel.pp_virtual}, {"cp", config.parallel.cp},
                                    {"ep", config.parallel.ep},       {"zero", config.parallel.zero}};
  if (c.every_steps > 0 || c.every_seconds > 0) {
    std::filesystem::create_directories(config.checkpoint_dir());
    checkpointer_.emplace(
        checkpoint::CheckpointerOptions{
            config.checkpoint_dir(), config.job.run_dir, c.o_direct, c.keep, c.keep_every, c.timeout_s,
            config.to_json(),
            saved_layout,
            rank_.rank, rank_.world_size, rank_.generation,
            [this](int64_t step, uint64_t bytes, double write_s) {
              faults_.during_save(step);
              checkpoint_faults_.written(step);
              board_.checkpoint_written(step, bytes, write_s);
            },
            c.retention_verify == "full" ? checkpoint::Depth::kChecksums : checkpoint::Depth::kSizes,
            &checkpoint_faults_, rank_.store != nullptr ? store::rank_failed_key(rank_.generation) : std::string(),
            checkpoint::StagingPinning{[this](void* data, size_t bytes) { backend_.pin_host(data, bytes); },
                                       [this](void* data) { backend_.unpin_host(data); }}},
        rank_.store);
  }
  if (c.memory_every_steps != 0 && rank_.snapshot_fd >= 0) {
    // A snapshot is this rank's own state in this layout of this model.
    const std::string fits = fmt::format("rank {} of {}; model {}", rank_.rank, saved_layout.dump(),
                                         config.to_json().at("model").dump());
    snapshots_.emplace(rank_.snapshot_fd,
                       MemorySnapshots::Options{static_cast<int>(c.memory_keep), c.memory_every_steps,
                                                c.memory_stall_budget, checkpoint::layout_hash(fits),
                                                static_cast<unsigned>(config.train.threads), rank_.snapshot_buddy},
                       backend_);
  } else if (c.memory_every_steps > 0) {
    common::logger("checkpoint")
        ->warn("checkpoint.memory_every_steps is {} but keeld gave this rank no snapshot area "
               "(KEEL_SNAPSHOT_FD): no in-memory snapshots are taken",
               c.memory_every_steps);
  }
}

std::vector<std::string> RankState::saved_groups() const {
  if (backend_.gemm_inputs() == DType::kBF16) return {kModel, kMaster, kExpAvg, kExpAvgSq};
  return {kModel, kExpAvg, kExpAvgSq};
}

std::vector<RankState::StateBlock> RankState::state_blocks(bool saved, const std::vector<std::string>& sections) {
  // Saves split every tensor over the ranks that hold the same TP slice
  // (of the same experts) whatever the ZeRO stage, so that they share the
  // writing: its reduce group.
  const ReduceGroups& holders = storage_.groups();
  const ShardLayout save_split(table_, [&](const ParamSpec& spec) { return holders.size(spec); });
  std::vector<StateBlock> blocks;
  for (size_t t = 0; t < table_.specs().size(); ++t) {
    const ParamSpec& spec = table_.specs()[t];
    // Saved once: from TP rank 0 when replicated over TP, from the first
    // stage when tied across the pipeline. Every holder loads it.
    if (saved && ((spec.split == TpSplit::kReplicated && tp_rank_ != 0) || spec.tied_copy)) continue;
    const int64_t row_numel = spec.row_numel();
    const int64_t owned_begin = storage_.owned_row_begin(t);
    for (const std::string& group : sections) {
      const bool model = holds_weights(group);
      int64_t begin = 0, end = spec.rows();
      if (saved) {
        const int writer = holders.rank(spec);
        begin = static_cast<int64_t>(save_split.shard_begin(t, writer)) / row_numel;
        end = begin + static_cast<int64_t>(save_split.shard_numel(t, writer)) / row_numel;
      } else if (!model || storage_.stage() == 3) {
        begin = owned_begin;
        end = begin + storage_.owned_rows(t);
      }
      // Where local row `begin` lives: parameters are whole below ZeRO-3,
      // everything else starts at the first owned row. (The loads that
      // write through these call publish_parameters() after, which makes
      // the GEMMs' copy stale; a save leaves it current.)
      float* base = nullptr;
      if (model && storage_.stage() < 3) {
        base = storage_.params_for_io() + spec.offset + begin * row_numel;
      } else {
        float* owned = model ? storage_.owned_parameters_for_io(t)
                             : (group == kExpAvg ? optimizer_.exp_avg(t) : optimizer_.exp_avg_sq(t));
        base = owned + (begin - owned_begin) * row_numel;
      }
      for (const GlobalBlock& b : spec.global_blocks(begin, end)) {
        checkpoint::Piece piece{group, spec.name, spec.global_shape, b.row, b.col, b.rows, b.cols};
        blocks.push_back(StateBlock{std::move(piece), base + (b.local_row - begin) * row_numel});
      }
    }
  }
  return blocks;
}

void RankState::save_checkpoint(int64_t steps_done) {
  const auto start = std::chrono::steady_clock::now();
  board_.set_phase(health::Phase::kCheckpoint);
  const auto blocks = state_blocks(true, saved_groups());
  auto pieces = pieces_of(blocks);
  const size_t bytes = bytes_of(pieces);
  // Back-pressure: a save still writing is never overwritten. Timed apart
  // from the copy, which is what a save itself costs training.
  checkpointer_->wait();
  const double waited_s = common::seconds_since(start);
  const auto staging = checkpointer_->stage(std::move(pieces));
  std::vector<Backend::HostCopy> copies;
  for (size_t i = 0; i < blocks.size(); ++i) copies.push_back({staging[i], blocks[i].local, blocks[i].piece.bytes()});
  const auto threads = static_cast<unsigned>(config_.train.threads);
  copy_state_to_host(backend_, copies, threads);
  if (backend_.gemm_inputs() == DType::kBF16) {
    // /model gets what the GEMMs multiply; /master keeps the float32 bits.
    std::vector<std::span<float>> model;
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (blocks[i].piece.group == kModel) model.push_back({staging[i], blocks[i].piece.numel()});
    }
    round_to_bf16_in_place(model, threads);
  }
  faults_.stall("checkpoint");
  checkpointer_->save_async(steps_done, steps_done * config_.train.batch_size * config_.model.seq_len);
  last_saved_step_ = steps_done;
  common::logger("checkpoint")
      ->info(
          "checkpoint of step {} staged ({:.1f} MB on this rank): training stalled {:.1f} ms ({:.1f} ms of it "
          "waiting for the previous save)",
          steps_done, static_cast<double>(bytes) / 1e6, common::seconds_since(start) * 1e3, waited_s * 1e3);
}

bool RankState::snapshot_due(int64_t steps_done, double step_s) const {
  return snapshots_ && snapshots_->due(steps_done, step_s);
}

bool RankState::copy_pending() const { return snapshots_ && snapshots_->copied() && !snapshots_->ready_to_copy(); }

void RankState::save_snapshot(int64_t steps_done, bool copy_pending_anywhere) {
  if (!snapshots_) return;
  const bool copy_step = snapshots_->copied() && !copy_pending_anywhere;
  const auto start = std::chrono::steady_clock::now();
  const auto blocks = state_blocks(false, kSnapshotGroups);
  const auto pieces = pieces_of(blocks);
  const size_t bytes = bytes_of(pieces);
  MemorySnapshots::Faults faults{[&] { faults_.during_snapshot(steps_done); },
                                 faults_.corrupts_snapshot(steps_done)};
  try {
    snapshots_->save(pieces, locals_of(blocks), steps_done,
                     steps_done * config_.train.batch_size * config_.model.seq_len, copy_step, faults);
  } catch (const common::Error& e) {
    stop_snapshots(steps_done, e.what());
    return;
  }
  // All training waited, the first lay-out of the area included.
  const double stall_s = common::seconds_since(start);
  board_.snapshot_taken(steps_done, bytes, stall_s);
  common::logger("checkpoint")
      ->debug("in-memory snapshot of step {} ({:.1f} MB): training stalled {:.1f} ms", steps_done,
              static_cast<double>(bytes) / 1e6, stall_s * 1e3);
}

void RankState::stop_snapshots(int64_t step, const std::string& cause) {
  common::logger("checkpoint")->error("in-memory snapshots stop on this rank: {}", cause);
  common::append_event(config_.job.run_dir, "snapshots_stopped", rank_.generation, rank_.rank,
                       {{"step", step}, {"cause", cause}});
  snapshots_.reset();
}

std::vector<std::optional<SnapshotReport>> RankState::gather_snapshot_reports(std::optional<SnapshotReport> own) {
  std::vector<std::optional<SnapshotReport>> reports{std::move(own)};
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(config_.checkpoint.timeout_s));
  for (int r = 1; r < rank_.world_size; ++r) {
    const auto value = store::poll(*rank_.store, snapshot_report_key(rank_.generation, r), deadline);
    if (!value) {
      throw common::Error(common::ErrorCode::kPeerFailure,
                          fmt::format("rank {} did not report its in-memory snapshots within {} s", r,
                                      config_.checkpoint.timeout_s));
    }
    const auto json = nlohmann::json::parse(*value, nullptr, /*allow_exceptions=*/false);
    if (json.is_null()) {
      reports.emplace_back();
    } else {
      reports.push_back(SnapshotReport::from_json(json, r));
    }
  }
  return reports;
}

void RankState::resume() {
  // The saves' staging buffer first: a load into device memory reads
  // through it (restore()), and laid out at the saves' size it is not laid
  // out twice. Kept out of the time the restore reports.
  if (checkpointer_) {
    const auto laid_out = std::chrono::steady_clock::now();
    const auto pieces = pieces_of(state_blocks(true, saved_groups()));
    checkpointer_->reserve(pieces);
    common::logger("checkpoint")
        ->info("checkpoint staging buffer of {:.1f} MB laid out in {:.2f} s",
               static_cast<double>(bytes_of(pieces)) / 1e6, common::seconds_since(laid_out));
  }
  const auto start = std::chrono::steady_clock::now();
  const auto& c = config_.checkpoint;
  const std::string key = fmt::format("ckpt/g{}/resume", rank_.generation);
  // With snapshots on, every rank says what it holds in memory (null: no
  // area). keeld gives every rank an area or none, so rank 0 gathers the
  // reports when it has one, and waits for nothing otherwise.
  std::optional<SnapshotReport> own;
  if (snapshots_) own = snapshots_->report(pieces_of(state_blocks(false, kSnapshotGroups)));
  if (c.memory_every_steps != 0 && rank_.rank != 0 && rank_.store != nullptr) {
    rank_.store->set(snapshot_report_key(rank_.generation, rank_.rank), own ? own->to_json().dump() : "null");
  }
  // Rank 0 chooses and the others follow, so every rank loads the same
  // state (choose_start() says what the choice holds).
  nlohmann::json choice;
  if (rank_.rank == 0) {
    std::optional<SnapshotChoice> newest_in_memory;
    if (own) newest_in_memory = choose_snapshot(gather_snapshot_reports(std::move(own)));
    choice = choose_start(newest_in_memory);
    if (rank_.store != nullptr) rank_.store->set(key, choice.dump());
  } else {
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(c.timeout_s));
    const auto value = store::poll(*rank_.store, key, deadline);
    if (!value) {
      throw common::Error(common::ErrorCode::kPeerFailure,
                          fmt::format("rank 0 did not name the checkpoint to resume from within {} s", c.timeout_s));
    }
    choice = nlohmann::json::parse(*value);
  }
  if (choice.contains("error")) {
    throw common::Error(common::ErrorCode::kCheckpointFailure, choice["error"].get<std::string>());
  }
  std::string from = "disk";
  if (choice.value("from", "") == "memory") {
    from = "memory";
    restore_snapshot(choice["step"].get<int64_t>(), choice.value("saved", false));
  } else if (choice.contains("hf")) {
    from = "hf";
    import_hf(choice["hf"].get<std::string>());
  } else if (!choice["dir"].is_null()) {
    restore(choice["dir"].get<std::string>(), choice["verified"].get<bool>());
  } else {
    from = "start";
  }
  if (snapshots_) {
    // Snapshots after the step resumed from belong to a history this run
    // no longer follows: never restored, whatever the next choice finds.
    snapshots_->discard_after(start_step_);
    try {
      snapshots_->reserve(pieces_of(state_blocks(false, kSnapshotGroups)));
    } catch (const common::Error& e) {
      // The area cannot hold the state (memory): training goes on without
      // snapshots, and this rank's missing ones send the next resume to disk.
      stop_snapshots(start_step_, e.what());
    }
  }
  if (rank_.rank == 0) {
    nlohmann::json fields = {{"from", from}, {"step", start_step_}, {"seconds", common::seconds_since(start)}};
    if (choice.contains("why")) fields["why"] = choice["why"];
    common::append_event(config_.job.run_dir, "state_restored", rank_.generation, rank_.rank, fields);
  }
}

void RankState::restore_snapshot(int64_t step, bool saved) {
  const auto start = std::chrono::steady_clock::now();
  const auto blocks = state_blocks(false, kSnapshotGroups);
  snapshots_->restore(step, locals_of(blocks));
  // ZeRO-3's gathered copies predate the load.
  storage_.publish_parameters();
  start_step_ = step;
  // A committed checkpoint of the same step is neither saved again nor
  // pruned before a newer one commits.
  if (saved) {
    last_saved_step_ = step;
    if (checkpointer_) checkpointer_->protect(step);
  }
  common::logger("checkpoint")
      ->info("resuming from the in-memory snapshot of step {}: copied {:.1f} MB on this rank in {:.3f} s", step,
             static_cast<double>(bytes_of(pieces_of(blocks))) / 1e6, common::seconds_since(start));
}

nlohmann::json RankState::choose_start(const std::optional<SnapshotChoice>& memory) {
  if (!memory) return choose_disk();
  const auto listed = checkpoint::committed(config_.checkpoint_dir());
  const int64_t newest_disk = listed.empty() ? -1 : listed.back().step;
  auto from_memory = [&] {
    nlohmann::json choice = {{"from", "memory"}, {"step", *memory->step}, {"saved", *memory->step == newest_disk}};
    if (!memory->why.empty()) choice["why"] = memory->why;
    return choice;
  };
  // The disk is not read when memory is as new: that is the point.
  if (memory->step && *memory->step >= newest_disk) return from_memory();
  nlohmann::json disk = choose_disk();
  const bool own_checkpoint = disk.contains("step");
  // Newer checkpoints that do not load leave the snapshot the newest state.
  if (memory->step && (!own_checkpoint || disk["step"].get<int64_t>() < *memory->step)) return from_memory();
  if (disk.contains("error")) return disk;
  disk["why"] = memory->step ? fmt::format("the newest in-memory snapshot every rank holds, of step {}, is older "
                                           "than the checkpoint of step {}",
                                           *memory->step, disk["step"].get<int64_t>())
                             : memory->why;
  return disk;
}

nlohmann::json RankState::choose_disk() {
  auto log = common::logger("checkpoint");
  const auto& c = config_.checkpoint;
  auto skipped = [&](const std::filesystem::path& dir, const std::string& why) {
    log->warn("skipping checkpoint {}: {}", dir.string(), why);
    common::append_event(config_.job.run_dir, "checkpoint_skipped", rank_.generation, rank_.rank,
                         {{"dir", dir.string()}, {"cause", why}});
  };
  const bool checksums = c.verify == "full";
  auto fallback = [&]() -> nlohmann::json {
    if (c.init_from.empty() || c.init_from == "none") return {{"dir", nullptr}};
    if (c.init_from.starts_with(common::CheckpointConfig::kHfPrefix)) {
      return {{"hf", c.init_from.substr(common::CheckpointConfig::kHfPrefix.size())}};
    }
    return {{"dir", c.init_from}, {"verified", false}};
  };
  try {
    const auto start = std::chrono::steady_clock::now();
    const auto newest = checkpoint::choose_resume(
        config_.checkpoint_dir(),
        checkpoint::ResumeOptions{checksums ? checkpoint::Depth::kChecksums : checkpoint::Depth::kSizes}, skipped);
    if (newest) {
      // Part of what a resume costs: checksums read every file whole.
      log->info("chose {} in {:.2f} s ({})", newest->dir.string(), common::seconds_since(start),
                checksums ? "every file's checksum checked" : "every file's size checked");
      return {{"dir", newest->dir.string()}, {"verified", checksums}, {"step", newest->step}};
    }
    return fallback();
  } catch (const common::Error& e) {
    // The run's own checkpoints exist but none can be used: only an
    // explicit checkpoint.init_from may start it elsewhere.
    if (c.init_from.empty()) return {{"error", e.what()}};
    log->error("{}; starting from {} as checkpoint.init_from says", e.what(),
               c.init_from == "none" ? std::string("step 0") : c.init_from);
    common::append_event(config_.job.run_dir, "resume_overridden", rank_.generation, rank_.rank,
                         {{"init_from", c.init_from}, {"cause", e.what()}});
    return fallback();
  }
}

std::vector<std::string> RankState::loaded_groups(const checkpoint::CheckpointReader& reader) const {
  return {reader.weights_group(), kExpAvg, kExpAvgSq};
}

void RankState::check_shapes(const checkpoint::CheckpointReader& reader) const {
  std::vector<std::string> problems;
  std::set<std::string> expected;
  const auto stored = reader.tensors();
  auto groups = loaded_groups(reader);
  // /model is checked beside /master too: a bf16 checkpoint holds both.
  if (groups.front() == kMaster) groups.push_back(kModel);
  // Against the whole model: the checkpoint holds every stage's tensors.
  const ParameterTable whole(config_.model);
  for (const ParamSpec& spec : whole.specs()) {
    for (const std::string& group : groups) {
      const std::string path = fmt::format("/{}/{}", group, spec.name);
      expected.insert(path);
      if (!std::binary_search(stored.begin(), stored.end(), path)) {
        problems.push_back(fmt::format("{} is missing from the checkpoint", path));
        continue;
      }
      const auto shape = reader.global_shape(path);
      if (shape != spec.global_shape) {
        problems.push_back(fmt::format("{} has shape [{}] in the checkpoint and [{}] in this model", path,
                                       fmt::join(shape, ", "), fmt::join(spec.global_shape, ", ")));
      }
    }
  }
  for (const auto& path : stored) {
    if (!expected.contains(path)) problems.push_back(fmt::format("{} is in the checkpoint but not in this model", path));
  }
  if (problems.empty()) return;
  // Name the model settings that differ, which is what the operator changes.
  std::vector<std::string> keys;
  const auto saved = reader.manifest().config.value("model", nlohmann::json::object());
  const auto ours = config_.to_json().at("model");
  for (const auto& [key, value] : ours.items()) {
    if (saved.contains(key) && saved[key] != value) {
      keys.push_back(fmt::format("model.{} is {} in the checkpoint and {} here", key, saved[key].dump(), value.dump()));
    }
  }
  constexpr size_t kNamed = 4;  // a whole model's worth of tensors would bury the keys
  const size_t named = std::min(problems.size(), kNamed);
  throw common::Error(
      common::ErrorCode::kBadConfig,
      fmt::format("checkpoint {} does not fit this model: {}{}{}. Set the model as the checkpoint was saved, or "
                  "start from another checkpoint",
                  reader.dir().string(), fmt::join(problems.begin(), problems.begin() + named, "; "),
                  problems.size() > named ? fmt::format(" and {} more", problems.size() - named) : std::string(),
                  keys.empty() ? std::string() : fmt::format(" ({})", fmt::join(keys, "; "))));
}

void RankState::restore(const std::filesystem::path& dir, bool verified) {
  const auto start = std::chrono::steady_clock::now();
  auto log = common::logger("checkpoint");
  checkpoint::CheckpointReader reader(dir);
  check_shapes(reader);
  if (rank_.rank == 0 && !verified && config_.checkpoint.verify == "full") {
    const auto problems = checkpoint::verify_files(dir, reader.manifest());
    if (!problems.empty()) {
      throw common::Error(common::ErrorCode::kCheckpointFailure,
                          fmt::format("checkpoint {} does not verify: {}", dir.string(), problems.front()));
    }
  }
  // Host memory is read into directly. Device memory is read through host
  // memory: the checkpoint staging buffer, pinned (so each piece crosses
  // at DMA speed) and laid out for the saves to come anyway; without
  // checkpoints, pageable memory.
  const auto blocks = state_blocks(false, loaded_groups(reader));
  const double checked_s = common::seconds_since(start);
  std::vector<float*> host = locals_of(blocks);
  std::vector<std::unique_ptr<float[]>> pageable;
  if (!backend_.host_memory() && checkpointer_) {
    host = checkpointer_->stage(pieces_of(blocks));
  } else if (!backend_.host_memory()) {
    for (size_t i = 0; i < blocks.size(); ++i) {
      pageable.emplace_back(new float[blocks[i].piece.numel()]);
      host[i] = pageable.back().get();
    }
  }
  std::vector<checkpoint::CheckpointReader::Request> requests;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const auto& p = blocks[i].piece;
    requests.push_back({p.tensor_path(), p.row, p.col, p.rows, p.cols, host[i]});
  }
  reader.read_all(requests);
  const double read_s = common::seconds_since(start) - checked_s;
  if (!backend_.host_memory()) {
    for (size_t i = 0; i < blocks.size(); ++i)
      backend_.copy_from_host(blocks[i].local, host[i], blocks[i].piece.bytes());
  }
  // ZeRO-3's gathered copies predate the load.
  storage_.publish_parameters();
  start_step_ = reader.manifest().step;
  std::error_code ec;
  // A checkpoint of this run's own directory need not be saved again at
  // the same step, and retention keeps it until a newer one commits; one
  // loaded from elsewhere is saved again.
  if (std::filesystem::equivalent(dir.parent_path(), config_.checkpoint_dir(), ec)) {
    last_saved_step_ = start_step_;
    if (checkpointer_) checkpointer_->protect(start_step_);
  }
  size_t bytes = 0;
  for (const auto& b : blocks) bytes += b.piece.bytes();
  const double load_s = common::seconds_since(start);
  log->info(
      "resuming from {} at step {} (saved as {}): loaded {:.1f} MB on this rank in {:.2f} s (open and "
      "check {:.2f} s, read {:.2f} s, into place {:.2f} s)",
      dir.string(), start_step_, reader.manifest().layout.dump(), static_cast<double>(bytes) / 1e6, load_s, checked_s,
      read_s, load_s - checked_s - read_s);
}

void RankState::import_hf(const std::filesystem::path& dir) {
  const auto start = std::chrono::steady_clock::now();
  const interop::HfWeights weights(dir, config_.model);  // every rank checks every name and shape
  const auto blocks = state_blocks(false, {kModel});
  std::string held;  // the global tensor in `global`: blocks of one tensor come together
  std::vector<float> global, staged;
  size_t bytes = 0;
  for (const auto& b : blocks) {
    const auto& p = b.piece;
    if (p.global_name != held) {
      global = weights.global_tensor(p.global_name);
      held = p.global_name;
    }
    const int64_t global_cols = p.global_shape.size() == 2 ? p.global_shape[1] : 1;
    float* dst = b.local;
    if (!backend_.host_memory()) {
      staged.resize(p.numel());
      dst = staged.data();
    }
    for (int64_t r = 0; r < p.rows; ++r) {
      std::copy_n(global.data() + (p.row + r) * global_cols + p.col, p.cols, dst + r * p.cols);
    }
    if (!backend_.host_memory()) backend_.copy_from_host(b.local, staged.data(), p.bytes());
    bytes += p.bytes();
  }
  storage_.publish_parameters();
  start_step_ = 0;
  common::logger("checkpoint")
      ->info("starting step 0 from the Hugging Face weights in {}: {:.1f} MB on this rank in {:.2f} s, optimizer "
             "state fresh",
             dir.string(), static_cast<double>(bytes) / 1e6, common::seconds_since(start));
}

void RankState::cancel_checkpoint(const std::string& cause) {
  if (checkpointer_) checkpointer_->cancel(cause);
}

std::optional<bool> RankState::save_end(int64_t steps_done) {
  if (!checkpointer_) return std::nullopt;
  if (last_saved_step_ != steps_done) save_checkpoint(steps_done);
  return checkpointer_->wait();
}

}  // namespace keel::trainer
