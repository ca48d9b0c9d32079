// Writes one rank's pieces as a rank file, the write path of docs/architecture.md "Checkpoints":
//
// 0. The file's upper bound is reserved, so a save that cannot fit fails
//    before HDF5 writes anything; the whole file is reserved again once
//    the skeleton is closed (HDF5 creates it truncated).
// 1. HDF5 builds the skeleton: one contiguous dataset per piece, space
//    allocated at creation, never filled, every dataset of 4 KiB or more
//    4 KiB-aligned; H5Dget_offset gives each dataset's file offset; the file
//    is closed. HDF5 never writes the bulk bytes.
// 2. The bulk bytes go from the staging buffer (allocated once, 4 KiB
//    aligned, registered with io_uring once) to those offsets: the aligned
//    body of each dataset with O_DIRECT, its unaligned tail buffered, then
//    an fsync that waits for every write.
//
// Fallbacks, each logged once per process: a filesystem that refuses
// O_DIRECT (ramfs, tmpfs before Linux 6.6) gets buffered writes; a kernel
// or sandbox that refuses io_uring gets pwrite; a refused buffer
// registration gets unregistered io_uring writes.
#pragma once

#include "checkpoint/file_system.h"
#include "checkpoint/piece.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

#include <cstddef>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace keel::checkpoint {

// How a caller pins the staging buffer for its own copies into it: a GPU
// backend page-locks it so the device-to-host snapshot is DMA at full bus
// speed (docs/architecture.md "Checkpoints"). `pin` runs after the buffer
// is allocated, `unpin` before it is freed; either may be empty.
struct StagingPinning {
  std::function<void(void* data, size_t bytes)> pin;
  std::function<void(void* data)> unpin;
};

class ShardWriter {
 public:
  // Space is reserved through `fs`, which must outlive the writer.
  ShardWriter(bool o_direct, FileSystem& fs, StagingPinning pinning = {});
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // Lays the staging buffer out for `pieces`. It is reallocated (and
  // registered and pinned again) only when it grows, so the saves of one
  // run, and the load before them, reuse a single buffer.
  void prepare(std::vector<Piece> pieces);
  const std::vector<Piece>& pieces() const { return pieces_; }
  // Where piece i's floats go before write().
  float* staging(size_t i);
  size_t staging_bytes() const { return staging_bytes_; }
  // The first staged value that is NaN or infinite, with its tensor path.
  std::optional<std::pair<std::string, float>> first_non_finite() const;

  struct Written {
    uint64_t bytes = 0;
    std::string xxh3;           // of the whole file, 16 hex digits
    uint64_t direct_bytes = 0;  // of those, written with O_DIRECT (0 on the buffered fallback)
  };
  // Writes the staged pieces, and `state` as attributes of /state, to a new
  // file at `path`, fsynced. The checksum covers the file as written: the
  // bulk bytes are hashed from the staging buffer and only HDF5's metadata
  // is read back. Throws Error(kCheckpointFailure) naming what failed; a
  // failed file is left for the caller to remove.
  Written write(const std::filesystem::path& path, const nlohmann::json& state);

 private:
  struct Ring;
  // Creates the HDF5 skeleton and returns every piece's file offset.
  std::vector<uint64_t> write_skeleton(const std::filesystem::path& path, const nlohmann::json& state) const;
  // Returns the bytes written with O_DIRECT.
  uint64_t write_bulk(const std::filesystem::path& path, const std::vector<uint64_t>& offsets);
  Written checksum(const std::filesystem::path& path, const std::vector<uint64_t>& offsets) const;

  // Unpins and frees the staging buffer.
  void release_staging();

  bool o_direct_;
  FileSystem& fs_;
  StagingPinning pinning_;
  std::vector<Piece> pieces_;
  std::vector<size_t> staging_offset_;
  size_t staging_bytes_ = 0;
  std::unique_ptr<std::byte, void (*)(void*)> staging_;
  std::unique_ptr<Ring> ring_;
};

}  // namespace keel::checkpoint
