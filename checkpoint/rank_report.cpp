#include "checkpoint/rank_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

#include "common/error.h"

namespace keel::checkpoint {

using nlohmann::json;

json RankReport::to_json() const {
  if (!ok) return {{"ok", false}, {"file", file}, {"error", error}};
  json listed = json::array();
  for (const Piece& p : pieces) {
    listed.push_back({{"group", p.group},
                      {"name", p.global_name},
                      {"shape", p.global_shape},
                      {"at", {p.row, p.col}},
                      {"size", {p.rows, p.cols}}});
  }
  return {{"ok", true}, {"file", file}, {"bytes", bytes}, {"xxh3", xxh3}, {"pieces", std::move(listed)}};
}

RankReport RankReport::parse(const std::string& text, int rank) {
  try {
    const json j = json::parse(text);
    RankReport report;
    report.ok = j.at("ok").get<bool>();
    report.file = j.at("file").get<std::string>();
    if (report.file.empty() || report.file.find('/') != std::string::npos) {
      throw std::invalid_argument("its file '" + report.file + "' is not a name in the checkpoint directory");
    }
    if (!report.ok) {
      report.error = j.at("error").get<std::string>();
      return report;
    }
    report.bytes = j.at("bytes").get<uint64_t>();
    report.xxh3 = j.at("xxh3").get<std::string>();
    for (const json& p : j.at("pieces")) {
      Piece piece;
      piece.group = p.at("group").get<std::string>();
      piece.global_name = p.at("name").get<std::string>();
      piece.global_shape = p.at("shape").get<std::vector<int64_t>>();
      const auto at = p.at("at").get<std::vector<int64_t>>();
      const auto size = p.at("size").get<std::vector<int64_t>>();
      const size_t dims = piece.global_shape.size();
      if ((dims != 1 && dims != 2) || at.size() != 2 || size.size() != 2) {
        throw std::invalid_argument(fmt::format("piece {} has a shape of {} dimensions", piece.global_name, dims));
      }
      piece.row = at[0];
      piece.col = at[1];
      piece.rows = size[0];
      piece.cols = size[1];
      const int64_t global_cols = dims == 2 ? piece.global_shape[1] : 1;
      if (piece.row < 0 || piece.col < 0 || piece.rows < 1 || piece.cols < 1 ||
          piece.row + piece.rows > piece.global_shape[0] || piece.col + piece.cols > global_cols) {
        throw std::invalid_argument(fmt::format("piece {} at ({}, {}) of size {} x {} lies outside its tensor",
                                                piece.global_name, piece.row, piece.col, piece.rows, piece.cols));
      }
      report.pieces.push_back(std::move(piece));
    }
    return report;
  } catch (const std::exception& e) {
    throw common::Error(
        common::ErrorCode::kCheckpointFailure,
        fmt::format("rank {}'s checkpoint report is malformed ({}): '{}'", rank, e.what(), text.substr(0, 120)));
  }
}

std::vector<StoredPiece> RankReport::stored_pieces() const {
  std::vector<StoredPiece> stored;
  for (const Piece& p : pieces) stored.push_back(StoredPiece{file, p.dataset_path(), p, UINT64_MAX});
  std::sort(stored.begin(), stored.end(),
            [](const StoredPiece& a, const StoredPiece& b) { return a.dataset < b.dataset; });
  return stored;
}

}  // namespace keel::checkpoint
