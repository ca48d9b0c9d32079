#include "trainer/comm/flight_recorder.h"

#include "common/error.h"
#include "common/write_all.h"

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <cerrno>
#include <cstring>

namespace keel::trainer {
namespace {

using common::Error;
using common::ErrorCode;

int64_t nanos(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

int64_t nanos(std::chrono::system_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

[[noreturn]] void fail_io(const std::string& what, const std::filesystem::path& path, int err) {
  throw Error(ErrorCode::kInternal,
              "flight recorder dump: cannot " + what + " " + path.string() + ": " + std::strerror(err));
}

void write_all(int fd, const std::string& text, const std::filesystem::path& path) {
  if (const int error = common::write_all(fd, text.data(), text.size()); error != 0) fail_io("write", path, error);
}

// A name no other dump of this process uses at the same time, so concurrent
// dumps to one path never write into each other's temporary file.
std::filesystem::path temporary_beside(const std::filesystem::path& path) {
  static std::atomic<uint64_t> counter{0};
  auto tmp = path;
  tmp += ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
  return tmp;
}

}  // namespace

const char* flight_state_name(FlightState state) {
  switch (state) {
    case FlightState::kInFlight: return "in_flight";
    case FlightState::kDone: return "done";
    case FlightState::kFailed: return "failed";
  }
  return "unknown";
}

FlightRecorder::FlightRecorder(size_t capacity) {
  if (capacity == 0) throw Error(ErrorCode::kInternal, "flight recorder capacity must be positive");
  slots_.resize(capacity);
}

uint64_t FlightRecorder::begin(const std::string& group, int64_t seq, const std::string& op, uint64_t bytes,
                               int peer) {
  FlightEntry entry;
  entry.group = group;
  entry.seq = seq;
  entry.op = op;
  entry.bytes = bytes;
  entry.peer = peer;
  entry.start = std::chrono::steady_clock::now();
  entry.wall_start = std::chrono::system_clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t id = next_id_++;
  entry.id = id;
  slots_[id % slots_.size()] = std::move(entry);
  return id;
}

void FlightRecorder::end(uint64_t id, FlightState state, const std::string& error) {
  auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  if (id >= next_id_ || next_id_ - id > slots_.size()) return;
  FlightEntry& entry = slots_[id % slots_.size()];
  entry.state = state;
  entry.end = now;
  entry.error = error;
}

std::vector<FlightEntry> FlightRecorder::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_locked();
}

std::vector<FlightEntry> FlightRecorder::entries_locked() const {
  uint64_t first = next_id_ > slots_.size() ? next_id_ - slots_.size() : 0;
  std::vector<FlightEntry> entries;
  entries.reserve(next_id_ - first);
  for (uint64_t id = first; id < next_id_; ++id) entries.push_back(slots_[id % slots_.size()]);
  return entries;
}

void FlightRecorder::dump(const std::filesystem::path& path) const {
  uint64_t recorded;
  std::vector<FlightEntry> entries;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    recorded = next_id_;
    entries = entries_locked();
  }

  nlohmann::json doc;
  doc["version"] = 1;
  doc["pid"] = static_cast<int64_t>(::getpid());
  doc["capacity"] = capacity();
  doc["recorded"] = recorded;
  doc["dump_steady_ns"] = nanos(std::chrono::steady_clock::now());
  doc["dump_wall_ns"] = nanos(std::chrono::system_clock::now());
  auto& list = doc["entries"] = nlohmann::json::array();
  for (const FlightEntry& e : entries) {
    list.push_back({
        {"id", e.id},
        {"group", e.group},
        {"seq", e.seq},
        {"op", e.op},
        {"bytes", e.bytes},
        {"peer", e.peer},
        {"state", flight_state_name(e.state)},
        {"start_steady_ns", nanos(e.start)},
        {"start_wall_ns", nanos(e.wall_start)},
        {"end_steady_ns", e.end ? nlohmann::json(nanos(*e.end)) : nlohmann::json(nullptr)},
        {"error", e.error},
    });
  }
  // Error texts come from the transport and may hold any bytes; replacing
  // invalid UTF-8 keeps the dump parseable instead of failing to write it.
  std::string text = doc.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";

  const auto tmp = temporary_beside(path);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail_io("create", tmp, errno);
  try {
    write_all(fd, text, tmp);
    if (::fsync(fd) != 0) fail_io("fsync", tmp, errno);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    fail_io("close", tmp, err);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    fail_io("rename to", path, err);
  }
  auto dir = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) fail_io("open directory", dir, errno);
  int rc = ::fsync(dir_fd);
  int err = errno;
  ::close(dir_fd);
  if (rc != 0) fail_io("fsync directory", dir, err);
}

}  // namespace keel::trainer
