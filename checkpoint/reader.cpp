#include "checkpoint/reader.h"

#include "checkpoint/hdf5_handle.h"
#include "checkpoint/paths.h"
#include "common/error.h"

#include <fmt/format.h>

#include <algorithm>
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
    visit.pieces.push_back(StoredPiece{visit.file, path, std::move(p)});
    return 0;
  } catch (const common::Error& e) {
    visit.error = e.what();
    return -1;
  }
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
};

CheckpointReader::CheckpointReader(std::filesystem::path dir)
    : dir_(std::move(dir)), manifest_(read_manifest(dir_)), open_(std::make_unique<OpenFiles>()) {
  for (const auto& f : manifest_.files) {
    if (f.name == kIndexFile) continue;
    for (auto& p : list_pieces(dir_, f.name)) pieces_[p.piece.tensor_path()].push_back(std::move(p));
  }
}

CheckpointReader::~CheckpointReader() = default;

std::vector<std::string> CheckpointReader::tensors() const {
  std::vector<std::string> names;
  for (const auto& [name, _] : pieces_) names.push_back(name);
  return names;
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
