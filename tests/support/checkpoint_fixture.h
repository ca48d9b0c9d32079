// Small checkpoints written through the real Checkpointer (no trainer):
// a 2-D and a 1-D tensor, in two pieces each, with values that say where
// they are, so a reader can check every element.
#pragma once

#include "checkpoint/catalog.h"
#include "checkpoint/checkpointer.h"
#include "checkpoint/paths.h"

#include <cstdint>
#include <filesystem>
#include <vector>

namespace keel::test {

// Element (r, c) of fixture tensor `t` at step `step`.
inline float fixture_value(int t, int64_t r, int64_t c, int64_t step) {
  return static_cast<float>(t * 10000 + r * 100 + c) + 0.5f * static_cast<float>(step);
}

// w (6 x 5) and b (7), two pieces each.
inline std::vector<checkpoint::Piece> fixture_pieces() {
  return {
      {"model", "w", {6, 5}, 0, 0, 4, 5}, {"model", "w", {6, 5}, 4, 0, 2, 5},
      {"model", "b", {7}, 0, 0, 3, 1},    {"model", "b", {7}, 3, 0, 4, 1},
  };
}

// Fills staging[i] with the fixture values of pieces[i] at `step`; tensor
// "w" is fixture tensor 0, any other is 1.
inline void fill_fixture(const std::vector<checkpoint::Piece>& pieces, const std::vector<float*>& staging,
                         int64_t step) {
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto& p = pieces[i];
    const int t = p.global_name == "w" ? 0 : 1;
    for (int64_t r = 0; r < p.rows; ++r) {
      for (int64_t c = 0; c < p.cols; ++c) staging[i][r * p.cols + c] = fixture_value(t, p.row + r, p.col + c, step);
    }
  }
}

// Rank `rank` of a DP2 world checkpointing under `root`, events in run_dir.
inline checkpoint::CheckpointerOptions two_rank_options(int rank, const std::filesystem::path& root,
                                                        const std::filesystem::path& run_dir, double timeout_s) {
  checkpoint::CheckpointerOptions options;
  options.root = root;
  options.run_dir = run_dir;
  options.timeout_s = timeout_s;
  options.rank = rank;
  options.world_size = 2;
  options.layout = {{"world_size", 2}, {"dp", 2}, {"tp", 1}, {"zero", 0}};
  return options;
}

// The fixture split between two ranks: each holds one piece of w and one of b.
inline std::vector<checkpoint::Piece> fixture_pieces_of_rank(int rank) {
  const auto all = fixture_pieces();
  return {all[static_cast<size_t>(rank)], all[static_cast<size_t>(rank) + 2]};
}

// Stages `pieces` with their values at `step` and starts the save.
inline void save_fixture_async(checkpoint::Checkpointer& checkpointer, const std::vector<checkpoint::Piece>& pieces,
                               int64_t step) {
  fill_fixture(pieces, checkpointer.stage(pieces), step);
  checkpointer.save_async(step, step * 100);
}

// Saves and commits checkpoints of `steps` under root (one rank, no store).
inline void write_fixture_checkpoints(const std::filesystem::path& root, const std::vector<int64_t>& steps,
                                      int64_t keep = 100) {
  checkpoint::CheckpointerOptions options;
  options.root = root;
  options.run_dir = root.parent_path();
  options.keep = keep;
  options.layout = {{"world_size", 1}, {"dp", 1}, {"tp", 1}, {"zero", 0}};
  std::filesystem::create_directories(root);
  checkpoint::Checkpointer checkpointer(options, nullptr);
  for (int64_t step : steps) {
    save_fixture_async(checkpointer, fixture_pieces(), step);
    checkpointer.wait();
  }
}

// The steps of the committed checkpoints under root, oldest first.
inline std::vector<int64_t> committed_steps(const std::filesystem::path& root) {
  std::vector<int64_t> steps;
  for (const auto& e : checkpoint::committed(root)) steps.push_back(e.step);
  return steps;
}

}  // namespace keel::test
