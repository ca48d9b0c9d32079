// Figures as operators read them in logs and keelctl tables.
#pragma once

#include <cstdint>
#include <string>

namespace keel::common {

// "42s", "3m07s", "5h02m".
std::string format_duration(double seconds);
// "512 B", "4.0 KiB", "1.5 GiB".
std::string format_bytes(uint64_t bytes);

}  // namespace keel::common
