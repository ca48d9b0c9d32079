#include "common/events.h"

#include "common/log.h"

#include <fcntl.h>
#include <fmt/chrono.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

namespace keel::common {

std::string utc_now() {
  const auto now = std::chrono::system_clock::now();
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  return fmt::format("{:%Y-%m-%dT%H:%M:%S}.{:03d}Z", fmt::gmtime(std::chrono::system_clock::to_time_t(now)), ms);
}

void append_event(const std::filesystem::path& run_dir, const std::string& kind, int64_t generation, int rank,
                  nlohmann::json fields) {
  nlohmann::json event = {{"time", utc_now()}, {"kind", kind}, {"generation", generation}, {"rank", rank}};
  event.update(fields);
  const std::string line = event.dump() + "\n";
  const auto path = run_dir / "events.jsonl";
  std::error_code ec;
  std::filesystem::create_directories(run_dir, ec);
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0 || ::write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size()) || ::fsync(fd) != 0) {
    logger("events")->error("cannot append to {}: {}; the event was {}", path.string(), std::strerror(errno),
                            event.dump());
  }
  if (fd >= 0) ::close(fd);
}

}  // namespace keel::common
