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
constexpr uint32_t kVersion = 1;
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
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "the state is shared between processes");
static_assert(sizeof(AreaHeader) <= kPage && sizeof(SlotHeader) <= kPage);

SlotHeader& header_of(unsigned char* slot) { return *reinterpret_cast<SlotHeader*>(slot); }
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

}  // namespace

SnapshotArea::SnapshotArea(int fd, int keep) : fd_(fd), keep_(std::max(keep, 1)) { map_existing(); }

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
  unmap();
  const int slots = keep_ + 1;
  const size_t slot_bytes = kPage + table_bytes + round_up(data_bytes, kPage);
  const size_t needed = kPage + static_cast<size_t>(slots) * slot_bytes;
  struct stat st {};
  // keeld may seal the file against shrinking: a smaller state keeps its size.
  const size_t size = fstat(fd_, &st) == 0 ? std::max(needed, static_cast<size_t>(st.st_size)) : needed;
  // The pages are taken now, so that a node short of memory says so here
  // rather than killing the rank at a touch of an unbacked page later.
  if (ftruncate(fd_, static_cast<off_t>(size)) != 0 || fallocate(fd_, 0, 0, static_cast<off_t>(size)) != 0) {
    throw Error(ErrorCode::kCheckpointFailure,
                fmt::format("cannot size the in-memory snapshot area to {} bytes ({} snapshots kept of {} bytes "
                            "each): {}; lower checkpoint.memory_keep or give the node more memory",
                            needed, keep_, slot_bytes, std::strerror(errno)));
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
  for (int s = 0; s < slots; ++s) header_of(slot_at(s)).state.store(kEmpty, std::memory_order_release);
  AreaHeader h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.version = kVersion;
  h.slots = static_cast<uint32_t>(slots);
  h.slot_bytes = slot_bytes;
  h.table_bytes = table_bytes;
  std::memcpy(base_, &h, sizeof(h));
}

unsigned char* SnapshotArea::slot_at(int slot) const { return base_ + kPage + static_cast<size_t>(slot) * slot_bytes_; }

void SnapshotArea::fit(size_t pieces, size_t json_bytes, size_t data_bytes) {
  const size_t table_bytes = round_up(8 * pieces + json_bytes, kPage);
  if (base_ == nullptr || slots_ != keep_ + 1 || table_bytes > table_bytes_ ||
      kPage + table_bytes_ + data_bytes > slot_bytes_) {
    lay_out(table_bytes, data_bytes);
  }
}

void SnapshotArea::reserve(const std::vector<Piece>& pieces) {
  size_t data_bytes = 0;
  data_offsets(pieces, data_bytes);
  fit(pieces.size(), piece_table(pieces).dump().size(), data_bytes);
}

std::vector<float*> SnapshotArea::begin(const std::vector<Piece>& pieces, uint64_t layout) {
  const std::string json = piece_table(pieces).dump();
  size_t data_bytes = 0;
  std::vector<size_t> offsets = data_offsets(pieces, data_bytes);
  fit(pieces.size(), json.size(), data_bytes);
  // The `keep` newest complete slots stay; the next snapshot takes another.
  const std::vector<Listed> complete = list();
  std::vector<bool> kept(static_cast<size_t>(slots_), false);
  for (size_t i = 0; i < complete.size() && i < static_cast<size_t>(keep_); ++i) kept[complete[i].slot] = true;
  int slot = -1;
  for (int s = 0; s < slots_ && slot < 0; ++s) {
    if (!kept[s] && header_of(slot_at(s)).state.load(std::memory_order_acquire) != kComplete) slot = s;
  }
  for (auto it = complete.rbegin(); it != complete.rend() && slot < 0; ++it) {
    if (!kept[it->slot]) slot = it->slot;
  }
  unsigned char* at = slot_at(slot);
  SlotHeader& h = header_of(at);
  h.state.store(kWriting, std::memory_order_release);
  h.pieces = static_cast<uint32_t>(pieces.size());
  h.step = -1;
  h.tokens = 0;
  h.layout_hash = layout;
  h.table_size = json.size();
  h.data_bytes = data_bytes;
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
  uint64_t sequence = 0;
  for (const Listed& l : list()) sequence = std::max(sequence, l.sequence);
  SlotHeader& h = header_of(at);
  h.step = step;
  h.tokens = tokens;
  h.sequence = sequence + 1;
  h.state.store(kComplete, std::memory_order_release);
  writing_ = -1;
  return std::nullopt;
}

std::vector<SnapshotArea::Listed> SnapshotArea::list() const {
  std::vector<Listed> out;
  for (int s = 0; base_ != nullptr && s < slots_; ++s) {
    const SlotHeader& h = header_of(slot_at(s));
    if (h.state.load(std::memory_order_acquire) != kComplete) continue;
    out.push_back({s, h.step, h.tokens, h.sequence, h.data_bytes});
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
    if (h.pieces > kMaxPieces || h.table_size > table_bytes_ ||
        8 * static_cast<size_t>(h.pieces) > table_bytes_ - h.table_size) {
      problem("has a piece table larger than its slot");
      continue;
    }
    const char* json = reinterpret_cast<const char*>(at + kPage + 8 * static_cast<size_t>(h.pieces));
    const auto table = nlohmann::json::parse(json, json + h.table_size, nullptr, /*allow_exceptions=*/false);
    Snapshot snapshot{l, {}, {}};
    try {
      if (!table.is_array() || table.size() != h.pieces) throw std::invalid_argument("not one entry a piece");
      for (const auto& e : table) {
        Piece p{e.at(0).get<std::string>(), e.at(1).get<std::string>(), e.at(2).get<std::vector<int64_t>>(),
                e.at(3).get<int64_t>(),     e.at(4).get<int64_t>(),     e.at(5).get<int64_t>(),
                e.at(6).get<int64_t>()};
        // At most 2^40 floats a piece, so that no sum of sizes overflows.
        constexpr int64_t kMaxNumel = int64_t{1} << 40;
        if (p.rows < 0 || p.cols < 0 || (p.cols > 0 && p.rows > kMaxNumel / p.cols)) {
          throw std::invalid_argument("a piece of negative or impossible size");
        }
        snapshot.pieces.push_back(std::move(p));
      }
    } catch (const std::exception& e) {
      problem(fmt::format("has a piece table that cannot be read ({})", e.what()));
      continue;
    }
    size_t data_bytes = 0;
    const std::vector<size_t> offsets = data_offsets(snapshot.pieces, data_bytes);
    if (kPage + table_bytes_ + data_bytes > slot_bytes_) {
      problem("lists more data than its slot holds");
      continue;
    }
    const unsigned char* data = at + kPage + table_bytes_;
    std::vector<char> matches(snapshot.pieces.size());
    parallel_each(snapshot.pieces.size(), threads, [&](size_t i) {
      uint64_t stored = 0;
      std::memcpy(&stored, at + kPage + 8 * i, sizeof(stored));
      matches[i] = XXH3_64bits(data + offsets[i], snapshot.pieces[i].bytes()) == stored;
    });
    std::string mismatch;
    for (size_t i = 0; i < snapshot.pieces.size(); ++i) {
      if (!matches[i] && mismatch.empty()) mismatch = snapshot.pieces[i].tensor_path();
      snapshot.data.push_back(reinterpret_cast<const float*>(data + offsets[i]));
    }
    if (!mismatch.empty()) {
      problem(fmt::format("does not match its checksum in {}", mismatch));
      continue;
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
