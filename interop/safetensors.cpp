#include "interop/safetensors.h"

#include "common/unique_fd.h"
#include "common/write_all.h"
#include "trainer/kernels/dtype.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>

namespace keel::interop {
namespace {

using common::Error;
using common::ErrorCode;

// The reference implementation's bound on a header: anything larger is
// not a header but damage.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

[[noreturn]] void refuse(const std::filesystem::path& path, const std::string& what) {
  throw Error(ErrorCode::kDataError, fmt::format("{} is not a safetensors file keel can read: {}", path.string(), what));
}

std::optional<TensorDtype> dtype_of(const std::string& name) {
  for (TensorDtype d : {TensorDtype::kF32, TensorDtype::kBF16, TensorDtype::kF16}) {
    if (name == dtype_name(d)) return d;
  }
  return std::nullopt;
}

// IEEE half to float, exactly (every half is a float).
float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // zero or subnormal
  } else if (exponent == 31) {
    magnitude = mantissa == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400u), static_cast<int>(exponent) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, sizeof(bits));
  bits |= sign;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// The product of `shape`, or -1 when a dimension is negative or it overflows.
int64_t product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && n > std::numeric_limits<int64_t>::max() / d)) return -1;
    n *= d;
  }
  return n;
}

TensorEntry parse_entry(const std::filesystem::path& path, const std::string& name, const nlohmann::json& j) {
  auto bad = [&](const std::string& what) { refuse(path, fmt::format("tensor \"{}\" {}", name, what)); };
  if (!j.is_object()) bad("is not a JSON object of dtype, shape and data_offsets");
  TensorEntry t;
  t.name = name;
  const auto dtype = j.find("dtype");
  if (dtype == j.end() || !dtype->is_string()) bad("has no dtype string");
  const auto d = dtype_of(dtype->get<std::string>());
  if (!d) bad(fmt::format("has dtype {}, which keel does not read (it reads F32, BF16 and F16)", dtype->dump()));
  t.dtype = *d;
  const auto shape = j.find("shape");
  if (shape == j.end() || !shape->is_array()) bad("has no shape array");
  for (const auto& dim : *shape) {
    if (!dim.is_number_unsigned()) bad(fmt::format("has shape {}, not a list of non-negative integers", shape->dump()));
    t.shape.push_back(dim.get<int64_t>());
  }
  const auto offsets = j.find("data_offsets");
  if (offsets == j.end() || !offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
      !(*offsets)[1].is_number_unsigned()) {
    bad("has no data_offsets [begin, end] of non-negative integers");
  }
  t.begin = (*offsets)[0].get<uint64_t>();
  t.end = (*offsets)[1].get<uint64_t>();
  if (t.end < t.begin) bad(fmt::format("has data_offsets [{}, {}] that end before they begin", t.begin, t.end));
  const int64_t numel = product(t.shape);
  if (numel < 0) bad(fmt::format("has shape [{}], too large to address", fmt::join(t.shape, ", ")));
  const uint64_t needed = static_cast<uint64_t>(numel) * dtype_bytes(t.dtype);
  if (needed != t.end - t.begin) {
    bad(fmt::format("has shape [{}] of {}, which takes {} bytes, but its data_offsets [{}, {}] hold {}",
                    fmt::join(t.shape, ", "), dtype_name(t.dtype), needed, t.begin, t.end, t.end - t.begin));
  }
  return t;
}

// Writes all of `bytes` at the file's position; Error naming `path`.
void write_all(int fd, const void* bytes, size_t n, const std::filesystem::path& path) {
  if (const int error = common::write_all(fd, bytes, n); error != 0) {
    throw Error(ErrorCode::kCheckpointFailure, fmt::format("cannot write {}: {}", path.string(), std::strerror(error)));
  }
}

std::string header_of(const std::vector<TensorToWrite>& tensors, TensorDtype dtype) {
  nlohmann::json header = {{"__metadata__", {{"format", "pt"}}}};
  uint64_t at = 0;
  for (const auto& t : tensors) {
    const uint64_t bytes = static_cast<uint64_t>(t.numel()) * dtype_bytes(dtype);
    header[t.name] = {{"dtype", dtype_name(dtype)}, {"shape", t.shape}, {"data_offsets", {at, at + bytes}}};
    at += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  return text;
}

}  // namespace

const char* dtype_name(TensorDtype dtype) {
  switch (dtype) {
    case TensorDtype::kF32: return "F32";
    case TensorDtype::kBF16: return "BF16";
    case TensorDtype::kF16: return "F16";
  }
  return "?";
}

size_t dtype_bytes(TensorDtype dtype) { return dtype == TensorDtype::kF32 ? 4 : 2; }

int64_t TensorEntry::numel() const { return product(shape); }
int64_t TensorToWrite::numel() const { return product(shape); }

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path) : path_(path) {
  common::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    throw Error(ErrorCode::kDataError, fmt::format("cannot open {}: {}", path.string(), std::strerror(errno)));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    throw Error(ErrorCode::kDataError, fmt::format("cannot stat {}: {}", path.string(), std::strerror(errno)));
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ < 8) refuse(path, fmt::format("it is {} bytes long, shorter than the 8-byte header length", size_));
  void* mapped = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (mapped == MAP_FAILED) {
    throw Error(ErrorCode::kDataError, fmt::format("cannot map {}: {}", path.string(), std::strerror(errno)));
  }
  mapped_ = static_cast<const std::byte*>(mapped);
  try {
    uint64_t header_bytes = 0;
    std::memcpy(&header_bytes, mapped_, sizeof(header_bytes));  // little-endian, as x86 and ARM are
    if (header_bytes > size_ - 8) {
      refuse(path, fmt::format("its header length {} runs past the end of the file ({} bytes)", header_bytes, size_));
    }
    if (header_bytes > kMaxHeaderBytes) {
      refuse(path, fmt::format("its header length {} is past the {} bytes a header may take", header_bytes,
                               kMaxHeaderBytes));
    }
    data_start_ = 8 + header_bytes;
    const auto header = nlohmann::json::parse(reinterpret_cast<const char*>(mapped_) + 8,
                                              reinterpret_cast<const char*>(mapped_) + data_start_, nullptr, false);
    if (header.is_discarded() || !header.is_object()) refuse(path, "its header is not a JSON object");
    const uint64_t data_bytes = size_ - data_start_;
    for (const auto& [name, value] : header.items()) {
      if (name == "__metadata__") {
        if (!value.is_object()) refuse(path, "its __metadata__ is not an object of strings");
        for (const auto& [key, text] : value.items()) {
          if (!text.is_string()) refuse(path, fmt::format("its __metadata__ entry \"{}\" is not a string", key));
          metadata_[key] = text.get<std::string>();
        }
        continue;
      }
      TensorEntry t = parse_entry(path, name, value);
      if (t.end > data_bytes) {
        refuse(path, fmt::format("tensor \"{}\" has data_offsets [{}, {}] past the end of the data ({} bytes)", name,
                                 t.begin, t.end, data_bytes));
      }
      tensors_.push_back(std::move(t));
    }
    std::sort(tensors_.begin(), tensors_.end(),
              [](const TensorEntry& a, const TensorEntry& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
    for (size_t i = 1; i < tensors_.size(); ++i) {
      const auto& a = tensors_[i - 1];
      const auto& b = tensors_[i];
      if (b.begin < a.end) {
        refuse(path, fmt::format("tensors \"{}\" [{}, {}] and \"{}\" [{}, {}] share bytes", a.name, a.begin, a.end,
                                 b.name, b.begin, b.end));
      }
    }
  } catch (...) {
    ::munmap(const_cast<std::byte*>(mapped_), size_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() { ::munmap(const_cast<std::byte*>(mapped_), size_); }

const TensorEntry* SafetensorsFile::find(const std::string& name) const {
  for (const auto& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

void SafetensorsFile::read(const TensorEntry& tensor, float* dst) const {
  const std::byte* src = mapped_ + data_start_ + tensor.begin;
  const size_t n = static_cast<size_t>(tensor.numel());
  switch (tensor.dtype) {
    case TensorDtype::kF32: std::memcpy(dst, src, n * sizeof(float)); return;
    case TensorDtype::kBF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        const uint32_t bits = static_cast<uint32_t>(h) << 16;
        std::memcpy(dst + i, &bits, sizeof(float));
      }
      return;
    case TensorDtype::kF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = half_to_float(h);
      }
      return;
  }
}

uint64_t safetensors_bytes(const std::vector<TensorToWrite>& tensors, TensorDtype dtype) {
  uint64_t bytes = 8 + header_of(tensors, dtype).size();
  for (const auto& t : tensors) bytes += static_cast<uint64_t>(t.numel()) * dtype_bytes(dtype);
  return bytes;
}

void write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                       TensorDtype dtype, const std::function<void(size_t, float*)>& fill) {
  if (dtype == TensorDtype::kF16) throw std::invalid_argument("safetensors are written as F32 or BF16");
  common::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  if (fd.get() < 0) {
    throw Error(ErrorCode::kCheckpointFailure, fmt::format("cannot create {}: {}", path.string(), std::strerror(errno)));
  }
  const std::string header = header_of(tensors, dtype);
  const uint64_t length = header.size();
  write_all(fd.get(), &length, sizeof(length), path);
  write_all(fd.get(), header.data(), header.size(), path);
  std::vector<float> values;
  std::vector<uint16_t> halves;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto n = static_cast<size_t>(tensors[i].numel());
    values.resize(n);
    fill(i, values.data());
    if (dtype == TensorDtype::kF32) {
      write_all(fd.get(), values.data(), n * sizeof(float), path);
      continue;
    }
    halves.resize(n);
    std::transform(values.begin(), values.end(), halves.begin(), [](float v) { return trainer::to_bf16(v).bits; });
    write_all(fd.get(), halves.data(), n * sizeof(uint16_t), path);
  }
  if (::fsync(fd.get()) != 0 || fd.close() != 0) {
    throw Error(ErrorCode::kCheckpointFailure, fmt::format("cannot fsync {}: {}", path.string(), std::strerror(errno)));
  }
}

}  // namespace keel::interop
