// What a rank tells rank 0 about its file of a checkpoint (docs/architecture.md
// "Commit protocol"), through the Store: the file, its size and checksum,
// and the pieces it holds, or why it failed. Rank 0 writes index.h5 from
// the reports' piece lists, so it never opens another rank's file: on many
// nodes that file was written by another machine.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/piece.h"
#include "checkpoint/reader.h"

namespace keel::checkpoint {

struct RankReport {
  bool ok = false;
  std::string file;  // relative to the checkpoint directory
  uint64_t bytes = 0;
  std::string xxh3;   // of the whole file, 16 hex digits
  std::string error;  // why, when not ok
  std::vector<Piece> pieces;

  nlohmann::json to_json() const;
  // A report as rank `rank` published it. Error(kCheckpointFailure) naming
  // the rank and what is wrong when it is not a report: it came through the
  // Store, from another process and perhaps another machine.
  static RankReport parse(const std::string& text, int rank);
  // The pieces as index.h5 maps them, in the order of their dataset names
  // (the order a listing of the file gives).
  std::vector<StoredPiece> stored_pieces() const;
};

}  // namespace keel::checkpoint
