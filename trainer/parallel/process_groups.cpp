#include "trainer/parallel/process_groups.h"

#include "common/log.h"

#include <algorithm>
#include <exception>

namespace keel::trainer {

ProcessGroups::ProcessGroups(const Mesh& mesh, const Join& join) {
  std::vector<std::vector<int>> members;  // of owned_[i]
  try {
    for (Axis axis : kAxes) {
      const Group& group = mesh.group(axis);
      if (group.ranks.size() < 2) continue;
      const auto same = std::find(members.begin(), members.end(), group.ranks);
      if (same != members.end()) {
        by_axis_[static_cast<size_t>(axis)] = owned_[static_cast<size_t>(same - members.begin())].get();
        continue;
      }
      owned_.push_back(join(group));
      members.push_back(group.ranks);
      by_axis_[static_cast<size_t>(axis)] = owned_.back().get();
      named_.push_back({axis, owned_.back().get()});
    }
  } catch (const std::exception& e) {
    // The groups joined so far hear of it now, not at their timeouts.
    leave_all(e.what());
    throw;
  }
}

const ProcessGroups& ProcessGroups::none() {
  static const ProcessGroups single_rank;
  return single_rank;
}

ProcessGroups::~ProcessGroups() {
  for (const auto& comm : owned_) comm->set_peer_failure_handler(nullptr);
}

int ProcessGroups::rank(Axis axis) const {
  const Communicator* comm = get(axis);
  return comm != nullptr ? comm->rank() : 0;
}

int ProcessGroups::size(Axis axis) const {
  const Communicator* comm = get(axis);
  return comm != nullptr ? comm->size() : 1;
}

void ProcessGroups::on_peer_failure(std::function<void(const std::string& cause)> also) {
  for (const auto& comm : owned_) {
    Communicator* failed = comm.get();
    comm->set_peer_failure_handler([this, failed, also](const std::string& cause) {
      if (also) also(cause);
      for (const auto& other : owned_) {
        if (other.get() != failed) leave(*other, cause);
      }
    });
  }
}

void ProcessGroups::leave_all(const std::string& cause) noexcept {
  for (const auto& comm : owned_) leave(*comm, cause);
}

void ProcessGroups::leave(Communicator& comm, const std::string& cause) noexcept {
  try {
    comm.leave(cause);
  } catch (const std::exception& e) {
    try {
      common::logger("comm")->warn("could not tell group {} that this rank leaves: {}", comm.name(), e.what());
    } catch (...) {
      // Logging failed too: the exit code the caller reports says enough.
    }
  }
}

void ProcessGroups::sum_over_grid(float* values, size_t count) const {
  for (Axis axis : kGridAxes) {
    if (Communicator* group = get(axis)) group->all_reduce(values, count);
  }
}

}  // namespace keel::trainer
