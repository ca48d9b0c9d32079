#include "checkpoint/memory_snapshot.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "checkpoint/parallel_copy.h"
#include "common/error.h"

namespace keel::checkpoint {

using common::Error;
using common::ErrorCode;

namespace {

constexpr char kMagic[8] = {'K', 'E', 'E', 'L', 'S', 'N', 'A', 'P'};
constexpr uint32_t kVersion = 2;
constexpr size_t kPage = 4096;
constexpr size_t kPieceAlign = 64;
// Bounds on what a header may claim, so that a garbage one cannot make a
// reader walk past the file or allocate without end.
constexpr uint32_t kMaxSlots = 64;
constexpr uint32_t kMaxPieces = 1 << 20;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// At offset 0 of the file.
struct AreaHeader {
  char magic[8];
  uint32_t version;
  uint32_t slots;
  uint64_t slot_bytes;   // each slot: its header page, its table, its data
  uint64_t table_bytes;  // each slot's table: the piece hashes, then the pieces as JSON
  // The newest slot's sequence, kept across lay-outs of the file: keeld
  // tells the slots of a generation by their sequence above it.
  uint64_t last_sequence;
};

enum SlotState : uint32_t { kEmpty = 0, kWriting = 1, kComplete = 2, kQuarantined = 3 };

// At the start of each slot, a page of its own.
struct SlotHeader {
  std::atomic<uint32_t> state;  // SlotState; complete is stored last, with release
  uint32_t pieces;
  uint64_t sequence;
  int64_t step;
  int64_t tokens;
  uint64_t layout_hash;
  uint64_t table_size;  // bytes of the JSON after the hashes
  uint64_t data_bytes;
  uint32_t copy_step;  // 1: the ranks agreed to copy this snapshot to the buddy
  uint32_t unused;
  // The sequence of the snapshot the buddy accepted a copy of, stored by
  // keeld; it counts only while it is the slot's own sequence.
  std::atomic<uint64_t> copied;
};
static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free,
              "the state is shared between processes");
static_assert(sizeof(AreaHeader) <= kPage && sizeof(SlotHeader) <= kPage);

// Before a slot's header or data change: keeld's copy of a complete slot
// (newest_image) reads the state again after its copy, and the fence keeps
// the writes that follow from being seen before `writing` is.
void mark_writing(SlotHeader& h) {
  h.state.store(kWriting, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
}

SlotHeader& header_of(unsigned char* slot) { return *reinterpret_cast<SlotHeader*>(slot); }
std::atomic_ref<uint64_t> last_sequence_of(unsigned char* base) {
  return std::atomic_ref<uint64_t>(reinterpret_cast<AreaHeader*>(base)->last_sequence);
}
const SlotHeader& header_of(const unsigned char* slot) { return *reinterpret_cast<const SlotHeader*>(slot); }

nlohmann::json piece_table(const std::vector<Piece>& pieces) {
  nlohmann::json table = nlohmann::json::array();
  for (const Piece& p : pieces) {
    table.push_back({p.group, p.global_name, p.global_shape, p.row, p.col, p.rows, p.cols});
  }
  return table;
}

// Where each piece's floats start in a slot's data, and the data's size.
std::vector<size_t> data_offsets(const std::vector<Piece>& pieces, size_t& total) {
  std::vector<size_t> offsets;
  total = 0;
  for (const Piece& p : pieces) {
    offsets.push_back(total);
    total += round_up(p.bytes(), kPieceAlign);
  }
  return offsets;
}

// A slot's pieces, read from its table (`pieces` hashes, then
// `json_size` bytes of JSON, within `table_capacity`) and checked against
// their hashes over `data` (`data_capacity` bytes); or why they cannot be.
struct CheckedPieces {
  std::vector<Piece> pieces;
  std::vector<size_t> offsets;  // of each piece's floats in the data
  std::string problem;          // empty: every piece verified
};

CheckedPieces check_pieces(uint64_t pieces, const unsigned char* table, uint64_t json_size, size_t table_capacity,
                           const unsigned char* data, size_t data_capacity, unsigned threads) {
  CheckedPieces out;
  if (pieces > kMaxPieces || json_size > table_capacity || 8 * pieces > table_capacity - json_size) {
    out.problem = "has a piece table larger than its slot";
    return out;
  }
  const char* json = reinterpret_cast<const char*>(table + 8 * pieces);
  const auto parsed = nlohmann::json::parse(json, json + json_size, nullptr, /*allow_exceptions=*/false);
  try {
    if (!parsed.is_array() || parsed.size() != pieces) throw std::invalid_argument("not one entry a piece");
    for (const auto& e : parsed) {
      Piece p{e.at(0).get<std::string>(), e.at(1).get<std::string>(), e.at(2).get<std::vector<int64_t>>(),
              e.at(3).get<int64_t>(),     e.at(4).get<int64_t>(),     e.at(5).get<int64_t>(),
              e.at(6).get<int64_t>()};
      // At most 2^40 floats a piece, so that no sum of sizes overflows.
      constexpr int64_t kMaxNumel = int64_t{1} << 40;
      if (p.rows < 0 || p.cols < 0 || (p.cols > 0 && p.rows > kMaxNumel / p.cols)) {
        throw std::invalid_argument("a piece of negative or impossible size");
      }
      out.pieces.push_back(std::move(p));
    }
  } catch (const std::exception& e) {
    out.pieces.clear();
    out.problem = fmt::format("has a piece table that cannot be read ({})", e.what());
    return out;
  }
  size_t data_bytes = 0;
  out.offsets = data_offsets(out.pieces, data_bytes);
  if (data_bytes > data_capacity) {
    out.problem = "lists more data than its slot holds";
    return out;
  }
  std::vector<char> matches(out.pieces.size());
  parallel_each(out.pieces.size(), threads, [&](size_t i) {
    uint64_t stored = 0;
    std::memcpy(&stored, table + 8 * i, sizeof(stored));
    matches[i] = XXH3_64bits(data + out.offsets[i], out.pieces[i].bytes()) == stored;
  });
  for (size_t i = 0; i < out.pieces.size(); ++i) {
    if (matches[i]) continue;
    out.problem = fmt::format("does not match its checksum in {}", out.pieces[i].tensor_path());
    break;
  }
  return out;
}

}  // namespace

std::optional<std::string> SnapshotImage::check(unsigned threads) const {
  const CheckedPieces checked =
      check_pieces(pieces, reinterpret_cast<const unsigned char*>(table.data()),
                   table.size() < 8 * static_cast<uint64_t>(pieces) ? table.size() + 1 : table.size() - 8 * pieces,
                   table.size(), data.get(), data_bytes, threads);
  if (!checked.problem.empty()) return fmt::format("the copy of the snapshot of step {} {}", step, checked.problem);
  size_t expected = 0;
  data_offsets(checked.pieces, expected);
  if (expected != data_bytes) {
    return fmt::format("the copy of the snapshot of step {} holds {} bytes of data where its table lists {}", step,
                       data_bytes, expected);
  }
  return std::nullopt;
}

SnapshotArea::SnapshotArea(int fd, int keep, bool copied)
    : fd_(fd), keep_(std::max(keep, 1)), copy_steps_kept_(copied ? 2 : 0) {
  map_existing();
}

SnapshotArea::~SnapshotArea() { unmap(); }

void SnapshotArea::unmap() {
  if (base_ != nullptr) munmap(base_, mapped_);
  base_ = nullptr;
  mapped_ = 0;
  slots_ = 0;
}

bool SnapshotArea::map_existing() {
  struct stat st {};
  if (fstat(fd_, &st) != 0 || static_cast<size_t>(st.st_size) < kPage) return false;
  const size_t size = static_cast<size_t>(st.st_size);
  void* at = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (at == MAP_FAILED) return false;
  base_ = static_cast<unsigned char*>(at);
  mapped_ = size;
  AreaHeader h;
  std::memcpy(&h, base_, sizeof(h));
  const bool sane = std::memcmp(h.magic, kMagic, sizeof(kMagic)) == 0 && h.version == kVersion && h.slots >= 2 &&
                    h.slots <= kMaxSlots && h.table_bytes % kPage == 0 && h.slot_bytes % kPage == 0 &&
                    h.slot_bytes >= kPage + h.table_bytes && h.slot_bytes <= size &&
                    kPage + h.slots * h.slot_bytes <= size;
  if (!sane) {
    unmap();
    return false;
  }
  slots_ = static_cast<int>(h.slots);
  slot_bytes_ = h.slot_bytes;
  table_bytes_ = h.table_bytes;
  return true;
}

void SnapshotArea::lay_out(size_t table_bytes, size_t data_bytes) {
  const uint64_t last_sequence = this->last_sequence();
  unmap();
  const int slots = slot_count();
  const size_t slot_bytes = kPage + table_bytes + round_up(data_bytes, kPage);
  const size_t needed = kPage + static_cast<size_t>(slots) * slot_bytes;
  struct stat st {};
  // keeld may seal the file against shrinking: a smaller state keeps its size.
  const size_t size = fstat(fd_, &st) == 0 ? std::max(needed, static_cast<size_t>(st.st_size)) : needed;
  // The pages are taken now, so that a node short of memory says so here
  // rather than killing the rank at a touch of an unbacked page later.
  if (ftruncate(fd_, static_cast<off_t>(size)) != 0 || fallocate(fd_, 0, 0, static_cast<off_t>(size)) != 0) {
    throw Error(
        ErrorCode::kCheckpointFailure,
        fmt::format("cannot size the in-memory snapshot area to {} bytes ({} slots of {} bytes: {} "
                    "snapshots kept{}, one written): {}; lower checkpoint.memory_keep or give the node more "
                    "memory",
                    needed, slots, slot_bytes, keep_,
                    copy_steps_kept_ > 0 ? " and the two copy steps of the buddy copy" : "", std::strerror(errno)));
  }
  void* at = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (at == MAP_FAILED) {
    throw Error(ErrorCode::kCheckpointFailure,
                fmt::format("cannot map the in-memory snapshot area ({} bytes): {}", size, std::strerror(errno)));
  }
  // Only the rank lays an area out, to write it. The first touch of each
  // page costs far more than any later one (seen: 1.9 s against 0.1 s for
  // 3.3 GB on the CI VM), so it is paid here rather than in the first
  // snapshots' copies, which training waits for. Best effort: a kernel
  // before 5.14 has no MADV_POPULATE_WRITE.
  constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE
  madvise(at, size, kPopulateWrite);
  base_ = static_cast<unsigned char*>(at);
  mapped_ = size;
  slots_ = slots;
  slot_bytes_ = slot_bytes;
  table_bytes_ = table_bytes;
  for (int s = 0; s < slots; ++s) {
    SlotHeader& h = header_of(slot_at(s));
    h.sequence = 0;
    h.copied.store(0, std::memory_order_relaxed);
    h.state.store(kEmpty, std::memory_order_release);
  }
  AreaHeader h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.version = kVersion;
  h.slots = static_cast<uint32_t>(slots);
  h.slot_bytes = slot_bytes;
  h.table_bytes = table_bytes;
  h.last_sequence = last_sequence;
  std::memcpy(base_, &h, sizeof(h));
}

uint64_t SnapshotArea::last_sequence() const {
  return base_ == nullptr ? 0 : last_sequence_of(base_).load(std::memory_order_acquire);
}

unsigned char* SnapshotArea::slot_at(int slot) const { return base_ + kPage + static_cast<size_t>(slot) * slot_bytes_; }

void SnapshotArea::fit(size_t pieces, size_t json_bytes, size_t data_bytes) {
  const size_t table_bytes = round_up(8 * pieces + json_bytes, kPage);
  if (base_ == nullptr || slots_ != slot_count() || table_bytes > table_bytes_ ||
      kPage + table_bytes_ + data_bytes > slot_bytes_) {
    lay_out(table_bytes, data_bytes);
  }
}

void SnapshotArea::reserve(const std::vector<Piece>& pieces) {
  size_t data_bytes = 0;
  data_offsets(pieces, data_bytes);
  fit(pieces.size(), piece_table(pieces).dump().size(), data_bytes);
}

std::vector<float*> SnapshotArea::begin(const std::vector<Piece>& pieces, uint64_t layout, bool copy_step) {
  const std::string json = piece_table(pieces).dump();
  size_t data_bytes = 0;
  std::vector<size_t> offsets = data_offsets(pieces, data_bytes);
  fit(pieces.size(), json.size(), data_bytes);
  const int slot = next_slot();
  unsigned char* at = slot_at(slot);
  SlotHeader& h = header_of(at);
  mark_writing(h);
  h.pieces = static_cast<uint32_t>(pieces.size());
  h.step = -1;
  h.tokens = 0;
  h.layout_hash = layout;
  h.table_size = json.size();
  h.data_bytes = data_bytes;
  h.copy_step = copy_step ? 1 : 0;
  h.copied.store(0, std::memory_order_relaxed);
  std::memset(at + kPage, 0, 8 * pieces.size());
  std::memcpy(at + kPage + 8 * pieces.size(), json.data(), json.size());
  writing_ = slot;
  begun_ = pieces;
  begun_offsets_ = offsets;
  std::vector<float*> out;
  for (size_t offset : offsets) out.push_back(reinterpret_cast<float*>(at + kPage + table_bytes_ + offset));
  return out;
}

std::optional<std::string> SnapshotArea::commit(int64_t step, int64_t tokens, unsigned threads) {
  if (writing_ < 0) throw Error(ErrorCode::kInternal, "SnapshotArea::commit without begin");
  unsigned char* at = slot_at(writing_);
  unsigned char* data = at + kPage + table_bytes_;
  std::vector<std::optional<float>> non_finite(begun_.size());
  parallel_each(begun_.size(), threads, [&](size_t i) {
    const auto* values = reinterpret_cast<const float*>(data + begun_offsets_[i]);
    non_finite[i] = first_non_finite(values, begun_[i].numel());
    const uint64_t hash = XXH3_64bits(values, begun_[i].bytes());
    std::memcpy(at + kPage + 8 * i, &hash, sizeof(hash));
  });
  for (size_t i = 0; i < begun_.size(); ++i) {
    if (!non_finite[i]) continue;
    writing_ = -1;
    return fmt::format("the state of step {} holds a non-finite value ({} in {})", step, *non_finite[i],
                       begun_[i].tensor_path());
  }
  complete(at, step, tokens);
  writing_ = -1;
  return std::nullopt;
}

int SnapshotArea::next_slot() const {
  // The `keep` newest complete slots stay, and so do the newest copy steps
  // (the buddy's copies are of them); the next snapshot takes another.
  const std::vector<Listed> complete = list();
  std::vector<bool> kept(static_cast<size_t>(slots_), false);
  for (size_t i = 0; i < complete.size() && i < static_cast<size_t>(keep_); ++i) kept[complete[i].slot] = true;
  int copy_steps = 0;
  for (size_t i = 0; i < complete.size() && copy_steps < copy_steps_kept_; ++i) {
    if (!complete[i].copy_step) continue;
    kept[complete[i].slot] = true;
    ++copy_steps;
  }
  for (int s = 0; s < slots_; ++s) {
    if (!kept[s] && header_of(slot_at(s)).state.load(std::memory_order_acquire) != kComplete) return s;
  }
  for (auto it = complete.rbegin(); it != complete.rend(); ++it) {
    if (!kept[it->slot]) return it->slot;
  }
  return 0;  // unreachable: there are more slots than kept ones
}

void SnapshotArea::complete(unsigned char* at, int64_t step, int64_t tokens) {
  // One writer at a time (the rank, or keeld's import while no rank
  // runs), so the file's count is the newest slot's.
  const uint64_t sequence = last_sequence() + 1;
  SlotHeader& h = header_of(at);
  h.step = step;
  h.tokens = tokens;
  h.sequence = sequence;
  last_sequence_of(base_).store(sequence, std::memory_order_release);
  h.state.store(kComplete, std::memory_order_release);
}

std::optional<SnapshotImage> SnapshotArea::image_of(int64_t step) const {
  const std::vector<Listed> complete = list();
  const auto listed =
      std::find_if(complete.begin(), complete.end(), [&](const Listed& l) { return l.step == step; });
  if (listed == complete.end()) return std::nullopt;
  const unsigned char* at = slot_at(listed->slot);
  const SlotHeader& h = header_of(at);
  SnapshotImage image;
  image.sequence = listed->sequence;
  image.step = h.step;
  image.tokens = h.tokens;
  image.layout_hash = h.layout_hash;
  image.pieces = h.pieces;
  const uint64_t table_size = 8 * static_cast<uint64_t>(h.pieces) + h.table_size;
  if (h.pieces > kMaxPieces || table_size > table_bytes_ || h.data_bytes > slot_bytes_ - kPage - table_bytes_) {
    return std::nullopt;  // a header that does not add up: the copy would not check() anyway
  }
  image.table.assign(reinterpret_cast<const char*>(at + kPage), table_size);
  image.data_bytes = h.data_bytes;
  image.data.reset(new unsigned char[image.data_bytes]);
  std::memcpy(image.data.get(), at + kPage + table_bytes_, image.data_bytes);
  // The rank marks a slot writing before it touches it, and a slot it
  // completes again gets a higher sequence: a slot still complete under the
  // same sequence after the copy was not written during it.
  std::atomic_thread_fence(std::memory_order_acquire);
  if (h.state.load(std::memory_order_acquire) != kComplete || h.sequence != listed->sequence) {
    return std::nullopt;
  }
  return image;
}

bool SnapshotArea::mark_copied(int64_t step, uint64_t sequence) {
  for (const Listed& l : list()) {
    if (l.step != step || l.sequence != sequence) continue;
    header_of(slot_at(l.slot)).copied.store(sequence, std::memory_order_release);
    return true;
  }
  return false;
}

void SnapshotArea::import(const std::vector<const SnapshotImage*>& images) {
  bool cleared = false;
  for (const SnapshotImage* image : images) {
    const size_t json_bytes = image->table.size() - 8 * static_cast<size_t>(image->pieces);
    fit(image->pieces, json_bytes, image->data_bytes);
    if (!cleared) {
      // What the area held was another rank's (keeld imports only into an
      // area whose rank numbering moved, or a fresh one).
      for (const Listed& l : list()) header_of(slot_at(l.slot)).state.store(kEmpty, std::memory_order_release);
      cleared = true;
    }
    unsigned char* at = slot_at(next_slot());
    SlotHeader& h = header_of(at);
    mark_writing(h);
    h.pieces = image->pieces;
    h.layout_hash = image->layout_hash;
    h.table_size = json_bytes;
    h.data_bytes = image->data_bytes;
    h.copy_step = 1;
    std::memcpy(at + kPage, image->table.data(), image->table.size());
    parallel_copy({{at + kPage + table_bytes_, image->data.get(), image->data_bytes}}, 0);
    complete(at, image->step, image->tokens);
    h.copied.store(h.sequence, std::memory_order_release);
  }
}

std::vector<SnapshotArea::Listed> SnapshotArea::list() const {
  std::vector<Listed> out;
  for (int s = 0; base_ != nullptr && s < slots_; ++s) {
    const SlotHeader& h = header_of(slot_at(s));
    if (h.state.load(std::memory_order_acquire) != kComplete) continue;
    Listed l{s, h.step, h.tokens, h.sequence, h.data_bytes, h.copy_step != 0};
    l.copied = h.copied.load(std::memory_order_acquire) == l.sequence;
    // keeld lists while the rank may begin overwriting the slot: what it
    // read counts only if the slot is still complete under that sequence.
    std::atomic_thread_fence(std::memory_order_acquire);
    if (h.state.load(std::memory_order_acquire) != kComplete || h.sequence != l.sequence) continue;
    out.push_back(l);
  }
  std::sort(out.begin(), out.end(), [](const Listed& a, const Listed& b) { return a.sequence > b.sequence; });
  return out;
}

SnapshotArea::Verified SnapshotArea::verified(uint64_t layout, unsigned threads) const {
  Verified out;
  for (const Listed& l : list()) {
    const unsigned char* at = slot_at(l.slot);
    const SlotHeader& h = header_of(at);
    auto problem = [&](const std::string& why) {
      out.problems.push_back(fmt::format("the in-memory snapshot of step {} (slot {}) {}", l.step, l.slot, why));
    };
    if (h.layout_hash != layout) {
      problem("is of another layout");
      continue;
    }
    CheckedPieces checked = check_pieces(h.pieces, at + kPage, h.table_size, table_bytes_, at + kPage + table_bytes_,
                                         slot_bytes_ - kPage - table_bytes_, threads);
    if (!checked.problem.empty()) {
      problem(checked.problem);
      continue;
    }
    Snapshot snapshot{l, std::move(checked.pieces), {}};
    for (size_t offset : checked.offsets) {
      snapshot.data.push_back(reinterpret_cast<const float*>(at + kPage + table_bytes_ + offset));
    }
    out.snapshots.push_back(std::move(snapshot));
  }
  return out;
}

int SnapshotArea::quarantine_after(int64_t step) {
  int moved = 0;
  for (const Listed& l : list()) {
    if (l.step <= step) continue;
    header_of(slot_at(l.slot)).state.store(kQuarantined, std::memory_order_release);
    ++moved;
  }
  return moved;
}

uint64_t layout_hash(const std::string& layout_json) { return XXH3_64bits(layout_json.data(), layout_json.size()); }

}  // namespace keel::checkpoint
