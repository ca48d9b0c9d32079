#include "checkpoint/reader.h"

#include "checkpoint/hdf5_handle.h"
#include "checkpoint/paths.h"
#include "common/error.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <liburing.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <cmath>
#include <limits>

namespace keel::checkpoint {
namespace {

[[noreturn]] void fail(const std::string& what) { throw common::Error(common::ErrorCode::kCheckpointFailure, what); }

struct Visit {
  std::string file;
  std::vector<StoredPiece> pieces;
  std::string error;
};

herr_t visit_object(hid_t root, const char* name, const H5O_info_t* info, void* data) {
  auto& visit = *static_cast<Visit*>(data);
  if (info->type != H5O_TYPE_DATASET) return 0;
  try {
    H5Handle dataset(H5Dopen2(root, name, H5P_DEFAULT), H5Dclose, std::string("cannot open dataset ") + name);
    Piece p;
    const std::string path = std::string("/") + name;
    // "/<group>/<global_name>@<row>,<col>"
    p.global_name = read_string_attribute(dataset.get(), "global_name");
    const std::string tensor = path.substr(0, path.rfind('@'));
    if (tensor.size() < p.global_name.size() + 3 || !tensor.ends_with("/" + p.global_name)) {
      fail("dataset " + path + " is not named after its global_name " + p.global_name);
    }
    p.group = tensor.substr(1, tensor.size() - p.global_name.size() - 2);
    p.global_shape = read_int64_attribute(dataset.get(), "global_shape");
    const auto offset = read_int64_attribute(dataset.get(), "offset");
    H5Handle space(H5Dget_space(dataset.get()), H5Sclose, "H5Dget_space");
    hsize_t dims[2] = {0, 1};
    const int rank = H5Sget_simple_extent_dims(space.get(), dims, nullptr);
    if (rank < 1 || rank > 2 || static_cast<size_t>(rank) != p.global_shape.size() || offset.size() != p.global_shape.size()) {
      fail(fmt::format("dataset {} has {} dimensions but its global_shape has {}", path, rank, p.global_shape.size()));
    }
    p.row = offset[0];
    p.col = rank == 2 ? offset[1] : 0;
    p.rows = static_cast<int64_t>(dims[0]);
    p.cols = rank == 2 ? static_cast<int64_t>(dims[1]) : 1;
    const int64_t global_cols = rank == 2 ? p.global_shape[1] : 1;
    if (p.row < 0 || p.col < 0 || p.row + p.rows > p.global_shape[0] || p.col + p.cols > global_cols ||
        p.dataset_path() != path) {
      fail(fmt::format("dataset {} does not fit its attributes (offset {},{} shape {}x{})", path, p.row, p.col, p.rows,
                       p.cols));
    }
    const haddr_t address = H5Dget_offset(dataset.get());
    visit.pieces.push_back(StoredPiece{visit.file, path, std::move(p), address == HADDR_UNDEF ? UINT64_MAX : address});
    return 0;
  } catch (const common::Error& e) {
    visit.error = e.what();
    return -1;
  }
}

struct RawRead {
  int direct_fd;    // -1 when the file refuses O_DIRECT
  int buffered_fd;
  uint64_t offset;
  std::byte* dst;
  size_t len;
};

void pread_all(int fd, std::byte* dst, size_t len, uint64_t offset) {
  while (len > 0) {
    const ssize_t n = ::pread(fd, dst, len, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(fmt::format("checkpoint read failed: {}", n < 0 ? std::strerror(errno) : "the file is short"));
    dst += n;
    len -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

// Reads the aligned body of every job with io_uring and O_DIRECT, 1 MiB
// reads 16 in flight, straight into the destination where it is 4 KiB
// aligned and through a bounce buffer where it is not; the unaligned rest
// buffered. Without io_uring: pread.
void read_raw(const std::vector<RawRead>& jobs) {
  constexpr size_t kAlign = 4096, kChunk = size_t{1} << 20;
  constexpr unsigned kDepth = 16;
  struct Chunk {
    int fd;
    uint64_t offset;
    std::byte* dst;
    size_t len;
  };
  std::vector<Chunk> chunks;
  for (const RawRead& job : jobs) {
    const size_t body = job.direct_fd >= 0 && job.offset % kAlign == 0 ? job.len / kAlign * kAlign : 0;
    for (size_t at = 0; at < body; at += kChunk) {
      chunks.push_back(Chunk{job.direct_fd, job.offset + at, job.dst + at, std::min(kChunk, body - at)});
    }
    if (job.len > body) pread_all(job.buffered_fd, job.dst + body, job.len - body, job.offset + body);
  }
  if (chunks.empty()) return;
  std::unique_ptr<std::byte, decltype(&std::free)> bounce(
      static_cast<std::byte*>(std::aligned_alloc(kAlign, kChunk * kDepth)), &std::free);
  if (!bounce) fail("cannot allocate checkpoint read buffers");
  io_uring ring{};
  if (io_uring_queue_init(2 * kDepth, &ring, 0) < 0) {
    for (const Chunk& c : chunks) {
      pread_all(c.fd, bounce.get(), c.len, c.offset);
      std::memcpy(c.dst, bounce.get(), c.len);
    }
    return;
  }
  std::vector<int> free_slots;
  for (unsigned i = 0; i < kDepth; ++i) free_slots.push_back(static_cast<int>(i));
  std::vector<size_t> slot_chunk(kDepth);
  std::string error;
  size_t next = 0, in_flight = 0;
  while ((next < chunks.size() && error.empty()) || in_flight > 0) {
    while (next < chunks.size() && error.empty() && !free_slots.empty()) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      if (sqe == nullptr) break;
      const int slot = free_slots.back();
      free_slots.pop_back();
      slot_chunk[slot] = next;
      const Chunk& c = chunks[next++];
      std::byte* target = reinterpret_cast<uintptr_t>(c.dst) % kAlign == 0
                              ? c.dst
                              : bounce.get() + static_cast<size_t>(slot) * kChunk;
      io_uring_prep_read(sqe, c.fd, target, static_cast<unsigned>(c.len), c.offset);
      io_uring_sqe_set_data64(sqe, static_cast<uint64_t>(slot));
      ++in_flight;
    }
    const int rc = io_uring_submit_and_wait(&ring, 1);
    if (rc < 0 && rc != -EINTR && error.empty()) error = std::string("io_uring submit failed: ") + std::strerror(-rc);
    io_uring_cqe* cqe = nullptr;
    while (io_uring_peek_cqe(&ring, &cqe) == 0) {
      const int slot = static_cast<int>(io_uring_cqe_get_data64(cqe));
      const int res = cqe->res;
      io_uring_cqe_seen(&ring, cqe);
      --in_flight;
      const Chunk& c = chunks[slot_chunk[slot]];
      const bool bounced = reinterpret_cast<uintptr_t>(c.dst) % kAlign != 0;
      std::byte* data = bounced ? bounce.get() + static_cast<size_t>(slot) * kChunk : c.dst;
      if (res < 0 && error.empty()) error = std::string("checkpoint read failed: ") + std::strerror(-res);
      if (res >= 0 && error.empty()) {
        // A short read finishes buffered.
        if (static_cast<size_t>(res) < c.len) {
          try {
            pread_all(c.fd, data + res, c.len - static_cast<size_t>(res), c.offset + static_cast<uint64_t>(res));
          } catch (const common::Error& e) {
            error = e.what();
          }
        }
        if (bounced) std::memcpy(c.dst, data, c.len);
      }
      free_slots.push_back(slot);
    }
  }
  io_uring_queue_exit(&ring);
  if (!error.empty()) fail(error);
}

}  // namespace

std::vector<StoredPiece> list_pieces(const std::filesystem::path& dir, const std::string& file) {
  quiet_hdf5();
  const auto path = dir / file;
  H5Handle h5(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose,
              fmt::format("cannot open {} as HDF5", path.string()));
  Visit visit{file, {}, {}};
  // /state holds attributes only, so every dataset is a piece.
  if (H5Ovisit2(h5.get(), H5_INDEX_NAME, H5_ITER_INC, visit_object, &visit, H5O_INFO_BASIC) < 0) {
    fail(fmt::format("{}: {}", path.string(), visit.error.empty() ? "cannot list its datasets" : visit.error));
  }
  return visit.pieces;
}

void write_index(const std::filesystem::path& dir, const std::vector<StoredPiece>& pieces, int64_t step) {
  quiet_hdf5();
  const auto path = dir / kIndexFile;
  std::map<std::string, std::vector<const StoredPiece*>> by_tensor;
  for (const auto& p : pieces) by_tensor[p.piece.tensor_path()].push_back(&p);
  H5Handle file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose,
                fmt::format("cannot create {}", path.string()));
  H5Handle lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose, "H5Pcreate");
  h5_check(H5Pset_create_intermediate_group(lcpl.get(), 1), "H5Pset_create_intermediate_group");
  const float missing = std::numeric_limits<float>::quiet_NaN();
  for (const auto& [tensor, sources] : by_tensor) {
    const auto& shape = sources.front()->piece.global_shape;
    const int rank = static_cast<int>(shape.size());
    const hsize_t dims[2] = {static_cast<hsize_t>(shape[0]), rank == 2 ? static_cast<hsize_t>(shape[1]) : 1};
    H5Handle space(H5Screate_simple(rank, dims, nullptr), H5Sclose, "H5Screate_simple");
    H5Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose, "H5Pcreate");
    h5_check(H5Pset_fill_value(dcpl.get(), H5T_NATIVE_FLOAT, &missing), "H5Pset_fill_value");
    for (const StoredPiece* s : sources) {
      const Piece& p = s->piece;
      if (p.global_shape != shape) fail(fmt::format("pieces of {} disagree about its shape", tensor));
      const hsize_t start[2] = {static_cast<hsize_t>(p.row), static_cast<hsize_t>(p.col)};
      const hsize_t count[2] = {static_cast<hsize_t>(p.rows), static_cast<hsize_t>(p.cols)};
      H5Handle block(H5Screate_simple(rank, dims, nullptr), H5Sclose, "H5Screate_simple");
      h5_check(H5Sselect_hyperslab(block.get(), H5S_SELECT_SET, start, nullptr, count, nullptr), "H5Sselect_hyperslab");
      H5Handle source(H5Screate_simple(rank, count, nullptr), H5Sclose, "H5Screate_simple");
      // Source files are named relative to index.h5, so the directory can
      // be renamed and moved.
      h5_check(H5Pset_virtual(dcpl.get(), block.get(), s->file.c_str(), s->dataset.c_str(), source.get()),
               fmt::format("cannot map {} into {}", s->dataset, tensor));
    }
    H5Handle dataset(H5Dcreate2(file.get(), tensor.c_str(), H5T_IEEE_F32LE, space.get(), lcpl.get(), dcpl.get(), H5P_DEFAULT),
                     H5Dclose, fmt::format("cannot create virtual dataset {} in {}", tensor, path.string()));
  }
  H5Handle state(H5Gcreate2(file.get(), "/state", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose,
                 "cannot create /state in index.h5");
  write_int64_attribute(state.get(), "step", {step});
  state.close("H5Gclose");
  file.close(fmt::format("cannot close {}", path.string()));
}

struct CheckpointReader::OpenFiles {
  std::map<std::string, H5Handle> files;
  std::map<std::string, std::pair<int, int>> raw;  // direct and buffered descriptors per rank file
  ~OpenFiles() {
    for (const auto& [_, fds] : raw) {
      if (fds.first >= 0) ::close(fds.first);
      if (fds.second >= 0) ::close(fds.second);
    }
  }
};

CheckpointReader::CheckpointReader(std::filesystem::path dir)
    : dir_(std::move(dir)), manifest_(read_manifest(dir_)), open_(std::make_unique<OpenFiles>()) {
  for (const auto& f : manifest_.files) {
    if (f.name == kIndexFile) continue;
    for (auto& p : list_pieces(dir_, f.name)) pieces_[p.piece.tensor_path()].push_back(std::move(p));
  }
}

CheckpointReader::~CheckpointReader() = default;

void CheckpointReader::read_all(const std::vector<Request>& requests) {
  std::vector<RawRead> raw;
  for (const Request& r : requests) {
    const StoredPiece* whole = nullptr;
    if (auto it = pieces_.find(r.tensor_path); it != pieces_.end()) {
      for (const StoredPiece& s : it->second) {
        const Piece& p = s.piece;
        if (s.offset != UINT64_MAX && p.row == r.row && p.col == r.col && p.rows == r.rows && p.cols == r.cols) whole = &s;
      }
    }
    if (whole == nullptr) {
      read(r.tensor_path, r.row, r.col, r.rows, r.cols, r.dst);
      continue;
    }
    auto [fds, fresh] = open_->raw.try_emplace(whole->file, -1, -1);
    if (fresh) {
      const auto path = dir_ / whole->file;
      fds->second.first = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
      fds->second.second = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fds->second.second < 0) fail(fmt::format("cannot open {}: {}", path.string(), std::strerror(errno)));
    }
    raw.push_back(RawRead{fds->second.first, fds->second.second, whole->offset, reinterpret_cast<std::byte*>(r.dst),
                          whole->piece.bytes()});
  }
  read_raw(raw);
}

std::vector<std::string> CheckpointReader::tensors() const {
  std::vector<std::string> names;
  for (const auto& [name, _] : pieces_) names.push_back(name);
  return names;
}

std::string CheckpointReader::weights_group() const {
  // pieces_ is sorted by path: the first at or past "/master/" tells.
  const auto it = pieces_.lower_bound("/master/");
  return it != pieces_.end() && it->first.starts_with("/master/") ? "master" : "model";
}

std::vector<int64_t> CheckpointReader::global_shape(const std::string& tensor_path) const {
  auto it = pieces_.find(tensor_path);
  if (it == pieces_.end()) fail(fmt::format("checkpoint {} has no tensor {}", dir_.string(), tensor_path));
  return it->second.front().piece.global_shape;
}

void CheckpointReader::read(const std::string& tensor_path, int64_t row, int64_t col, int64_t rows, int64_t cols,
                            float* dst) {
  auto it = pieces_.find(tensor_path);
  if (it == pieces_.end()) fail(fmt::format("checkpoint {} has no tensor {}", dir_.string(), tensor_path));
  int64_t covered = 0;
  for (const StoredPiece& s : it->second) {
    const Piece& p = s.piece;
    const int64_t r0 = std::max(row, p.row), r1 = std::min(row + rows, p.row + p.rows);
    const int64_t c0 = std::max(col, p.col), c1 = std::min(col + cols, p.col + p.cols);
    if (r0 >= r1 || c0 >= c1) continue;
    auto& handle = open_->files[s.file];
    if (handle.get() < 0) {
      const auto path = dir_ / s.file;
      handle = H5Handle(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose,
                        fmt::format("cannot open {}", path.string()));
    }
    H5Handle dataset(H5Dopen2(handle.get(), s.dataset.c_str(), H5P_DEFAULT), H5Dclose,
                     fmt::format("cannot open {} in {}", s.dataset, s.file));
    const int rank = static_cast<int>(p.global_shape.size());
    const hsize_t file_start[2] = {static_cast<hsize_t>(r0 - p.row), static_cast<hsize_t>(c0 - p.col)};
    const hsize_t count[2] = {static_cast<hsize_t>(r1 - r0), static_cast<hsize_t>(c1 - c0)};
    H5Handle file_space(H5Dget_space(dataset.get()), H5Sclose, "H5Dget_space");
    h5_check(H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, file_start, nullptr, count, nullptr),
             "H5Sselect_hyperslab");
    const hsize_t mem_dims[2] = {static_cast<hsize_t>(rows), static_cast<hsize_t>(cols)};
    const hsize_t mem_start[2] = {static_cast<hsize_t>(r0 - row), static_cast<hsize_t>(c0 - col)};
    H5Handle mem_space(H5Screate_simple(rank, mem_dims, nullptr), H5Sclose, "H5Screate_simple");
    h5_check(H5Sselect_hyperslab(mem_space.get(), H5S_SELECT_SET, mem_start, nullptr, count, nullptr),
             "H5Sselect_hyperslab");
    h5_check(H5Dread(dataset.get(), H5T_NATIVE_FLOAT, mem_space.get(), file_space.get(), H5P_DEFAULT, dst),
             fmt::format("cannot read {} from {}", s.dataset, s.file));
    covered += (r1 - r0) * (c1 - c0);
  }
  // Pieces never overlap, so the areas add up to the block's exactly when
  // they cover it.
  if (covered != rows * cols) {
    fail(fmt::format("checkpoint {} covers {} of the {} elements of {} rows {}..{} columns {}..{}", dir_.string(),
                     covered, rows * cols, tensor_path, row, row + rows, col, col + cols));
  }
}

}  // namespace keel::checkpoint
