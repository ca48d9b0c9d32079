// Reading checkpoints back: the pieces a rank file holds, the index.h5 that
// stitches them into global tensors, and any block of any global tensor
// assembled from the pieces that overlap it, whatever layout wrote them
// (docs/architecture.md "Checkpoints": any layout loads any checkpoint).
#pragma once

#include "checkpoint/manifest.h"
#include "checkpoint/piece.h"

#include <filesystem>
#include <map>
#include <memory>
#include <cstdint>
#include <string>
#include <vector>

namespace keel::checkpoint {

struct StoredPiece {
  std::string file;  // rank file name, relative to the checkpoint directory
  std::string dataset;
  Piece piece;
  uint64_t offset = UINT64_MAX;  // of its bytes in the file (contiguous datasets), UINT64_MAX when unknown
};

// Every piece of one rank file, from the attributes of its datasets.
// Throws Error(kCheckpointFailure).
std::vector<StoredPiece> list_pieces(const std::filesystem::path& dir, const std::string& file);

// Writes dir/index.h5: one virtual dataset per global tensor
// ("/model/wte", "/optim/exp_avg/h.0.attn.c_attn.weight", ...) mapping
// every piece of `pieces` to its block. Elements no piece covers read as
// NaN. Throws Error(kCheckpointFailure).
void write_index(const std::filesystem::path& dir, const std::vector<StoredPiece>& pieces, int64_t step);

class CheckpointReader {
 public:
  // Reads the manifest and the piece list of every rank file it names. The
  // caller verifies checksums first (verify_files) when it wants to.
  explicit CheckpointReader(std::filesystem::path dir);
  ~CheckpointReader();

  const std::filesystem::path& dir() const { return dir_; }
  const Manifest& manifest() const { return manifest_; }
  // "/model/wte", ... for every tensor the checkpoint holds, sorted.
  std::vector<std::string> tensors() const;
  // The group holding the weights a load takes: "master" when a bf16 run
  // saved its float32 master weights (its /model then being their bf16
  // rounding), else "model".
  std::string weights_group() const;
  // Throws Error(kCheckpointFailure) when the checkpoint lacks the tensor.
  std::vector<int64_t> global_shape(const std::string& tensor_path) const;

  // Copies the block [row, row + rows) x [col, col + cols) of a global
  // tensor into dst (rows x cols floats, row-major), from every piece that
  // overlaps it. Throws Error(kCheckpointFailure) when the pieces do not
  // cover the whole block.
  void read(const std::string& tensor_path, int64_t row, int64_t col, int64_t rows, int64_t cols, float* dst);

  struct Request {
    std::string tensor_path;
    int64_t row = 0, col = 0, rows = 0, cols = 1;
    float* dst = nullptr;
  };
  // Reads many blocks. A block that is exactly one stored piece (a load in
  // the layout that saved) is read by its file offset with io_uring and
  // O_DIRECT, 1 MiB reads 16 deep; any other block goes through read().
  void read_all(const std::vector<Request>& requests);

 private:
  struct OpenFiles;
  std::filesystem::path dir_;
  Manifest manifest_;
  std::map<std::string, std::vector<StoredPiece>> pieces_;  // by tensor path
  std::unique_ptr<OpenFiles> open_;
};

}  // namespace keel::checkpoint
