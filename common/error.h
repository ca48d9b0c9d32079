// Errors inside a process are exceptions carrying a typed code; across
// processes the code becomes the exit status (docs/architecture.md "Worker contract"), so a supervisor can
// tell a bad config from a hung collective without parsing logs.
#pragma once

#include <stdexcept>
#include <string>

namespace keel::common {

enum class ErrorCode : int {
  kBadConfig = 2,          // bad config file, --set override or command line
  kDataError = 3,          // unreadable or malformed token shard
  kCollectiveHang = 10,    // a collective stayed in flight past its timeout
  kSdcSuspected = 11,      // silent data corruption suspected on this rank
  kPeerFailure = 12,       // a peer or the transport failed
  kCheckpointFailure = 13, // a checkpoint could not be written or read
  kStoppedOnRequest = 14,  // stopped on request after a final checkpoint
  kInternal = 70,          // a bug in keel: anything not covered above
};

// Every code, in the order above, for whatever goes through them all.
inline constexpr ErrorCode kErrorCodes[] = {ErrorCode::kBadConfig,         ErrorCode::kDataError,
                                            ErrorCode::kCollectiveHang,    ErrorCode::kSdcSuspected,
                                            ErrorCode::kPeerFailure,       ErrorCode::kCheckpointFailure,
                                            ErrorCode::kStoppedOnRequest, ErrorCode::kInternal};

// The process exit status for a code.
inline int exit_code(ErrorCode code) { return static_cast<int>(code); }

// A short name for logs and events ("bad_config", "data_error", ...).
const char* error_code_name(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace keel::common
