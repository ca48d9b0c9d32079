#include "common/error.h"

namespace keel::common {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kBadConfig: return "bad_config";
    case ErrorCode::kDataError: return "data_error";
    case ErrorCode::kCollectiveHang: return "collective_hang";
    case ErrorCode::kSdcSuspected: return "sdc_suspected";
    case ErrorCode::kPeerFailure: return "peer_failure";
    case ErrorCode::kCheckpointFailure: return "checkpoint_failure";
    case ErrorCode::kStoppedOnRequest: return "stopped_on_request";
    case ErrorCode::kInternal: return "internal";
  }
  return "unknown";
}

}  // namespace keel::common
