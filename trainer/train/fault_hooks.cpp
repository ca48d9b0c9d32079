#include "trainer/train/fault_hooks.h"

#include "checkpoint/paths.h"
#include "common/error.h"
#include "common/log.h"
#include "common/unique_fd.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace keel::trainer {

void flip_if_due(Backend& backend, const health::FaultInjector& faults, std::string_view target,
                 const std::vector<health::FaultInjector::Site>& sites,
                 const std::function<float*(size_t site)>& where) {
  const auto flip = faults.bitflip(target, sites);
  if (!flip) return;
  float* data = where(flip->site);
  if (data == nullptr) return;
  float before = 0;
  backend.copy_to_host(&before, data + flip->index, sizeof(float));
  uint32_t bits = 0;
  std::memcpy(&bits, &before, sizeof bits);
  bits ^= uint32_t{1} << flip->bit;
  float after = 0;
  std::memcpy(&after, &bits, sizeof after);
  backend.copy_from_host(data + flip->index, &after, sizeof(float));
  faults.record_flip(target, sites[flip->site].name, flip->index, flip->bit, before, after);
}

CheckpointFaults::CheckpointFaults(checkpoint::FileSystem& target, const health::FaultInjector& faults)
    : FileSystemWrapper(target), faults_(faults) {}

void CheckpointFaults::reserve(const std::filesystem::path& file, uint64_t bytes) {
  // The rank file lives in step_%08d.partial/.
  const auto step = checkpoint::step_of(file.parent_path().stem());
  const std::string fault = step ? faults_.checkpoint_fault(*step) : std::string();
  std::error_code ec;
  const bool empty = std::filesystem::file_size(file, ec) == 0 && !ec;
  int error = 0;
  if (fault == "disk_full" && empty) error = ENOSPC;
  if (fault == "write_error" && !empty) error = EIO;
  if (error != 0) {
    common::logger("faults")->warn(
        "fault injection ([faults] checkpoint_fault = {}): reserving {} bytes of {} fails "
        "with {}",
        fault, bytes, file.string(), std::strerror(error));
    // The sentence a real failure of this call gives.
    throw common::Error(common::ErrorCode::kCheckpointFailure,
                        fmt::format("no room for the {} bytes of {}: {}", bytes, file.string(), std::strerror(error)));
  }
  FileSystemWrapper::reserve(file, bytes);
  if (step) {
    std::lock_guard lock(mutex_);
    last_file_ = file;
    last_step_ = *step;
  }
}

void CheckpointFaults::written(int64_t step) {
  if (faults_.checkpoint_fault(step) != "corrupt") return;
  std::filesystem::path file;
  {
    std::lock_guard lock(mutex_);
    if (last_step_ != step) return;
    file = last_file_;
  }
  auto fail = [&](const char* what) {
    throw common::Error(common::ErrorCode::kInternal,
                        fmt::format("fault injection could not {} {}: {}", what, file.string(), std::strerror(errno)));
  };
  common::UniqueFd fd(::open(file.c_str(), O_RDWR | O_CLOEXEC));
  if (fd.get() < 0) fail("open");
  const off_t offset = static_cast<off_t>(std::filesystem::file_size(file) / 2);
  unsigned char byte = 0;
  if (::pread(fd.get(), &byte, 1, offset) != 1) fail("read");
  const unsigned char flipped = byte ^ 0xFF;
  common::logger("faults")->warn(
      "fault injection ([faults] checkpoint_fault = corrupt): byte {} of {} flips from "
      "{:#04x} to {:#04x} after its checksum was taken",
      offset, file.string(), byte, flipped);
  if (::pwrite(fd.get(), &flipped, 1, offset) != 1 || ::fsync(fd.get()) != 0) fail("write");
}

void GemmBitFlip::matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N, int C,
                                 int OC) {
  target_.matmul_forward(out, inp, weight, bias, N, C, OC);
  float first = 0;
  copy_to_host(&first, out, sizeof first);
  uint32_t bits = 0;
  std::memcpy(&bits, &first, sizeof bits);
  bits ^= 1u;
  std::memcpy(&first, &bits, sizeof first);
  copy_from_host(out, &first, sizeof first);
}

}  // namespace keel::trainer
