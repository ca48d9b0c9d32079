#include "health/progress_board.h"

#include "common/error.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <type_traits>
#include <utility>

namespace keel::health {
namespace {

constexpr size_t kSnapshotWords = (sizeof(BoardSnapshot) + 7) / 8;
static_assert(std::is_trivially_copyable_v<BoardSnapshot>);
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free, "the board needs lock-free 64-bit atomics across processes");

// A reader gives up after this many torn copies and reports nothing; the
// writer publishes a few hundred bytes, so collisions in a row are rare.
constexpr int kReadAttempts = 64;

}  // namespace

struct ProgressBoard::Layout {
  std::atomic<uint64_t> sequence;             // odd while a write is in progress; 0: never published
  std::atomic<uint64_t> checkpoint_requests;  // written by keeld
  std::atomic<int64_t> heartbeat_ns;          // written by the rank's heartbeat thread
  // keeld's fault requests: a seqlock of its own, written by keeld only.
  std::atomic<uint64_t> fault_sequence;
  std::array<std::atomic<uint64_t>, (sizeof(FaultRequest) + 7) / 8> fault_words;
  std::array<std::atomic<uint64_t>, kSnapshotWords> words;
};

const char* phase_name(uint32_t phase) {
  static constexpr const char* kNames[kPhaseCount] = {"init",      "data",       "forward",    "backward",
                                                      "optimizer", "checkpoint", "validation", "idle"};
  return phase < kPhaseCount ? kNames[phase] : "unknown";
}

const char* collective_state_name(uint32_t state) {
  static constexpr const char* kNames[] = {"none", "in_flight", "done", "failed"};
  return state < 4 ? kNames[state] : "unknown";
}

const char* fault_kind_name(uint32_t kind) {
  static constexpr const char* kNames[] = {"none", "crash", "hang", "slow", "bitflip", "nan"};
  return kind < 6 ? kNames[kind] : "unknown";
}

const char* sdc_method_name(uint32_t method) {
  static constexpr const char* kNames[] = {"none", "replica_digest", "rerun", "kat"};
  return method < 4 ? kNames[method] : "unknown";
}

const char* sdc_verdict_name(uint32_t verdict) {
  static constexpr const char* kNames[] = {"none", "transient", "persistent"};
  return verdict < 3 ? kNames[verdict] : "unknown";
}

std::string group_name(const GroupRecord& group) {
  return board_text(group.name);
}

std::string group_kind(std::string_view group) {
  std::string_view kind = group;
  const auto digits = [](std::string_view s) {
    return !s.empty() &&
           std::all_of(s.begin(), s.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; });
  };
  const auto first = kind.find('.');
  if (first != std::string_view::npos && kind[0] == 'g' && digits(kind.substr(1, first - 1))) {
    kind.remove_prefix(first + 1);
  }
  if (const auto dot = kind.rfind('.'); dot != std::string_view::npos && digits(kind.substr(dot + 1))) {
    kind.remove_suffix(kind.size() - dot);
  }
  return std::string(kind.empty() ? group : kind);
}

int pipeline_stage(const BoardSnapshot& board) {
  for (const auto& g : board.groups) {
    if (g.name[0] != '\0' && group_kind(group_name(g)) == "pp") {
      return g.index >= 0 && g.index < g.size ? g.index : 0;
    }
  }
  return 0;
}

const StepTiming* BoardSnapshot::timing_of(int64_t step) const {
  if (step < 0) return nullptr;
  const StepTiming& slot = steps[static_cast<size_t>(step) % kRecentSteps];
  return slot.step == step ? &slot : nullptr;
}

const GroupRecord* BoardSnapshot::group(std::string_view name) const {
  for (const auto& g : groups) {
    if (g.name[0] != '\0' && group_name(g) == name) return &g;
  }
  return nullptr;
}

std::string board_name(int pid, int local_rank) { return fmt::format("/keel.{}.{}", pid, local_rank); }

ProgressBoard::ProgressBoard(std::string name, Layout* layout) : name_(std::move(name)), layout_(layout) {}

ProgressBoard::ProgressBoard(ProgressBoard&& other) noexcept
    : name_(std::move(other.name_)), layout_(std::exchange(other.layout_, nullptr)) {}

ProgressBoard& ProgressBoard::operator=(ProgressBoard&& other) noexcept {
  if (this != &other) {
    if (layout_ != nullptr) munmap(layout_, sizeof(Layout));
    name_ = std::move(other.name_);
    layout_ = std::exchange(other.layout_, nullptr);
  }
  return *this;
}

ProgressBoard::~ProgressBoard() {
  if (layout_ != nullptr) munmap(layout_, sizeof(Layout));
}

namespace {

void* map_segment(int fd, size_t bytes, const std::string& name, common::ErrorCode code) {
  void* at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (at == MAP_FAILED) {
    throw common::Error(code, fmt::format("cannot map progress board {}: {}", name, std::strerror(err)));
  }
  return at;
}

}  // namespace

ProgressBoard ProgressBoard::create(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0 || ftruncate(fd, sizeof(Layout)) != 0) {
    const int err = errno;
    if (fd >= 0) close(fd);
    throw common::Error(common::ErrorCode::kInternal,
                        fmt::format("cannot create progress board {} in /dev/shm: {}", name, std::strerror(err)));
  }
  // ftruncate of a new or truncated segment gives zeroes: sequence 0, no requests.
  return ProgressBoard(name,
                       static_cast<Layout*>(map_segment(fd, sizeof(Layout), name, common::ErrorCode::kInternal)));
}

ProgressBoard ProgressBoard::open(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    throw common::Error(common::ErrorCode::kBadConfig,
                        fmt::format("KEEL_BOARD={}: no such progress board ({}); keeld creates it before it starts "
                                    "the rank, so unset KEEL_BOARD to run by hand",
                                    name, std::strerror(errno)));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != sizeof(Layout)) {
    close(fd);
    throw common::Error(common::ErrorCode::kBadConfig,
                        fmt::format("KEEL_BOARD={} is {} bytes, not a progress board of this build ({} bytes)", name,
                                    st.st_size, sizeof(Layout)));
  }
  return ProgressBoard(name,
                       static_cast<Layout*>(map_segment(fd, sizeof(Layout), name, common::ErrorCode::kBadConfig)));
}

void ProgressBoard::remove(const std::string& name) { shm_unlink(name.c_str()); }

namespace {

// The seqlock over `words`: see the header.
template <class T, size_t N>
void seqlock_write(std::atomic<uint64_t>& sequence, std::array<std::atomic<uint64_t>, N>& to, const T& value) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= N * 8);
  std::array<uint64_t, N> words{};
  std::memcpy(words.data(), &value, sizeof(value));
  const uint64_t seq = sequence.load(std::memory_order_relaxed);
  sequence.store(seq + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  for (size_t i = 0; i < N; ++i) to[i].store(words[i], std::memory_order_relaxed);
  sequence.store(seq + 2, std::memory_order_release);
}

template <class T, size_t N>
std::optional<T> seqlock_read(const std::atomic<uint64_t>& sequence, const std::array<std::atomic<uint64_t>, N>& from) {
  std::array<uint64_t, N> words{};
  for (int attempt = 0; attempt < kReadAttempts; ++attempt) {
    const uint64_t before = sequence.load(std::memory_order_acquire);
    if (before == 0) return std::nullopt;
    if (before % 2 == 1) continue;
    for (size_t i = 0; i < N; ++i) words[i] = from[i].load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (sequence.load(std::memory_order_relaxed) != before) continue;
    T value;
    std::memcpy(static_cast<void*>(&value), words.data(), sizeof(value));
    return value;
  }
  return std::nullopt;
}

}  // namespace

void ProgressBoard::publish(const BoardSnapshot& snapshot) { seqlock_write(layout_->sequence, layout_->words, snapshot); }

std::optional<BoardSnapshot> ProgressBoard::read() const {
  auto snapshot = seqlock_read<BoardSnapshot>(layout_->sequence, layout_->words);
  if (!snapshot || snapshot->version != kBoardVersion) return std::nullopt;
  return snapshot;
}

void ProgressBoard::request_fault(FaultRequest request) {
  const FaultRequest previous = fault_request();
  request.count = previous.count + 1;
  seqlock_write(layout_->fault_sequence, layout_->fault_words, request);
}

FaultRequest ProgressBoard::fault_request() const {
  return seqlock_read<FaultRequest>(layout_->fault_sequence, layout_->fault_words).value_or(FaultRequest{});
}

void ProgressBoard::beat(int64_t now_ns) { layout_->heartbeat_ns.store(now_ns, std::memory_order_relaxed); }

int64_t ProgressBoard::heartbeat_ns() const { return layout_->heartbeat_ns.load(std::memory_order_relaxed); }

void ProgressBoard::request_checkpoint() { layout_->checkpoint_requests.fetch_add(1, std::memory_order_relaxed); }

uint64_t ProgressBoard::checkpoint_requests() const {
  return layout_->checkpoint_requests.load(std::memory_order_relaxed);
}

}  // namespace keel::health
