#include "trainer/train/fault_hooks.h"

#include "checkpoint/paths.h"
#include "common/error.h"
#include "common/log.h"
#include "common/unique_fd.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

namespace keel::trainer {

void flip_if_due(Backend& backend, const health::FaultInjector& faults, std::string_view target,
                 const std::vector<health::FaultInjector::Site>& sites,
                 const std::function<Buffer(size_t site)>& where) {
  const auto flip = faults.bitflip(target, sites);
  if (!flip) return;
  const Buffer data = where(flip->site);
  if (data.data == nullptr) return;
  const FlippedBit flipped = flip_bit(backend, data, flip->index, flip->bit);
  faults.record_flip(target, sites[flip->site].name, flip->index, flipped.bit, flipped.before, flipped.after);
}

FlippedBit flip_bit(Backend& backend, Buffer data, size_t index, int bit) {
  FlippedBit flipped;
  if (data.dtype == DType::kBF16) {
    bf16 value;
    auto* at = static_cast<bf16*>(data.data) + index;
    backend.copy_to_host(&value, at, sizeof value);
    flipped.before = to_float(value);
    flipped.bit = std::max(bit, 16);
    value.bits ^= static_cast<uint16_t>(1u << (flipped.bit - 16));
    flipped.after = to_float(value);
    backend.copy_from_host(at, &value, sizeof value);
    return flipped;
  }
  float* at = static_cast<float*>(data.data) + index;
  backend.copy_to_host(&flipped.before, at, sizeof(float));
  uint32_t bits = 0;
  std::memcpy(&bits, &flipped.before, sizeof bits);
  bits ^= uint32_t{1} << bit;
  std::memcpy(&flipped.after, &bits, sizeof bits);
  flipped.bit = bit;
  backend.copy_from_host(at, &flipped.after, sizeof(float));
  return flipped;
}

StepFaults::StepFaults(const common::Config& config, const health::FaultInjector& faults, const ZeroStorage& storage,
                       int micro_batch)
    : faults_(faults), table_(storage.table()), n_layer_(config.model.n_layer) {
  for (size_t t = 0; t < table_.specs().size(); ++t) {
    tensor_sites_.push_back({table_.specs()[t].name, table_.specs()[t].numel});
    owned_sites_.push_back({table_.specs()[t].name, storage.owned_numel(t)});
  }
  const ModelStage& stage = table_.stage();
  const size_t positions = static_cast<size_t>(micro_batch * config.model.seq_len / config.parallel.cp);
  const size_t shard = positions / static_cast<size_t>(config.parallel.tp) * static_cast<size_t>(config.model.n_embd);
  for (int64_t b = 0; b < stage.layers(); ++b) {
    activation_sites_.push_back({fmt::format("h.{}.output", stage.layer(b)), shard});
  }
  const size_t vocabulary = static_cast<size_t>(config.model.padded_vocab() / config.parallel.tp);
  if (stage.last()) activation_sites_.push_back({"logits", positions * vocabulary});
  const auto& f = config.faults;
  if (f.bitflip_tensor.empty()) return;
  // The name must be one of the whole model's; a stage without it never flips.
  std::vector<std::string> names;
  if (f.bitflip_target == "activation") {
    for (int64_t i = 0; i < config.model.n_layer; ++i) names.push_back(fmt::format("h.{}.output", i));
    names.push_back("logits");
  } else {
    const ParameterTable whole(config.model);
    for (const ParamSpec& spec : whole.specs()) names.push_back(spec.name);
  }
  if (std::find(names.begin(), names.end(), f.bitflip_tensor) == names.end()) {
    throw common::Error(
        common::ErrorCode::kBadConfig,
        fmt::format("faults.bitflip_tensor = \"{}\" names no {} of this model; name one such as "
                    "\"{}\", or leave it empty to draw one",
                    f.bitflip_tensor, f.bitflip_target == "activation" ? "activation" : "tensor", names.front()));
  }
}

void StepFaults::on_gradients(Backend& backend, int unit, float* grads, size_t numel) {
  const size_t first = table_.unit_first_tensor(unit), end = table_.unit_end_tensor(unit);
  if (poison_gradient_ && numel > 0) {
    const float nan = std::nanf("");  // into the unit's first element
    backend.copy_from_host(grads, &nan, sizeof(float));
    poison_gradient_ = false;
  }
  flip_if_due(backend, faults_, "grad", tensor_sites_, [&](size_t t) {
    return t >= first && t < end ? grads + (table_.specs()[t].offset - table_.unit_begin(unit)) : nullptr;
  });
}

void StepFaults::on_activation(Backend& backend, int site, Buffer data) {
  // Site i < n_layer is this stage's block of layer i; the logits come last.
  const size_t local =
      site == n_layer_ ? activation_sites_.size() - 1 : static_cast<size_t>(table_.stage().block_of(site));
  flip_if_due(backend, faults_, "activation", activation_sites_,
              [&](size_t s) { return s == local ? data : Buffer(nullptr); });
}

void StepFaults::after_update(Backend& backend, ZeroStorage& storage, AdamW& optimizer) {
  // Parameters are whole on every rank below ZeRO-3: a flip lands in this
  // rank's copy after the update's all-gather, as a bad memory cell would.
  const bool whole = storage.stage() < 3;
  flip_if_due(backend, faults_, "param", whole ? tensor_sites_ : owned_sites_, [&](size_t t) {
    return whole ? storage.params() + table_.specs()[t].offset : storage.owned_parameters(t);
  });
  flip_if_due(backend, faults_, "exp_avg", owned_sites_, [&](size_t t) { return optimizer.exp_avg(t); });
  flip_if_due(backend, faults_, "exp_avg_sq", owned_sites_, [&](size_t t) { return optimizer.exp_avg_sq(t); });
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

void GemmBitFlip::matmul_forward(Buffer out, ConstBuffer inp, ConstBuffer weight, ConstBuffer bias, int N, int C,
                                 int OC) {
  target_.matmul_forward(out, inp, weight, bias, N, C, OC);
  flip_bit(*this, out, 0, 0);
}

}  // namespace keel::trainer
