#include "daemon/checkpoint_quarantine.h"

#include "checkpoint/paths.h"
#include "common/unique_fd.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

namespace keel::daemon {
namespace {

// The step of a checkpoint directory's name, committed ("step_00000012")
// or not yet ("step_00000012.partial"); nothing for any other name.
std::optional<int64_t> checkpoint_step_of(const std::filesystem::path& dir) {
  if (dir.extension() == ".partial") return checkpoint::step_of(dir.stem());
  return checkpoint::step_of(dir);
}

}  // namespace

Quarantine quarantine_checkpoints(const std::filesystem::path& root, int64_t last_good_step, int64_t generation) {
  Quarantine q;
  std::vector<std::filesystem::path> doomed;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(root, ec)) {
    const auto step = checkpoint_step_of(entry.path());
    if (step && *step > last_good_step && entry.is_directory()) doomed.push_back(entry.path());
  }
  std::sort(doomed.begin(), doomed.end());
  const std::string suffix = fmt::format(".suspect-g{}", generation);
  for (const auto& dir : doomed) {
    // A name taken already (the same step moved aside before in this
    // generation's number) gets a counter: nothing is ever replaced.
    std::filesystem::path target = dir.string() + suffix;
    int rc = -1;
    for (int n = 1; n <= 100; ++n) {
      rc = ::renameat2(AT_FDCWD, dir.c_str(), AT_FDCWD, target.c_str(), RENAME_NOREPLACE);
      if (rc == 0 || errno != EEXIST) break;
      target = fmt::format("{}{}.{}", dir.string(), suffix, n);
    }
    if (rc != 0) {
      q.errors.push_back(fmt::format("cannot move {} aside: {}", dir.string(), std::strerror(errno)));
      continue;
    }
    q.moved.push_back(target.filename().string());
    if (const auto step = checkpoint::step_of(dir)) q.steps.push_back(*step);
  }
  if (!q.moved.empty()) {
    const common::UniqueFd fd(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (fd.get() < 0 || ::fsync(fd.get()) != 0) {
      q.errors.push_back(fmt::format("cannot make the renames in {} durable: {}", root.string(), std::strerror(errno)));
    }
  }
  return q;
}

}  // namespace keel::daemon
