#include "checkpoint/shard_writer.h"

#include "checkpoint/hdf5_handle.h"
#include "common/error.h"
#include "common/unique_fd.h"
#include "common/log.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <liburing.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <xxhash.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <future>
#include <mutex>
#include <utility>

namespace keel::checkpoint {
namespace {

constexpr size_t kAlign = 4096;              // O_DIRECT's unit, and HDF5's dataset alignment
constexpr size_t kChunk = size_t{1} << 20;   // bytes per write, as fio's 1 MiB blocks
constexpr unsigned kQueueDepth = 16;         // writes in flight
constexpr size_t kMaxRegistered = size_t{1} << 30;  // the kernel's limit per registered buffer

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

[[noreturn]] void fail(const std::string& what) { throw common::Error(common::ErrorCode::kCheckpointFailure, what); }

void warn_once(std::once_flag& flag, const std::string& message) {
  std::call_once(flag, [&] { common::logger("checkpoint")->warn("{}", message); });
}

std::once_flag g_no_o_direct, g_no_uring, g_no_registration;

// One write: `len` bytes from `data` at `offset` of `fd`; buf_index names
// the registered buffer holding data, -1 when there is none.
struct WriteOp {
  int fd;
  uint64_t offset;
  const std::byte* data;
  size_t len;
  int buf_index;
};

void pwrite_all(int fd, const std::byte* data, size_t len, uint64_t offset, const std::filesystem::path& path) {
  while (len > 0) {
    const ssize_t n = ::pwrite(fd, data, len, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(fmt::format("write to {} failed: {}", path.string(), n < 0 ? std::strerror(errno) : "no progress"));
    data += n;
    len -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

}  // namespace

struct ShardWriter::Ring {
  io_uring ring{};
  bool registered = false;
  ~Ring() {
    if (registered) io_uring_unregister_buffers(&ring);
    io_uring_queue_exit(&ring);
  }
};

ShardWriter::ShardWriter(bool o_direct, FileSystem& fs, StagingPinning pinning)
    : o_direct_(o_direct), fs_(fs), pinning_(std::move(pinning)), staging_(nullptr, &std::free) {
  auto ring = std::make_unique<Ring>();
  const int rc = io_uring_queue_init(2 * kQueueDepth, &ring->ring, 0);
  if (rc < 0) {
    warn_once(g_no_uring,
              fmt::format("io_uring is not available ({}): checkpoints are written with pwrite", std::strerror(-rc)));
  } else {
    ring_ = std::move(ring);
  }
}

ShardWriter::~ShardWriter() { release_staging(); }

void ShardWriter::release_staging() {
  if (staging_ && pinning_.unpin) pinning_.unpin(staging_.get());
  staging_.reset();
  staging_bytes_ = 0;
}

void ShardWriter::prepare(std::vector<Piece> pieces) {
  pieces_ = std::move(pieces);
  staging_offset_.clear();
  size_t total = 0;
  for (const Piece& p : pieces_) {
    staging_offset_.push_back(total);
    total += align_up(p.bytes());
  }
  total = std::max(total, kAlign);
  if (total <= staging_bytes_) return;
  if (ring_ && ring_->registered) {
    io_uring_unregister_buffers(&ring_->ring);
    ring_->registered = false;
  }
  release_staging();
  staging_.reset(static_cast<std::byte*>(std::aligned_alloc(kAlign, total)));
  if (!staging_) fail(fmt::format("cannot allocate a {}-byte checkpoint staging buffer", total));
  // Huge pages where the kernel has them: the snapshot copy into this
  // buffer is the whole stall training pays, and it is TLB-bound otherwise.
  ::madvise(staging_.get(), total, MADV_HUGEPAGE);
  std::memset(staging_.get(), 0, total);
  staging_bytes_ = total;
  if (pinning_.pin) pinning_.pin(staging_.get(), total);
  if (!ring_) return;
  std::vector<iovec> iovecs;
  for (size_t at = 0; at < total; at += kMaxRegistered) {
    iovecs.push_back(iovec{staging_.get() + at, std::min(kMaxRegistered, total - at)});
  }
  const int rc = io_uring_register_buffers(&ring_->ring, iovecs.data(), static_cast<unsigned>(iovecs.size()));
  if (rc < 0) {
    warn_once(g_no_registration,
              fmt::format("io_uring refused to register the {}-byte staging buffer ({}; raise LimitMEMLOCK): "
                          "writing from unregistered memory",
                          total, std::strerror(-rc)));
  } else {
    ring_->registered = true;
  }
}

std::optional<std::pair<std::string, float>> ShardWriter::first_non_finite() const {
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const float* values = reinterpret_cast<const float*>(staging_.get() + staging_offset_[i]);
    if (const auto bad = checkpoint::first_non_finite(values, pieces_[i].numel())) {
      return std::make_pair(pieces_[i].tensor_path(), *bad);
    }
  }
  return std::nullopt;
}

float* ShardWriter::staging(size_t i) { return reinterpret_cast<float*>(staging_.get() + staging_offset_.at(i)); }

ShardWriter::Written ShardWriter::write(const std::filesystem::path& path, const nlohmann::json& state) {
  const auto offsets = write_skeleton(path, state);
  // The checksum reads only the staging buffer and HDF5's metadata, which
  // is on disk since the skeleton closed, so it runs while the kernel
  // writes the bulk bytes.
  auto written = std::async(std::launch::async, [&] { return checksum(path, offsets); });
  uint64_t direct_bytes = 0;
  try {
    direct_bytes = write_bulk(path, offsets);
  } catch (...) {
    written.wait();
    throw;
  }
  Written out = written.get();
  out.direct_bytes = direct_bytes;
  return out;
}

ShardWriter::Written ShardWriter::checksum(const std::filesystem::path& path, const std::vector<uint64_t>& offsets) const {
  common::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) fail(fmt::format("cannot open {}: {}", path.string(), std::strerror(errno)));
  const uint64_t size = std::filesystem::file_size(path);
  std::vector<size_t> order(pieces_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return offsets[a] < offsets[b]; });
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), &XXH3_freeState);
  XXH3_64bits_reset(state.get());
  std::vector<char> buffer;
  // HDF5's bytes between the datasets come from the file.
  auto hash_file = [&](uint64_t from, uint64_t to) {
    buffer.resize(static_cast<size_t>(to - from));
    size_t done = 0;
    while (done < buffer.size()) {
      const ssize_t n = ::pread(fd.get(), buffer.data() + done, buffer.size() - done, static_cast<off_t>(from + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail(fmt::format("cannot read back {}: {}", path.string(), n < 0 ? std::strerror(errno) : "short file"));
      done += static_cast<size_t>(n);
    }
    XXH3_64bits_update(state.get(), buffer.data(), buffer.size());
  };
  uint64_t at = 0;
  for (size_t i : order) {
    if (offsets[i] < at || offsets[i] + pieces_[i].bytes() > size) fail("datasets of " + path.string() + " overlap");
    if (offsets[i] > at) hash_file(at, offsets[i]);
    XXH3_64bits_update(state.get(), staging_.get() + staging_offset_[i], pieces_[i].bytes());
    at = offsets[i] + pieces_[i].bytes();
  }
  if (size > at) hash_file(at, size);
  return Written{size, fmt::format("{:016x}", XXH3_64bits_digest(state.get()))};
}

std::vector<uint64_t> ShardWriter::write_skeleton(const std::filesystem::path& path, const nlohmann::json& state) const {
  quiet_hdf5();
  // An upper bound of the file: every dataset aligned, plus generous
  // metadata (a few KiB per dataset with its attributes).
  size_t bound = size_t{1} << 20;
  for (const Piece& p : pieces_) bound += align_up(p.bytes()) + 8 * kAlign;
  // The bound is reserved first so that a save which cannot fit (a full
  // disk, a quota, a file-size limit) fails before HDF5 writes anything: a
  // write failure inside HDF5's close leaves the library in a state that
  // crashes it at exit. H5Fcreate truncates, which frees that reservation,
  // so the file is reserved again, whole, once the skeleton is closed.
  {
    common::UniqueFd created(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (created.get() < 0) fail(fmt::format("cannot create {}: {}", path.string(), std::strerror(errno)));
  }
  try {
    fs_.reserve(path, bound);
  } catch (...) {
    ::unlink(path.c_str());
    throw;
  }
  const std::string where = path.string();
  H5Handle fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose, "H5Pcreate");
  h5_check(H5Pset_alignment(fapl.get(), kAlign, kAlign), "H5Pset_alignment");
  H5Handle file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), H5Fclose,
                fmt::format("cannot create {}", where));
  H5Handle lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose, "H5Pcreate");
  h5_check(H5Pset_create_intermediate_group(lcpl.get(), 1), "H5Pset_create_intermediate_group");
  H5Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose, "H5Pcreate");
  h5_check(H5Pset_layout(dcpl.get(), H5D_CONTIGUOUS), "H5Pset_layout");
  h5_check(H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY), "H5Pset_alloc_time");
  h5_check(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER), "H5Pset_fill_time");

  std::vector<uint64_t> offsets;
  for (const Piece& p : pieces_) {
    const bool matrix = p.global_shape.size() == 2;
    const hsize_t dims[2] = {static_cast<hsize_t>(p.rows), static_cast<hsize_t>(p.cols)};
    H5Handle space(H5Screate_simple(matrix ? 2 : 1, dims, nullptr), H5Sclose, "H5Screate_simple");
    H5Handle dataset(
        H5Dcreate2(file.get(), p.dataset_path().c_str(), H5T_IEEE_F32LE, space.get(), lcpl.get(), dcpl.get(), H5P_DEFAULT),
        H5Dclose, fmt::format("cannot create dataset {} in {}", p.dataset_path(), where));
    write_string_attribute(dataset.get(), "global_name", p.global_name);
    write_int64_attribute(dataset.get(), "global_shape", p.global_shape);
    write_int64_attribute(dataset.get(), "offset", matrix ? std::vector<int64_t>{p.row, p.col} : std::vector<int64_t>{p.row});
    const haddr_t offset = H5Dget_offset(dataset.get());
    if (offset == HADDR_UNDEF) fail(fmt::format("dataset {} in {} has no file offset", p.dataset_path(), where));
    offsets.push_back(offset);
  }
  H5Handle group(H5Gcreate2(file.get(), "/state", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose,
                 fmt::format("cannot create /state in {}", where));
  write_int64_attribute(group.get(), "step", {state.at("step").get<int64_t>()});
  write_int64_attribute(group.get(), "tokens", {state.at("tokens").get<int64_t>()});
  write_string_attribute(group.get(), "layout", state.at("layout").dump());
  write_string_attribute(group.get(), "json", state.dump());
  group.close("H5Gclose");
  file.close(fmt::format("cannot close {}", where));
  fs_.reserve(path, std::filesystem::file_size(path));
  return offsets;
}

uint64_t ShardWriter::write_bulk(const std::filesystem::path& path, const std::vector<uint64_t>& offsets) {
  common::UniqueFd direct;
  if (o_direct_) {
    direct = common::UniqueFd(::open(path.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC));
    if (direct.get() < 0) {
      if (errno != EINVAL) fail(fmt::format("cannot open {}: {}", path.string(), std::strerror(errno)));
      warn_once(g_no_o_direct,
                fmt::format("the filesystem of {} refuses O_DIRECT: checkpoints are written through the page cache",
                            path.parent_path().string()));
    }
  }
  common::UniqueFd buffered(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
  if (buffered.get() < 0) fail(fmt::format("cannot open {}: {}", path.string(), std::strerror(errno)));

  // The aligned body of each dataset goes direct, the rest buffered, in
  // chunks that never straddle two registered buffers.
  std::vector<WriteOp> ops;
  uint64_t direct_bytes = 0;
  const bool fixed = ring_ && ring_->registered;
  auto add = [&](int fd, uint64_t offset, size_t staged, size_t len) {
    while (len > 0) {
      const size_t buffer = staged / kMaxRegistered;
      const size_t n = std::min({len, kChunk, (buffer + 1) * kMaxRegistered - staged});
      ops.push_back(WriteOp{fd, offset, staging_.get() + staged, n, fixed ? static_cast<int>(buffer) : -1});
      offset += n;
      staged += n;
      len -= n;
    }
  };
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const size_t len = pieces_[i].bytes();
    const size_t body = direct.get() >= 0 && offsets[i] % kAlign == 0 ? len / kAlign * kAlign : 0;
    add(direct.get(), offsets[i], staging_offset_[i], body);
    direct_bytes += body;
    add(buffered.get(), offsets[i] + body, staging_offset_[i] + body, len - body);
  }

  if (!ring_) {
    for (const WriteOp& op : ops) pwrite_all(op.fd, op.data, op.len, op.offset, path);
    if (::fsync(buffered.get()) != 0) fail(fmt::format("fsync of {} failed: {}", path.string(), std::strerror(errno)));
    return direct_bytes;
  }

  io_uring* ring = &ring_->ring;
  std::string error;
  size_t next = 0, in_flight = 0;
  // On an error nothing more is submitted, but the writes in flight are
  // reaped before returning: the kernel still reads the staging buffer.
  while ((next < ops.size() && error.empty()) || in_flight > 0) {
    while (next < ops.size() && error.empty() && in_flight < kQueueDepth) {
      io_uring_sqe* sqe = io_uring_get_sqe(ring);
      if (sqe == nullptr) break;
      const WriteOp& op = ops[next];
      if (op.buf_index >= 0) {
        io_uring_prep_write_fixed(sqe, op.fd, op.data, static_cast<unsigned>(op.len), op.offset, op.buf_index);
      } else {
        io_uring_prep_write(sqe, op.fd, op.data, static_cast<unsigned>(op.len), op.offset);
      }
      io_uring_sqe_set_data64(sqe, next);
      ++next;
      ++in_flight;
    }
    const int rc = io_uring_submit_and_wait(ring, 1);
    if (rc < 0 && rc != -EINTR) fail(fmt::format("io_uring submit for {} failed: {}", path.string(), std::strerror(-rc)));
    io_uring_cqe* cqe = nullptr;
    while (io_uring_peek_cqe(ring, &cqe) == 0) {
      const WriteOp& op = ops[io_uring_cqe_get_data64(cqe)];
      const int res = cqe->res;
      io_uring_cqe_seen(ring, cqe);
      --in_flight;
      if (res < 0) {
        if (error.empty()) error = fmt::format("write to {} failed: {}", path.string(), std::strerror(-res));
      } else if (static_cast<size_t>(res) < op.len && error.empty()) {
        // A short write (the disk filling up, say): finish it by hand,
        // buffered, which reports the error if there is one.
        try {
          pwrite_all(buffered.get(), op.data + res, op.len - static_cast<size_t>(res), op.offset + res, path);
        } catch (const common::Error& e) {
          error = e.what();
        }
      }
    }
  }
  if (!error.empty()) fail(error);

  // Every write above has completed; the fsync makes them durable.
  io_uring_sqe* sqe = io_uring_get_sqe(ring);
  io_uring_prep_fsync(sqe, buffered.get(), 0);
  sqe->flags |= IOSQE_IO_DRAIN;
  int rc = io_uring_submit_and_wait(ring, 1);
  io_uring_cqe* cqe = nullptr;
  if (rc >= 0) rc = io_uring_wait_cqe(ring, &cqe);
  if (rc < 0) fail(fmt::format("io_uring fsync of {} failed: {}", path.string(), std::strerror(-rc)));
  const int res = cqe->res;
  io_uring_cqe_seen(ring, cqe);
  if (res < 0) fail(fmt::format("fsync of {} failed: {}", path.string(), std::strerror(-res)));
  return direct_bytes;
}

}  // namespace keel::checkpoint
