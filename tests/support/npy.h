#pragma once

#include <cstdint>
#include <filesystem>
#include <vector>

namespace keel::test {

// Writes a little-endian .npy (format 1.0) that numpy.load reads.
void write_npy(const std::filesystem::path& path, const float* data, const std::vector<int64_t>& shape);
void write_npy(const std::filesystem::path& path, const int32_t* data, const std::vector<int64_t>& shape);

}  // namespace keel::test
