#include "daemon/protocol.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>

namespace keel::daemon {
namespace {

const std::map<std::string, Command>& command_names() {
  static const std::map<std::string, Command> names = {{"status", Command::kStatus},
                                                       {"events", Command::kEvents},
                                                       {"checkpoint_now", Command::kCheckpointNow},
                                                       {"stop", Command::kStop},
                                                       {"restart", Command::kRestart},
                                                       {"health", Command::kHealth},
                                                       {"diagnose", Command::kDiagnose},
                                                       {"stragglers", Command::kStragglers},
                                                       {"inject", Command::kInject}};
  return names;
}

std::string command_name(Command command) {
  for (const auto& [name, value] : command_names()) {
    if (value == command) return name;
  }
  return "status";
}

std::string known_commands() {
  std::string out;
  for (const auto& [name, value] : command_names()) out += (out.empty() ? "" : ", ") + name;
  return out;
}

}  // namespace

Request parse_request(std::string_view line) {
  nlohmann::json message;
  try {
    message = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception&) {
    throw ProtocolError("not a JSON line; send one object such as {\"command\": \"status\"}");
  }
  if (!message.is_object()) throw ProtocolError("a request must be a JSON object such as {\"command\": \"status\"}");
  const auto command = message.find("command");
  if (command == message.end() || !command->is_string()) {
    throw ProtocolError("a request needs \"command\" (a string); commands: " + known_commands());
  }
  const auto known = command_names().find(command->get<std::string>());
  if (known == command_names().end()) throw ProtocolError("unknown command; commands: " + known_commands());
  Request request;
  request.command = known->second;
  for (const auto& [key, value] : message.items()) {
    if (key == "command") continue;
    if (key == "limit" && request.command == Command::kEvents) {
      if (!value.is_number_integer() || value.get<int64_t>() < 1 || value.get<int64_t>() > 100000) {
        throw ProtocolError("\"limit\" must be an integer in [1, 100000]");
      }
      request.limit = value.get<int64_t>();
    } else if (key == "checkpoint" && request.command == Command::kStop) {
      if (!value.is_boolean()) throw ProtocolError("\"checkpoint\" must be true or false");
      request.checkpoint = value.get<bool>();
    } else {
      bool taken = false;
      try {
        taken = request.command == Command::kInject && set_fault_field(request.fault, key, value);
      } catch (const std::invalid_argument& e) {
        throw ProtocolError(e.what());
      }
      if (!taken) throw ProtocolError(fmt::format("unknown field for command {}", known->first));
    }
  }
  if (request.command == Command::kInject) {
    if (!message.contains("kind")) throw ProtocolError("inject needs \"kind\": crash, hang, slow, bitflip or nan");
    if (const std::string problem = fault_spec_problem(request.fault); !problem.empty()) throw ProtocolError(problem);
  }
  return request;
}

std::string request_line(const Request& request) {
  nlohmann::json message = {{"command", command_name(request.command)}};
  if (request.command == Command::kEvents) message["limit"] = request.limit;
  if (request.command == Command::kStop) message["checkpoint"] = request.checkpoint;
  if (request.command == Command::kInject) message.update(fault_json(request.fault));
  return message.dump() + "\n";
}

std::string reply_line(const nlohmann::json& reply) {
  return reply.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

nlohmann::json error_reply(const std::string& message) { return {{"ok", false}, {"error", message}}; }

std::string default_socket_path() {
  const char* env = std::getenv("KEEL_SOCKET");
  return env != nullptr && *env != '\0' ? std::string(env) : std::string("/run/keel/keeld.sock");
}

nlohmann::json call_daemon(const std::string& socket_path, const Request& request, std::chrono::milliseconds timeout) {
  auto unreachable = [&](const std::string& why) {
    return DaemonUnreachable(fmt::format("keeld is not answering at {}: {}. Is keeld running (systemctl status "
                                         "keeld)? Another socket is chosen with --socket or KEEL_SOCKET.",
                                         socket_path, why));
  };
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof(address.sun_path)) throw unreachable("the path is too long for a Unix socket");
  std::memcpy(address.sun_path, socket_path.c_str(), socket_path.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw unreachable(std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  timeval tv{};
  tv.tv_sec = timeout.count() / 1000;
  tv.tv_usec = (timeout.count() % 1000) * 1000;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  if (connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    throw unreachable(std::strerror(errno));
  }
  const std::string line = request_line(request);
  // keeld may refuse a peer and close before reading the request: the send
  // then fails, but the refusal is waiting to be read and says why.
  int send_error = 0;
  for (size_t sent = 0; sent < line.size();) {
    const ssize_t n = send(fd, line.data() + sent, line.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) {
      send_error = errno;
      break;
    }
    sent += static_cast<size_t>(n);
  }
  std::string reply;
  char chunk[4096];
  while (reply.find('\n') == std::string::npos) {
    const ssize_t n = recv(fd, chunk, sizeof(chunk), 0);
    if (n == 0) {
      throw unreachable(send_error != 0 ? std::strerror(send_error) : "it closed the connection without a reply");
    }
    if (n < 0) throw unreachable(errno == EAGAIN ? "no reply in time" : std::strerror(send_error != 0 ? send_error : errno));
    reply.append(chunk, static_cast<size_t>(n));
  }
  reply.resize(reply.find('\n'));
  nlohmann::json parsed = nlohmann::json::parse(reply, nullptr, false);
  if (parsed.is_discarded() || !parsed.is_object()) throw ProtocolError("keeld's reply is not a JSON object: " + reply);
  return parsed;
}

}  // namespace keel::daemon
