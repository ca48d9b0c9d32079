#include "tests/support/npy.h"

#include <fstream>
#include <numeric>
#include <stdexcept>
#include <string>

namespace keel::test {
namespace {

void write(const std::filesystem::path& path, const void* data, size_t elem_bytes, const char* descr,
           const std::vector<int64_t>& shape) {
  std::string dims;
  for (int64_t d : shape) dims += std::to_string(d) + ",";
  if (shape.size() > 1) dims.pop_back();  // (3,) for 1-D, (2,3) otherwise
  std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (" + dims + "), }";
  // The preamble (10 bytes) plus header and its newline is a multiple of 64.
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  out.write("\x93NUMPY\x01\x00", 8);
  uint16_t header_len = static_cast<uint16_t>(header.size());
  out.write(reinterpret_cast<const char*>(&header_len), 2);
  out << header;
  int64_t count = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(count * elem_bytes));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

}  // namespace

void write_npy(const std::filesystem::path& path, const float* data, const std::vector<int64_t>& shape) {
  write(path, data, sizeof(float), "<f4", shape);
}

void write_npy(const std::filesystem::path& path, const int32_t* data, const std::vector<int64_t>& shape) {
  write(path, data, sizeof(int32_t), "<i4", shape);
}

}  // namespace keel::test
