// A rank's communicators, looked up by axis (docs/architecture.md "Parallel
// layout and communication"). Code that talks to a group asks for the
// axis (groups.get(Axis::kTp)), never for a hand-made pair of
// communicators, so a new axis is a new row of the mesh, not an edit of
// every caller.
#pragma once

#include "trainer/comm/communicator.h"
#include "trainer/parallel/mesh.h"

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace keel::trainer {

class ProcessGroups {
 public:
  // Makes the communicator of one group of the mesh: the rank's position
  // in the group is group.index_in_group, its size group.ranks.size().
  using Join = std::function<std::unique_ptr<Communicator>(const Group& group)>;

  // A single rank: every axis's group is the rank alone.
  ProcessGroups() = default;
  static const ProcessGroups& none();
  // Joins every group of `mesh` with two ranks or more, in kAxes order on
  // every rank, so no two ranks wait for each other in different
  // rendezvous. An axis whose group has the same members as one joined
  // before it (dp_cp is dp when cp = 1) shares that communicator: one
  // transport, one sequence of calls, one line on the board.
  ProcessGroups(const Mesh& mesh, const Join& join);
  // Clears the peer-failure handlers (waiting for one in progress) before
  // any communicator is destroyed: they reach from one group to the others.
  ~ProcessGroups();
  ProcessGroups(const ProcessGroups&) = delete;
  ProcessGroups& operator=(const ProcessGroups&) = delete;

  // The communicator of this rank's group along `axis`; nullptr when that
  // group is this rank alone.
  Communicator* get(Axis axis) const { return by_axis_[static_cast<size_t>(axis)]; }
  // The rank's position in its group along `axis`, and the group's size
  // (0 and 1 without a communicator).
  int rank(Axis axis) const;
  int size(Axis axis) const;

  // Every distinct communicator once, named by the first axis (in kAxes
  // order) whose group it is.
  struct Named {
    Axis axis;
    Communicator* comm;
  };
  const std::vector<Named>& communicators() const { return named_; }

  // A peer failure seen in one group makes this rank leave the others,
  // which wakes it if it is blocked there and tells their ranks; `also`
  // (nullptr: nothing) hears the cause first. Replaces the last call's.
  void on_peer_failure(std::function<void(const std::string& cause)> also = nullptr);

  // Sums `count` floats in place over every rank of the grid, one grid
  // axis after another (the same order, so the same bits, on every rank).
  void sum_over_grid(float* values, size_t count) const;
  // Tells every group that this rank is leaving, so that ranks sharing no
  // group with a failure stop at once too. Best effort: it never throws,
  // since the caller is about to report its own exit code.
  void leave_all(const std::string& cause) noexcept;

 private:
  static void leave(Communicator& comm, const std::string& cause) noexcept;

  std::vector<std::unique_ptr<Communicator>> owned_;
  std::array<Communicator*, kAxisCount> by_axis_{};
  std::vector<Named> named_;
};

}  // namespace keel::trainer
