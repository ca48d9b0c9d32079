// keeld's control protocol (docs/architecture.md "Daemon"): JSON lines over a Unix socket.
// keelctl and keeld share this file and nothing else of each other.
//
// A request is one JSON object on one line:
//   {"command": "status"}
//   {"command": "events", "limit": 20}
//   {"command": "checkpoint_now"}
//   {"command": "stop", "checkpoint": true}
//   {"command": "restart"}
//   {"command": "health"}
//   {"command": "diagnose"}
//   {"command": "stragglers"}
//   {"command": "inject", "kind": "hang", "rank": 1, "step": 30, "group": "dp"}
//     (inject's other fields: "factor", "bit", "target", "tensor"; see
//     daemon/fault_request.h)
// The reply is one JSON object on one line: {"ok": true, ...} or
// {"ok": false, "error": "what went wrong and what to do"}. A connection
// may carry several requests, one after the other.
#pragma once

#include "daemon/fault_request.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace keel::daemon {

enum class Command { kStatus, kEvents, kCheckpointNow, kStop, kRestart, kHealth, kDiagnose, kStragglers, kInject };

struct Request {
  Command command = Command::kStatus;
  int64_t limit = 20;       // events: how many of the newest
  bool checkpoint = true;   // stop: take a final checkpoint first
  FaultSpec fault;          // inject
};

// A request or reply that does not follow the protocol.
class ProtocolError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Parses one request line (without its newline). ProtocolError says what
// is wrong: not JSON, not an object, an unknown command or field, a wrong
// type, a fault that fault_spec_problem() refuses.
Request parse_request(std::string_view line);
// The line keelctl sends for `request`, newline included.
std::string request_line(const Request& request);
// One reply line, newline included. Never throws: text that is not UTF-8
// is replaced, since an error message may quote what a client sent.
std::string reply_line(const nlohmann::json& reply);
nlohmann::json error_reply(const std::string& message);

// The control socket keelctl talks to: $KEEL_SOCKET, else /run/keel/keeld.sock.
std::string default_socket_path();

// No keeld answers at the socket: it is not running, or the path is wrong.
class DaemonUnreachable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Sends one request and returns keeld's reply. DaemonUnreachable when the
// socket does not answer within `timeout`; ProtocolError when the reply is
// not a JSON object.
nlohmann::json call_daemon(const std::string& socket_path, const Request& request,
                           std::chrono::milliseconds timeout = std::chrono::seconds(10));

}  // namespace keel::daemon
