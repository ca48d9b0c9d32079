#include "store/tcp_store.h"

#include "common/error.h"
#include "common/log.h"
#include "common/thread_name.h"

#include <boost/asio.hpp>
#include <fmt/format.h>

#include <sys/random.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string_view>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>

namespace keel::store {

using common::Error;
using common::ErrorCode;

namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using boost::system::error_code;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

spdlog::logger& store_log() {
  static const std::shared_ptr<spdlog::logger> instance = common::logger("store");
  return *instance;
}

// A key as errors and logs show it: quoted, with bytes that would garble a
// terminal escaped (keys are bytes like values, though usually text).
std::string quoted(std::string_view key) {
  std::string out = "'";
  for (unsigned char c : key) {
    if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      out += fmt::format("\\x{:02x}", c);
    }
  }
  out.push_back('\'');
  return out;
}

std::string quoted(const std::vector<std::string>& keys) {
  std::string out;
  for (const std::string& key : keys) {
    if (!out.empty()) out += ", ";
    out += quoted(key);
  }
  return out;
}

// ---------------------------------------------------------------------------
// The protocol, spoken by both sides. Every message is a frame: the body's
// length (4 bytes, little-endian), then the body. A request body is an Op
// byte and its arguments, a reply body a Status byte and the result. Inside
// a body: a string is its length (4 bytes) and its raw bytes, an integer 8
// bytes two's complement, an optional string a presence byte (0/1) and then
// the string, a list its count (4 bytes) and its strings; all little-endian.
//
//   op            arguments                          result (kOk)
//   kHello        secret                             -
//   kSet          key, value                         -
//   kGet          key                                optional value
//   kWait         keys, timeout ms                   keys still missing (empty: all there)
//   kAdd          key, delta                         new value
//   kCompareSet   key, optional expected, desired    optional value after
//   kRemove       key                                presence byte: existed
//
// kRejected carries a message instead. The server then closes the
// connection when the request itself was malformed, and keeps it when only
// the operation failed (add on a value that is not an integer).
//
// The first request of a connection must be kHello with the server's
// secret; any other request first, or a wrong secret, is kRejected and the
// connection closed. Until the hello, a frame may be at most kMaxHelloBytes,
// so that a stranger cannot make the server allocate the full message limit.
// ---------------------------------------------------------------------------

enum class Op : uint8_t { kSet = 1, kGet, kWait, kAdd, kCompareSet, kRemove, kHello };
enum class Status : uint8_t { kOk = 0, kRejected = 1 };

constexpr size_t kLengthBytes = 4;
using LengthPrefix = std::array<unsigned char, kLengthBytes>;

// Room for a hello (op, length, secret) and a wrong secret a little longer.
constexpr size_t kMaxHelloBytes = 1024;

// Timeouts are capped here so that now + timeout never overflows the clock.
constexpr milliseconds kMaxTimeout = std::chrono::hours(24 * 365);

// A message that breaks the protocol: truncated, trailing bytes, unknown op.
class ProtocolError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

uint32_t frame_length(const LengthPrefix& prefix) {
  uint32_t length = 0;
  for (size_t i = 0; i < kLengthBytes; ++i) length |= uint32_t{prefix[i]} << (8 * i);
  return length;
}

class Encoder {
 public:
  explicit Encoder(Op op) : Encoder(static_cast<uint8_t>(op)) {}
  explicit Encoder(Status status) : Encoder(static_cast<uint8_t>(status)) {}

  Encoder& u8(uint8_t v) {
    frame_.push_back(static_cast<char>(v));
    return *this;
  }
  Encoder& i64(int64_t v) {
    auto bits = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) u8(static_cast<uint8_t>(bits >> (8 * i)));
    return *this;
  }
  Encoder& bytes(std::string_view v) {
    u32(static_cast<uint32_t>(v.size()));
    frame_.append(v);
    return *this;
  }
  Encoder& optional_bytes(const std::string* v) {
    u8(v != nullptr ? 1 : 0);
    if (v != nullptr) bytes(*v);
    return *this;
  }
  Encoder& list(const std::vector<std::string>& v) {
    u32(static_cast<uint32_t>(v.size()));
    for (const std::string& s : v) bytes(s);
    return *this;
  }

  size_t body_size() const { return frame_.size() - kLengthBytes; }
  // The finished frame: the body behind its length.
  std::string take() && {
    auto length = static_cast<uint32_t>(body_size());
    for (size_t i = 0; i < kLengthBytes; ++i) frame_[i] = static_cast<char>((length >> (8 * i)) & 0xff);
    return std::move(frame_);
  }

 private:
  explicit Encoder(uint8_t tag) : frame_(kLengthBytes, '\0') { u8(tag); }

  void u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) u8(static_cast<uint8_t>(v >> (8 * i)));
  }

  std::string frame_;
};

// Reads a body; every read checks the bounds, so a hostile or truncated
// message raises ProtocolError rather than reading past the end.
class Decoder {
 public:
  explicit Decoder(std::string body) : body_(std::move(body)) {}

  uint8_t u8() { return static_cast<uint8_t>(take(1)[0]); }
  int64_t i64() {
    std::string_view raw = take(8);
    uint64_t bits = 0;
    for (size_t i = 0; i < 8; ++i) bits |= uint64_t{static_cast<unsigned char>(raw[i])} << (8 * i);
    return static_cast<int64_t>(bits);
  }
  std::string bytes() { return std::string(take(u32())); }
  std::optional<std::string> optional_bytes() {
    switch (u8()) {
      case 0: return std::nullopt;
      case 1: return bytes();
      default: throw ProtocolError("bad presence byte");
    }
  }
  std::vector<std::string> list() {
    uint32_t count = u32();
    // Each string needs at least its length: a count the body cannot hold is
    // rejected before it sizes anything.
    if (count > (body_.size() - pos_) / kLengthBytes) throw ProtocolError("list count exceeds the message");
    std::vector<std::string> out;
    out.reserve(count);
    for (uint32_t i = 0; i < count; ++i) out.push_back(bytes());
    return out;
  }
  void finish() const {
    if (pos_ != body_.size()) throw ProtocolError(fmt::format("{} unexpected trailing bytes", body_.size() - pos_));
  }

 private:
  uint32_t u32() {
    std::string_view raw = take(4);
    uint32_t v = 0;
    for (size_t i = 0; i < 4; ++i) v |= uint32_t{static_cast<unsigned char>(raw[i])} << (8 * i);
    return v;
  }
  std::string_view take(size_t n) {
    if (n > body_.size() - pos_) throw ProtocolError("message truncated");
    std::string_view out(body_.data() + pos_, n);
    pos_ += n;
    return out;
  }

  std::string body_;
  size_t pos_ = 0;
};

// ---------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------

// An operation the server refuses while the request itself was well formed.
class Rejected : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Compared without stopping at the first difference, so that the time a
// refusal takes does not tell how much of a guess was right.
bool same_secret(std::string_view presented, std::string_view secret) {
  if (presented.size() != secret.size()) return false;
  volatile unsigned char difference = 0;
  for (size_t i = 0; i < secret.size(); ++i) {
    difference = difference | static_cast<unsigned char>(presented[i] ^ secret[i]);
  }
  return difference == 0;
}

class Session;

// The key-value map and the waits parked on it. Only the server thread
// touches it, which is what makes add and compare_set atomic.
class ServerState {
 public:
  const std::string* find(const std::string& key) const {
    auto it = values_.find(key);
    return it == values_.end() ? nullptr : &it->second;
  }
  void set(const std::string& key, std::string value);
  int64_t add(const std::string& key, int64_t delta);
  std::optional<std::string> compare_set(const std::string& key, const std::optional<std::string>& expected,
                                         std::string desired);
  bool remove(const std::string& key) { return values_.erase(key) > 0; }

  const std::string* first_missing(const std::vector<std::string>& keys) const {
    for (const std::string& key : keys) {
      if (!values_.contains(key)) return &key;
    }
    return nullptr;
  }
  std::vector<std::string> missing(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    for (const std::string& key : keys) {
      if (!values_.contains(key)) out.push_back(key);
    }
    return out;
  }

  // A waiting session is filed under one key it misses and looked at again
  // only when that key appears, so a set costs nothing for unrelated waits.
  void park(const std::string& key, std::shared_ptr<Session> session) { parked_[key].push_back(std::move(session)); }
  void unpark(const std::string& key, const Session* session);

 private:
  std::unordered_map<std::string, std::string> values_;
  std::unordered_map<std::string, std::vector<std::shared_ptr<Session>>> parked_;
};

// One client connection. It serves one request at a time (the client waits
// for each reply), so a session is a loop: read a frame, handle it, write the
// reply, unless the request is a wait that must be parked first.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, ServerState& state, const std::string& secret)
      : socket_(std::move(socket)), state_(state), secret_(secret), wait_timer_(socket_.get_executor()) {
    error_code ec;
    socket_.set_option(tcp::no_delay(true), ec);
    tcp::endpoint remote = socket_.remote_endpoint(ec);
    peer_ = ec ? "unknown peer" : fmt::format("{}:{}", remote.address().to_string(), remote.port());
  }

  void start() {
    store_log().debug("client {} connected", peer_);
    read_header();
  }

  // The key this session's wait was parked under has appeared.
  void recheck_wait() {
    if (const std::string* missing = state_.first_missing(wait_keys_)) {
      parked_on_ = *missing;
      state_.park(parked_on_, shared_from_this());
    } else {
      finish_wait();
    }
  }

 private:
  void read_header() {
    asio::async_read(socket_, asio::buffer(header_), [self = shared_from_this()](const error_code& ec, size_t) {
      if (ec) {
        self->close(ec == asio::error::eof ? "disconnected" : "connection failed: " + ec.message());
        return;
      }
      self->on_header();
    });
  }

  void on_header() {
    uint32_t length = frame_length(header_);
    if (!authenticated_ && length > kMaxHelloBytes) {
      reject_and_close(fmt::format("refused: a first message of {} bytes cannot be the hello with the store secret",
                                   length));
      return;
    }
    if (length > kMaxStoreMessageBytes) {
      reject_and_close(fmt::format("a message of {} bytes exceeds the store's limit of {} bytes", length,
                                   kMaxStoreMessageBytes));
      return;
    }
    try {
      body_.resize(length);
    } catch (const std::bad_alloc&) {
      reject_and_close(fmt::format("no memory for a message of {} bytes", length));
      return;
    }
    asio::async_read(socket_, asio::buffer(body_), [self = shared_from_this()](const error_code& ec, size_t) {
      if (ec) {
        self->close("disconnected in the middle of a request");
        return;
      }
      self->on_body();
    });
  }

  void on_body() {
    try {
      Decoder request(std::move(body_));
      if (authenticated_) {
        handle(request);
      } else {
        authenticate(request);
      }
    } catch (const ProtocolError& e) {
      reject_and_close(fmt::format("malformed request: {}", e.what()));
    } catch (const Rejected& e) {
      send(std::move(Encoder(Status::kRejected).bytes(e.what())));
    } catch (const std::exception& e) {
      store_log().error("store request from {} failed: {}; dropping the connection", peer_, e.what());
      close("request failed");
    }
  }

  // Nothing but the hello is read or answered before the secret is known
  // to be right.
  void authenticate(Decoder& request) {
    if (static_cast<Op>(request.u8()) != Op::kHello) {
      reject_and_close("refused: the first message must be the hello with the store secret");
      return;
    }
    std::string presented = request.bytes();
    request.finish();
    if (!same_secret(presented, secret_)) {
      reject_and_close("refused: wrong store secret; a client must present the secret of the keeld (or launcher) "
                       "serving this store");
      return;
    }
    authenticated_ = true;
    send(Encoder(Status::kOk));
  }

  void handle(Decoder& request) {
    auto op = static_cast<Op>(request.u8());
    switch (op) {
      case Op::kHello: throw ProtocolError("a second hello");
      case Op::kSet: {
        std::string key = request.bytes();
        std::string value = request.bytes();
        request.finish();
        state_.set(key, std::move(value));
        send(Encoder(Status::kOk));
        return;
      }
      case Op::kGet: {
        std::string key = request.bytes();
        request.finish();
        send(std::move(Encoder(Status::kOk).optional_bytes(state_.find(key))));
        return;
      }
      case Op::kWait: {
        std::vector<std::string> keys = request.list();
        milliseconds timeout(std::clamp<int64_t>(request.i64(), 0, kMaxTimeout.count()));
        request.finish();
        start_wait(std::move(keys), timeout);
        return;
      }
      case Op::kAdd: {
        std::string key = request.bytes();
        int64_t delta = request.i64();
        request.finish();
        send(std::move(Encoder(Status::kOk).i64(state_.add(key, delta))));
        return;
      }
      case Op::kCompareSet: {
        std::string key = request.bytes();
        std::optional<std::string> expected = request.optional_bytes();
        std::string desired = request.bytes();
        request.finish();
        std::optional<std::string> after = state_.compare_set(key, expected, std::move(desired));
        send(std::move(Encoder(Status::kOk).optional_bytes(after ? &*after : nullptr)));
        return;
      }
      case Op::kRemove: {
        std::string key = request.bytes();
        request.finish();
        send(std::move(Encoder(Status::kOk).u8(state_.remove(key) ? 1 : 0)));
        return;
      }
    }
    throw ProtocolError(fmt::format("unknown operation {}", static_cast<int>(op)));
  }

  void start_wait(std::vector<std::string> keys, milliseconds timeout) {
    wait_keys_ = std::move(keys);
    const std::string* missing = state_.first_missing(wait_keys_);
    if (missing == nullptr || timeout.count() == 0) {
      send(std::move(Encoder(Status::kOk).list(state_.missing(wait_keys_))));
      return;
    }
    waiting_ = true;
    uint64_t id = ++wait_id_;
    parked_on_ = *missing;
    state_.park(parked_on_, shared_from_this());
    // Handlers of an earlier wait can still be queued after it ended: the id
    // tells them apart from the current one.
    wait_timer_.expires_after(timeout);
    wait_timer_.async_wait([self = shared_from_this(), id](const error_code& ec) {
      if (ec || !self->is_waiting(id)) return;
      self->state_.unpark(self->parked_on_, self.get());
      self->finish_wait();
    });
    // The client sends nothing while it waits, so the socket turning
    // readable means it left (or broke the protocol): stop waiting for it
    // instead of holding the wait until its timeout.
    socket_.async_wait(tcp::socket::wait_read, [self = shared_from_this(), id](const error_code& ec) {
      if (ec == asio::error::operation_aborted || !self->is_waiting(id)) return;
      self->state_.unpark(self->parked_on_, self.get());
      self->waiting_ = false;
      self->wait_timer_.cancel();
      self->close("left while waiting");
    });
  }

  bool is_waiting(uint64_t id) const { return waiting_ && wait_id_ == id; }

  // Replies to the wait with whatever keys are still missing (none when it
  // completed, some when it timed out).
  void finish_wait() {
    waiting_ = false;
    wait_timer_.cancel();
    error_code ignored;
    socket_.cancel(ignored);  // ends the readiness watch
    send(std::move(Encoder(Status::kOk).list(state_.missing(wait_keys_))));
  }

  void send(Encoder&& reply) {
    out_ = std::move(reply).take();
    asio::async_write(socket_, asio::buffer(out_), [self = shared_from_this()](const error_code& ec, size_t) {
      if (ec) {
        self->close("disconnected before its reply: " + ec.message());
        return;
      }
      self->read_header();
    });
  }

  // Tells the client why (it may be a keel client with a bug, which then
  // reports the reason) and drops the connection: after a bad frame the
  // byte stream cannot be trusted.
  void reject_and_close(const std::string& why) {
    store_log().warn("dropping store client {}: {}", peer_, why);
    out_ = std::move(Encoder(Status::kRejected).bytes(why)).take();
    asio::async_write(socket_, asio::buffer(out_),
                      [self = shared_from_this()](const error_code&, size_t) { self->close("rejected"); });
  }

  void close(const std::string& why) {
    store_log().debug("client {} {}", peer_, why);
    error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

  tcp::socket socket_;
  ServerState& state_;
  const std::string& secret_;
  bool authenticated_ = false;
  std::string peer_;
  LengthPrefix header_{};
  std::string body_;
  std::string out_;
  // The wait in progress: its keys, the key it is parked under, its timer.
  bool waiting_ = false;
  uint64_t wait_id_ = 0;
  std::vector<std::string> wait_keys_;
  std::string parked_on_;
  asio::steady_timer wait_timer_;
};

void ServerState::set(const std::string& key, std::string value) {
  values_[key] = std::move(value);
  auto it = parked_.find(key);
  if (it == parked_.end()) return;
  // Detached first: a woken session may park again (under another key).
  std::vector<std::shared_ptr<Session>> woken = std::move(it->second);
  parked_.erase(it);
  for (const std::shared_ptr<Session>& session : woken) session->recheck_wait();
}

int64_t ServerState::add(const std::string& key, int64_t delta) {
  int64_t current = 0;
  if (const std::string* text = find(key)) {
    const char* end = text->data() + text->size();
    auto [parsed_to, ec] = std::from_chars(text->data(), end, current);
    if (ec != std::errc() || parsed_to != end) {
      throw Rejected(fmt::format("add to key {}: its value is not an integer; use add only on counters "
                                 "(keys written by add)",
                                 quoted(key)));
    }
  }
  int64_t result = 0;
  if (__builtin_add_overflow(current, delta, &result)) {
    throw Rejected(fmt::format("add of {} to key {} (now {}) overflows a 64-bit integer", delta, quoted(key), current));
  }
  set(key, std::to_string(result));
  return result;
}

std::optional<std::string> ServerState::compare_set(const std::string& key, const std::optional<std::string>& expected,
                                                    std::string desired) {
  const std::string* current = find(key);
  bool matches = current == nullptr ? !expected.has_value() : expected.has_value() && *expected == *current;
  if (matches) {
    set(key, desired);
    return desired;
  }
  if (current == nullptr) return std::nullopt;
  return *current;
}

void ServerState::unpark(const std::string& key, const Session* session) {
  auto it = parked_.find(key);
  if (it == parked_.end()) return;
  std::erase_if(it->second, [session](const std::shared_ptr<Session>& s) { return s.get() == session; });
  if (it->second.empty()) parked_.erase(it);
}

}  // namespace

std::string new_store_secret() {
  std::array<unsigned char, kStoreSecretBytes> random{};
  size_t filled = 0;
  while (filled < random.size()) {
    ssize_t n = getrandom(random.data() + filled, random.size() - filled, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      throw Error(ErrorCode::kInternal, fmt::format("cannot draw a store secret from getrandom: {}",
                                                    std::strerror(errno)));
    }
    filled += static_cast<size_t>(n);
  }
  std::string secret;
  for (unsigned char byte : random) secret += fmt::format("{:02x}", byte);
  return secret;
}

std::string store_secret_problem(std::string_view secret) {
  if (secret.size() != 2 * kStoreSecretBytes) {
    return fmt::format("it has {} characters where a store secret has {} hex digits", secret.size(),
                       2 * kStoreSecretBytes);
  }
  if (secret.find_first_not_of("0123456789abcdef") != std::string_view::npos) {
    return "it has characters other than lowercase hex digits";
  }
  return {};
}

class StoreServer::Impl {
 public:
  Impl(std::string secret, uint16_t port) : secret_(std::move(secret)) {
    if (std::string problem = store_secret_problem(secret_); !problem.empty()) {
      throw Error(ErrorCode::kInternal, fmt::format("the store was given a bad secret ({}): make one with "
                                                    "new_store_secret()",
                                                    problem));
    }
    tcp::endpoint endpoint(asio::ip::address_v4::loopback(), port);
    error_code ec;
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      throw Error(ErrorCode::kBadConfig, fmt::format("the store cannot listen on 127.0.0.1:{} ({}): choose a free "
                                                     "port, or 0 to let the system pick one",
                                                     port, ec.message()));
    }
    port_ = acceptor_.local_endpoint().port();
    accept();
    thread_ = common::named_thread("keel-store", [this] { run(); });
  }

  ~Impl() {
    io_.stop();
    thread_.join();
  }

  uint16_t port() const { return port_; }

 private:
  void run() {
    // Every handler catches what a request can raise; whatever still escapes
    // (memory exhaustion) must not end keeld, which hosts this server.
    for (;;) {
      try {
        io_.run();
        return;
      } catch (const std::exception& e) {
        store_log().error("store server handler failed: {}; serving on", e.what());
      }
    }
  }

  void accept() {
    acceptor_.async_accept([this](const error_code& ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted) return;
      if (ec) {
        // Typically out of file descriptors: retrying at once would spin.
        store_log().warn("store server cannot accept a connection ({}); retrying in 100 ms", ec.message());
        accept_retry_.expires_after(milliseconds(100));
        accept_retry_.async_wait([this](const error_code& timer_ec) {
          if (!timer_ec) accept();
        });
        return;
      }
      std::make_shared<Session>(std::move(socket), state_, secret_)->start();
      accept();
    });
  }

  // Declared first so that it is destroyed last: sessions still queued in its
  // handlers own sockets that belong to it.
  asio::io_context io_;
  tcp::acceptor acceptor_{io_};
  asio::steady_timer accept_retry_{io_};
  ServerState state_;
  std::string secret_;
  uint16_t port_ = 0;
  std::thread thread_;
};

StoreServer::StoreServer(std::string secret, uint16_t port)
    : impl_(std::make_unique<Impl>(std::move(secret), port)), port_(impl_->port()) {
  store_log().info("store serving on {}", address());
}

StoreServer::~StoreServer() = default;

std::string StoreServer::address() const { return fmt::format("tcp://127.0.0.1:{}", port_); }

// ---------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------

// Blocking calls with deadlines, done the Asio way: start the asynchronous
// operation, run this client's own io_context until it completes or the
// deadline passes, and close the socket if it did not.
class TcpStore::Impl {
 public:
  Impl(const std::string& host, uint16_t port, const std::string& secret, milliseconds timeout)
      : where_(fmt::format("{}:{}", host, port)), timeout_(std::clamp(timeout, milliseconds(0), kMaxTimeout)) {
    if (std::string problem = store_secret_problem(secret); !problem.empty()) {
      throw Error(ErrorCode::kBadConfig, fmt::format("bad store secret: {}; KEEL_STORE_SECRET must be the secret "
                                                     "keeld (or the launcher serving the store) passed on",
                                                     problem));
    }
    connect(host, port);
    hello(secret);
  }

  milliseconds timeout() const { return timeout_; }

  // One request and its reply. `decode` reads the result from a kOk reply;
  // a rejection is Error(`rejected`).
  template <typename Decode>
  auto call(Encoder&& request, milliseconds budget, const std::string& what, Decode decode,
            ErrorCode rejected = ErrorCode::kInternal) {
    if (request.body_size() > kMaxStoreMessageBytes) {
      throw Error(ErrorCode::kInternal,
                  fmt::format("store {} needs a message of {} bytes, above the store's limit of {} bytes: the store "
                              "carries rendezvous data, not bulk data",
                              what, request.body_size(), kMaxStoreMessageBytes));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (!broken_.empty()) {
      throw Error(ErrorCode::kPeerFailure,
                  fmt::format("store {} not attempted: an earlier call failed ({}); this process has lost its store "
                              "and should exit",
                              what, broken_));
    }
    Decoder reply(exchange(std::move(request).take(), Clock::now() + budget, what));
    try {
      if (static_cast<Status>(reply.u8()) != Status::kOk) {
        throw Error(rejected, fmt::format("the store rejected {}: {}", what, reply.bytes()));
      }
      if constexpr (std::is_void_v<std::invoke_result_t<Decode, Decoder&>>) {
        decode(reply);
        reply.finish();
      } else {
        auto result = decode(reply);
        reply.finish();
        return result;
      }
    } catch (const ProtocolError& e) {
      fail(fmt::format("the store at {} sent a malformed reply to {} ({}): does KEEL_STORE name a keel store?", where_,
                       what, e.what()));
    }
  }

 private:
  // The server answers nothing else until the secret is presented.
  void hello(const std::string& secret) {
    call(std::move(Encoder(Op::kHello).bytes(secret)), timeout_,
         "the hello with this process's secret (KEEL_STORE_SECRET)", [](Decoder&) {}, ErrorCode::kBadConfig);
  }

  void connect(const std::string& host, uint16_t port) {
    Clock::time_point deadline = Clock::now() + timeout_;
    tcp::resolver resolver(io_);
    milliseconds backoff(10);
    int attempts = 0;
    std::string last_error;
    for (;;) {
      ++attempts;
      error_code ec;
      tcp::resolver::results_type endpoints = resolver.resolve(host, std::to_string(port), ec);
      if (!ec) {
        asio::async_connect(socket_, endpoints, [&ec](const error_code& e, const tcp::endpoint&) { ec = e; });
        if (!run_until(deadline)) ec = asio::error::timed_out;
      }
      if (!ec) break;
      error_code ignored;
      socket_.close(ignored);
      // An attempt cut short by the deadline says less than the failure
      // before it ("connection refused": nobody listens there).
      if (ec != asio::error::timed_out || last_error.empty()) last_error = ec.message();
      Clock::duration remaining = deadline - Clock::now();
      if (remaining <= Clock::duration::zero()) {
        throw Error(ErrorCode::kPeerFailure,
                    fmt::format("cannot reach the store at {} within {} ms ({} attempts, last: {}): check that keeld "
                                "(or the launcher serving the store) is running and that KEEL_STORE names it",
                                where_, timeout_.count(), attempts, last_error));
      }
      // The server may simply not be up yet (ranks can start first): retry,
      // backing off so that many waiting ranks do not hammer the host.
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, remaining));
      backoff = std::min(backoff * 2, milliseconds(500));
    }
    error_code ignored;
    socket_.set_option(tcp::no_delay(true), ignored);
    store_log().debug("connected to the store at {} after {} attempt(s)", where_, attempts);
  }

  // Runs the pending operations until they finish (true) or the deadline
  // passes (false; the socket is then closed and the operations aborted).
  bool run_until(Clock::time_point deadline) {
    io_.restart();
    io_.run_until(deadline);
    if (io_.stopped()) return true;
    error_code ignored;
    socket_.close(ignored);
    io_.restart();
    io_.run();
    return false;
  }

  std::string exchange(std::string frame, Clock::time_point deadline, const std::string& what) {
    error_code ec;
    bool oversized = false;
    LengthPrefix header{};
    std::string body;
    // One chain of handlers, so that one deadline bounds the whole exchange.
    asio::async_write(socket_, asio::buffer(frame), [&](const error_code& write_ec, size_t) {
      if (write_ec) {
        ec = write_ec;
        return;
      }
      asio::async_read(socket_, asio::buffer(header), [&](const error_code& header_ec, size_t) {
        if (header_ec) {
          ec = header_ec;
          return;
        }
        uint32_t length = frame_length(header);
        if (length > kMaxStoreMessageBytes) {
          oversized = true;
          return;
        }
        body.resize(length);
        asio::async_read(socket_, asio::buffer(body), [&](const error_code& body_ec, size_t) { ec = body_ec; });
      });
    });
    if (!run_until(deadline)) {
      fail(fmt::format("the store at {} did not answer {} in time: its host (keeld or the test launcher) is hung or "
                       "overloaded; restart the job",
                       where_, what));
    }
    if (oversized) {
      fail(fmt::format("the store at {} sent an oversized reply to {}: does KEEL_STORE name a keel store?", where_,
                       what));
    }
    if (ec) {
      fail(fmt::format("lost the connection to the store at {} during {} ({}): its host (keeld or the test "
                       "launcher) has probably exited; restart the job",
                       where_, what, ec.message()));
    }
    return body;
  }

  // The connection is no longer in a known state (a reply may still be on
  // its way): later calls fail too rather than read a stale reply.
  [[noreturn]] void fail(const std::string& message) {
    broken_ = message;
    error_code ignored;
    socket_.close(ignored);
    throw Error(ErrorCode::kPeerFailure, message);
  }

  std::string where_;
  milliseconds timeout_;
  std::mutex mutex_;
  asio::io_context io_;
  tcp::socket socket_{io_};
  std::string broken_;  // why the connection failed; empty while it works
};

TcpStore::TcpStore(const std::string& host, uint16_t port, const std::string& secret, milliseconds timeout)
    : impl_(std::make_unique<Impl>(host, port, secret, timeout)) {}

TcpStore::~TcpStore() = default;

void TcpStore::set(const std::string& key, const std::string& value) {
  impl_->call(std::move(Encoder(Op::kSet).bytes(key).bytes(value)), impl_->timeout(), "set of key " + quoted(key),
              [](Decoder&) {});
}

std::optional<std::string> TcpStore::get(const std::string& key) {
  return impl_->call(std::move(Encoder(Op::kGet).bytes(key)), impl_->timeout(), "get of key " + quoted(key),
                     [](Decoder& reply) { return reply.optional_bytes(); });
}

void TcpStore::wait(const std::vector<std::string>& keys, milliseconds timeout) {
  milliseconds bounded = std::clamp(timeout, milliseconds(0), kMaxTimeout);
  // The server times the wait; the client allows it one call timeout more
  // to hear the answer before it calls the server unresponsive.
  std::vector<std::string> missing =
      impl_->call(std::move(Encoder(Op::kWait).list(keys).i64(bounded.count())), bounded + impl_->timeout(),
                  "wait for " + quoted(keys), [](Decoder& reply) { return reply.list(); });
  if (!missing.empty()) {
    throw Error(ErrorCode::kPeerFailure,
                fmt::format("store wait timed out after {} ms; still missing: {}. The ranks (or keeld) that set them "
                            "have not arrived: check that every rank of the job started, and read their logs",
                            bounded.count(), quoted(missing)));
  }
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  return impl_->call(std::move(Encoder(Op::kAdd).bytes(key).i64(delta)), impl_->timeout(), "add to key " + quoted(key),
                     [](Decoder& reply) { return reply.i64(); });
}

std::optional<std::string> TcpStore::compare_set(const std::string& key, const std::optional<std::string>& expected,
                                                 const std::string& desired) {
  Encoder request(Op::kCompareSet);
  request.bytes(key).optional_bytes(expected ? &*expected : nullptr).bytes(desired);
  return impl_->call(std::move(request), impl_->timeout(), "compare_set of key " + quoted(key),
                     [](Decoder& reply) { return reply.optional_bytes(); });
}

bool TcpStore::remove(const std::string& key) {
  return impl_->call(std::move(Encoder(Op::kRemove).bytes(key)), impl_->timeout(), "remove of key " + quoted(key),
                     [](Decoder& reply) { return reply.u8() != 0; });
}

}  // namespace keel::store
