// Logging: one named spdlog logger per module, every line stamped with the
// process's rank and current step so interleaved logs of many ranks can be
// read apart. Levels come from SPDLOG_LEVEL (e.g. SPDLOG_LEVEL=debug or
// SPDLOG_LEVEL=data=debug,info).
#pragma once

#include <spdlog/spdlog.h>

#include <cstdint>
#include <memory>
#include <string>

namespace keel::common {

// Sets up the sinks and pattern once per process; call before logger().
// Safe to call again (later calls only update the rank). keeld, which is
// no rank, passes -1.
void init_logging(int rank);

// The logger for a module ("trainer", "data", "config", ...), created on
// first use with the shared sinks and pattern.
std::shared_ptr<spdlog::logger> logger(const std::string& module);

// The step printed on every log line; -1 prints "-" (before training starts).
void set_log_step(int64_t step);

}  // namespace keel::common
