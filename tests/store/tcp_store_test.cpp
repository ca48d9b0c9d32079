#include "common/clock.h"
#include "common/error.h"
#include "store/tcp_store.h"
#include "tests/support/free_ports.h"

#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <latch>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

using keel::store::connect_store;
using keel::common::Error;
using keel::common::ErrorCode;
using keel::store::kMaxStoreMessageBytes;
using keel::store::new_store_secret;
using keel::store::Store;
using keel::store::StoreServer;
using keel::store::TcpStore;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

namespace {

// Made before main, so that forked children share it with their parent.
const std::string kSecret = new_store_secret();

using keel::common::seconds_since;

// The keel Error a call raises, or nullopt when it returns normally.
template <typename F>
std::optional<Error> error_from(F&& call) {
  try {
    call();
  } catch (const Error& e) {
    return e;
  }
  return std::nullopt;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string store_address(uint16_t port) { return "tcp://127.0.0.1:" + std::to_string(port); }

// A file descriptor closed when it goes away.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) { REQUIRE(fd_ >= 0); }
  ~Fd() { close(fd_); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

sockaddr_in loopback(uint16_t port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  return addr;
}

uint16_t bound_port(int fd) {
  sockaddr_in addr{};
  socklen_t size = sizeof(addr);
  REQUIRE(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &size) == 0);
  return ntohs(addr.sin_port);
}

// A raw connection for speaking to the server outside the protocol.
int raw_connect(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = loopback(port);
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  return fd;
}

void send_all(int fd, const std::string& bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    REQUIRE(n > 0);
    sent += static_cast<size_t>(n);
  }
}

struct Received {
  std::string bytes;
  bool closed = false;  // the server closed (or reset) the connection
};

// Reads until the server closes the connection or the timeout passes.
Received read_until_closed(int fd, std::chrono::milliseconds timeout) {
  Received out;
  auto deadline = Clock::now() + timeout;
  char buffer[4096];
  while (Clock::now() < deadline) {
    pollfd pfd{fd, POLLIN, 0};
    if (poll(&pfd, 1, 50) <= 0) continue;
    ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) {
      out.closed = true;
      break;
    }
    out.bytes.append(buffer, static_cast<size_t>(n));
  }
  return out;
}

// The protocol's little-endian integers.
std::string le(uint64_t v, int size) {
  std::string out;
  for (int i = 0; i < size; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return out;
}
std::string le32(uint32_t v) { return le(v, 4); }
std::string i64(int64_t v) { return le(static_cast<uint64_t>(v), 8); }

// A string inside a body: its length, then its bytes.
std::string bytes(const std::string& s) { return le32(static_cast<uint32_t>(s.size())) + s; }

// A frame as the protocol lays it out: little-endian body length, body.
std::string frame(const std::string& body) { return bytes(body); }

std::string hello(const std::string& secret) {
  // Built by append: GCC 12 warns falsely (-Wrestrict) on "\x07" + bytes(secret).
  std::string body(1, '\x07');
  body += bytes(secret);
  return frame(body);
}

// A raw connection that has presented the secret, for breaking the
// protocol past the hello.
int hello_connect(uint16_t port) {
  int fd = raw_connect(port);
  send_all(fd, hello(kSecret));
  const std::string ok = frame(std::string(1, '\0'));
  std::string reply(ok.size(), 'x');
  REQUIRE(recv(fd, reply.data(), reply.size(), MSG_WAITALL) == static_cast<ssize_t>(ok.size()));
  REQUIRE(reply == ok);
  return fd;
}

// Runs `body` in a forked child that exits with its result (99 when it
// throws). The caller must have no threads of its own running.
template <typename Body>
pid_t fork_child(Body body) {
  // Output still buffered would otherwise be printed by the child as well.
  std::fflush(nullptr);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int code = 99;
    try {
      code = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d failed: %s\n", getpid(), e.what());
    }
    _exit(code);
  }
  return pid;
}

// The child's exit status; -1 when it had to be killed after the timeout.
int wait_child(pid_t pid, std::chrono::seconds timeout) {
  auto deadline = Clock::now() + timeout;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (Clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(10ms);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// A pipe that hands a port from one process to another.
class PortPipe {
 public:
  PortPipe() { REQUIRE(pipe(fds_) == 0); }
  ~PortPipe() {
    for (int fd : fds_) {
      if (fd >= 0) close(fd);
    }
  }
  PortPipe(const PortPipe&) = delete;
  PortPipe& operator=(const PortPipe&) = delete;

  void send_port(uint16_t port) {
    close_end(0);
    REQUIRE(write(fds_[1], &port, sizeof(port)) == sizeof(port));
    close_end(1);
  }
  // 0 when the writer went away without sending.
  uint16_t receive_port() {
    close_end(1);
    uint16_t port = 0;
    pollfd pfd{fds_[0], POLLIN, 0};
    if (poll(&pfd, 1, 30000) <= 0 || read(fds_[0], &port, sizeof(port)) != sizeof(port)) return 0;
    return port;
  }

 private:
  void close_end(int end) {
    if (fds_[end] >= 0) close(fds_[end]);
    fds_[end] = -1;
  }
  int fds_[2] = {-1, -1};
};

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("set get and remove round trip binary values") {
    StoreServer server(kSecret);
    TcpStore store("127.0.0.1", server.port(), kSecret, 5s);

    std::string every_byte;
    for (int b = 0; b < 256; ++b) every_byte.push_back(static_cast<char>(b));
    std::string nuls("a\0b\0\0c", 6);
    std::string big(1 << 20, '\0');
    for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>((i * 2654435761u) >> 13);
    std::string binary_key("key\0with\xff", 9);

    store.set("every_byte", every_byte);
    store.set("nuls", nuls);
    store.set("big", big);
    store.set("empty", "");
    store.set(binary_key, "x");
    CHECK(store.get("every_byte") == every_byte);
    CHECK(store.get("nuls") == nuls);
    CHECK(store.get("big") == big);
    CHECK(store.get("empty") == std::string());
    CHECK(store.get(binary_key) == "x");

    store.set("nuls", "replaced");
    CHECK(store.get("nuls") == "replaced");

    CHECK(store.remove("big"));
    CHECK_FALSE(store.get("big").has_value());
    CHECK_FALSE(store.remove("big"));
  }

  TEST_CASE("get of a missing key is nullopt") {
    StoreServer server(kSecret);
    TcpStore store("127.0.0.1", server.port(), kSecret, 5s);
    CHECK_FALSE(store.get("never-set").has_value());
    CHECK_FALSE(store.remove("never-set"));
  }

  TEST_CASE("a value above the message limit is refused before it is sent") {
    StoreServer server(kSecret);
    TcpStore store("127.0.0.1", server.port(), kSecret, 5s);
    std::string huge(kMaxStoreMessageBytes + 1, 'x');
    auto error = error_from([&] { store.set("huge", huge); });
    REQUIRE(error.has_value());
    CHECK(error->code() == ErrorCode::kInternal);
    CHECK(contains(error->what(), "limit"));
    // Nothing went on the wire, so the connection still works.
    store.set("small", "ok");
    CHECK(store.get("small") == "ok");
  }

  TEST_CASE("wait returns as soon as the keys appear") {
    StoreServer server(kSecret);
    TcpStore waiter("127.0.0.1", server.port(), kSecret, 5s);
    TcpStore setter("127.0.0.1", server.port(), kSecret, 5s);
    auto start = Clock::now();
    std::thread late_setter([&] {
      std::this_thread::sleep_for(150ms);
      setter.set("first", "1");
      std::this_thread::sleep_for(150ms);
      setter.set("second", "2");
    });
    waiter.wait({"first", "second"}, 10s);
    double elapsed = seconds_since(start);
    late_setter.join();
    CHECK(elapsed >= 0.29);
    CHECK(elapsed < 9);  // well inside the 10 s it may wait: the keys ended it
  }

  TEST_CASE("wait on keys that exist returns at once") {
    StoreServer server(kSecret);
    TcpStore store("127.0.0.1", server.port(), kSecret, 5s);
    store.set("a", "1");
    auto start = Clock::now();
    store.wait({"a"}, 10s);
    store.wait({}, 10s);
    CHECK(seconds_since(start) < 5);
  }

  TEST_CASE("wait throws a peer failure naming the missing key after its timeout") {
    StoreServer server(kSecret);
    TcpStore store("127.0.0.1", server.port(), kSecret, 5s);
    store.set("present", "1");
    auto start = Clock::now();
    auto error = error_from([&] { store.wait({"present", "absent"}, 300ms); });
    double elapsed = seconds_since(start);
    REQUIRE(error.has_value());
    CHECK(error->code() == ErrorCode::kPeerFailure);
    CHECK(contains(error->what(), "'absent'"));
    CHECK_FALSE(contains(error->what(), "'present'"));
    CHECK(elapsed >= 0.29);
    CHECK(elapsed < 5);  // generous for a loaded machine; far below anything hung

    // A timed-out wait leaves the connection usable and nothing parked behind.
    store.set("absent", "now");
    CHECK(store.get("absent") == "now");
    auto zero = error_from([&] { store.wait({"still-absent"}, 0ms); });
    REQUIRE(zero.has_value());
    CHECK(zero->code() == ErrorCode::kPeerFailure);
  }

  TEST_CASE("a wait needs every key present at once") {
    StoreServer server(kSecret);
    TcpStore waiter("127.0.0.1", server.port(), kSecret, 5s);
    TcpStore other("127.0.0.1", server.port(), kSecret, 5s);
    std::atomic<bool> returned{false};
    std::thread waiting([&] {
      if (!error_from([&] { waiter.wait({"x", "y"}, 10s); })) returned = true;
    });
    std::this_thread::sleep_for(100ms);
    other.set("x", "1");
    std::this_thread::sleep_for(100ms);
    other.remove("x");
    other.set("y", "1");
    std::this_thread::sleep_for(200ms);
    CHECK_FALSE(returned.load());
    other.set("x", "again");
    waiting.join();
    CHECK(returned.load());
  }

  TEST_CASE("add from 8 concurrent clients gives exactly 8000") {
    StoreServer server(kSecret);
    constexpr int kClients = 8;
    constexpr int kAdds = 1000;
    std::vector<std::vector<int64_t>> seen(kClients);
    std::vector<std::string> failures(kClients);
    std::vector<std::thread> threads;
    for (int c = 0; c < kClients; ++c) {
      threads.emplace_back([&, c] {
        try {
          TcpStore store("127.0.0.1", server.port(), kSecret, 10s);
          for (int i = 0; i < kAdds; ++i) seen[c].push_back(store.add("counter", 1));
        } catch (const std::exception& e) {
          failures[c] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (const auto& f : failures) CHECK(f.empty());

    // Atomic adds hand out every value from 1 to 8000 exactly once.
    std::vector<int64_t> all;
    for (const auto& s : seen) all.insert(all.end(), s.begin(), s.end());
    std::sort(all.begin(), all.end());
    std::vector<int64_t> expected(kClients * kAdds);
    std::iota(expected.begin(), expected.end(), 1);
    CHECK(all == expected);

    TcpStore store("127.0.0.1", server.port(), kSecret, 5s);
    CHECK(store.get("counter") == "8000");
  }

  TEST_CASE("add starts from zero and takes negative deltas") {
    StoreServer server(kSecret);
    TcpStore store("127.0.0.1", server.port(), kSecret, 5s);
    CHECK(store.add("n", 5) == 5);
    CHECK(store.add("n", -7) == -2);
    CHECK(store.add("n", 0) == -2);
    CHECK(store.get("n") == "-2");
  }

  TEST_CASE("add on a value that is not an integer is rejected and the client carries on") {
    StoreServer server(kSecret);
    TcpStore store("127.0.0.1", server.port(), kSecret, 5s);
    store.set("text", "twelve");
    auto error = error_from([&] { store.add("text", 1); });
    REQUIRE(error.has_value());
    CHECK(error->code() == ErrorCode::kInternal);
    CHECK(contains(error->what(), "not an integer"));
    store.set("max", std::to_string(INT64_MAX));
    auto overflow = error_from([&] { store.add("max", 1); });
    REQUIRE(overflow.has_value());
    CHECK(contains(overflow->what(), "overflows"));
    CHECK(store.get("text") == "twelve");
    CHECK(store.add("fine", 1) == 1);
  }

  TEST_CASE("compare_set swaps only on a match and reports the value after") {
    StoreServer server(kSecret);
    TcpStore store("127.0.0.1", server.port(), kSecret, 5s);
    // Expected absent: creates the key.
    CHECK(store.compare_set("k", std::nullopt, "one") == "one");
    // Expected absent but present: unchanged, reports the current value.
    CHECK(store.compare_set("k", std::nullopt, "two") == "one");
    // Wrong expectation: unchanged.
    CHECK(store.compare_set("k", std::string("zero"), "two") == "one");
    // Right expectation: swapped.
    CHECK(store.compare_set("k", std::string("one"), "two") == "two");
    CHECK(store.get("k") == "two");
    // Expecting a value of a key that does not exist: stays absent.
    CHECK_FALSE(store.compare_set("missing", std::string("x"), "y").has_value());
    CHECK_FALSE(store.get("missing").has_value());
    // Binary expected values compare byte for byte.
    std::string id("\0\x01\x02", 3);
    CHECK(store.compare_set("id", std::nullopt, id) == id);
    CHECK(store.compare_set("id", std::string("\0\x01", 2), "other") == id);
    CHECK(store.compare_set("id", id, "other") == "other");
  }

  TEST_CASE("compare_set elects exactly one winner among concurrent contenders") {
    StoreServer server(kSecret);
    constexpr int kContenders = 8;
    constexpr int kRounds = 20;
    std::vector<std::unique_ptr<TcpStore>> stores;
    for (int c = 0; c < kContenders; ++c) stores.push_back(std::make_unique<TcpStore>("127.0.0.1", server.port(), kSecret, 10s));
    for (int round = 0; round < kRounds; ++round) {
      std::string key = "leader/" + std::to_string(round);
      std::vector<std::optional<std::string>> results(kContenders);
      std::latch go(kContenders);
      std::vector<std::thread> threads;
      for (int c = 0; c < kContenders; ++c) {
        threads.emplace_back([&, c] {
          go.arrive_and_wait();
          results[c] = stores[c]->compare_set(key, std::nullopt, "rank-" + std::to_string(c));
        });
      }
      for (auto& t : threads) t.join();
      int winners = 0;
      for (int c = 0; c < kContenders; ++c) {
        if (results[c] == "rank-" + std::to_string(c)) ++winners;
        CHECK(results[c] == results[0]);
      }
      CHECK(winners == 1);
    }
  }

  TEST_CASE("one client shared by many threads stays consistent") {
    StoreServer server(kSecret);
    TcpStore shared("127.0.0.1", server.port(), kSecret, 10s);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < 500; ++i) {
          shared.add("shared", 1);
          // Built by append: GCC 12 warns falsely (-Wrestrict) on "t" + to_string(t).
          std::string key(1, 't');
          key += std::to_string(t);
          shared.set(key, std::to_string(i));
          if (shared.get(key) != std::to_string(i)) shared.add("mismatches", 1);
        }
      });
    }
    for (auto& t : threads) t.join();
    CHECK(shared.get("shared") == "2000");
    CHECK_FALSE(shared.get("mismatches").has_value());
  }

  TEST_CASE("a client whose server is gone gets a peer failure without hanging") {
    auto server = std::make_unique<StoreServer>(kSecret);
    TcpStore store("127.0.0.1", server->port(), kSecret, 2s);
    store.set("k", "v");
    server.reset();
    auto start = Clock::now();
    auto error = error_from([&] { store.get("k"); });
    REQUIRE(error.has_value());
    CHECK(error->code() == ErrorCode::kPeerFailure);
    CHECK(seconds_since(start) < 10);  // not hung; the client timeout is 2 s per attempt
    // The connection stays failed: later calls say so at once.
    start = Clock::now();
    auto later = error_from([&] { store.set("k", "v"); });
    REQUIRE(later.has_value());
    CHECK(later->code() == ErrorCode::kPeerFailure);
    CHECK(contains(later->what(), "earlier"));
    CHECK(seconds_since(start) < 5);
  }

  TEST_CASE("a wait in flight when the server stops ends with a peer failure") {
    auto server = std::make_unique<StoreServer>(kSecret);
    TcpStore store("127.0.0.1", server->port(), kSecret, 2s);
    std::thread stopper([&] {
      std::this_thread::sleep_for(200ms);
      server.reset();
    });
    auto start = Clock::now();
    auto error = error_from([&] { store.wait({"never"}, 30s); });
    double elapsed = seconds_since(start);
    stopper.join();
    REQUIRE(error.has_value());
    CHECK(error->code() == ErrorCode::kPeerFailure);
    CHECK(elapsed < 15);  // not the 30 s wait
  }

  TEST_CASE("a server that stops answering yields a peer failure within the timeout") {
    // A listening socket nobody accepts from: the kernel completes the
    // handshake, so the client connects, but no reply ever comes.
    Fd silent(socket(AF_INET, SOCK_STREAM, 0));
    sockaddr_in addr = loopback(0);
    REQUIRE(bind(silent.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
    REQUIRE(listen(silent.get(), 4) == 0);
    auto start = Clock::now();
    // The hello on connecting is the first call left unanswered.
    auto error = error_from([&] { TcpStore store("127.0.0.1", bound_port(silent.get()), kSecret, 300ms); });
    double elapsed = seconds_since(start);
    REQUIRE(error.has_value());
    CHECK(error->code() == ErrorCode::kPeerFailure);
    CHECK(contains(error->what(), "did not answer"));
    CHECK(elapsed >= 0.29);
    CHECK(elapsed < 5);  // generous for a loaded machine; far below anything hung
  }

  TEST_CASE("a client that finds no server gives up within its timeout") {
    uint16_t port = static_cast<uint16_t>(keel::test::free_loopback_port());
    auto start = Clock::now();
    auto error = error_from([&] { TcpStore store("127.0.0.1", port, kSecret, 400ms); });
    double elapsed = seconds_since(start);
    REQUIRE(error.has_value());
    CHECK(error->code() == ErrorCode::kPeerFailure);
    CHECK(contains(error->what(), "cannot reach the store at 127.0.0.1:" + std::to_string(port)));
    CHECK(contains(error->what(), "refused"));
    CHECK(elapsed >= 0.39);
    CHECK(elapsed < 5);
  }

  TEST_CASE("the server survives garbage and oversized frames after the hello and keeps serving") {
    StoreServer server(kSecret);
    TcpStore good("127.0.0.1", server.port(), kSecret, 5s);
    good.set("before", "1");

    SUBCASE("text that is not the protocol") {
      Fd raw(hello_connect(server.port()));
      send_all(raw.get(), "GET / HTTP/1.1\r\nHost: store\r\n\r\n");
      CHECK(read_until_closed(raw.get(), 5s).closed);
    }
    SUBCASE("a frame above the size limit") {
      Fd raw(hello_connect(server.port()));
      send_all(raw.get(), le32(static_cast<uint32_t>(kMaxStoreMessageBytes + 1)));
      Received reply = read_until_closed(raw.get(), 5s);
      CHECK(reply.closed);
      CHECK(contains(reply.bytes, "exceeds the store's limit"));
    }
    SUBCASE("an unknown operation") {
      Fd raw(hello_connect(server.port()));
      send_all(raw.get(), frame("\x63"));
      Received reply = read_until_closed(raw.get(), 5s);
      CHECK(reply.closed);
      CHECK(contains(reply.bytes, "unknown operation 99"));
    }
    SUBCASE("an empty frame") {
      Fd raw(hello_connect(server.port()));
      send_all(raw.get(), frame(""));
      Received reply = read_until_closed(raw.get(), 5s);
      CHECK(reply.closed);
      CHECK(contains(reply.bytes, "truncated"));
    }
    SUBCASE("a string longer than its frame") {
      Fd raw(hello_connect(server.port()));
      send_all(raw.get(), frame(std::string("\x02", 1) + le32(1000) + "abc"));
      Received reply = read_until_closed(raw.get(), 5s);
      CHECK(reply.closed);
      CHECK(contains(reply.bytes, "truncated"));
    }
    SUBCASE("a wait listing more keys than its frame holds") {
      Fd raw(hello_connect(server.port()));
      send_all(raw.get(), frame(std::string("\x03", 1) + le32(0xffffffffu)));
      Received reply = read_until_closed(raw.get(), 5s);
      CHECK(reply.closed);
      CHECK(contains(reply.bytes, "list count"));
    }
    SUBCASE("a second hello") {
      Fd raw(hello_connect(server.port()));
      send_all(raw.get(), hello(kSecret));
      Received reply = read_until_closed(raw.get(), 5s);
      CHECK(reply.closed);
      CHECK(contains(reply.bytes, "a second hello"));
    }
    SUBCASE("a request with trailing bytes") {
      Fd raw(hello_connect(server.port()));
      send_all(raw.get(), frame(std::string("\x02", 1) + le32(1) + "k" + "junk"));
      Received reply = read_until_closed(raw.get(), 5s);
      CHECK(reply.closed);
      CHECK(contains(reply.bytes, "trailing"));
    }
    SUBCASE("a client that disconnects in the middle of a request") {
      {
        Fd raw(hello_connect(server.port()));
        send_all(raw.get(), le32(100) + "only ten..");
      }
      std::this_thread::sleep_for(50ms);
    }
    SUBCASE("a client that disconnects while its wait is parked") {
      {
        Fd raw(hello_connect(server.port()));
        std::string timeout_ms = std::string("\x60\xea\0\0\0\0\0\0", 8);  // 60000
        send_all(raw.get(), frame(std::string("\x03", 1) + le32(1) + le32(6) + "parked" + timeout_ms));
        std::this_thread::sleep_for(50ms);
      }
      std::this_thread::sleep_for(50ms);
      // Setting the key must not reply to the departed client.
      good.set("parked", "now");
    }

    CHECK(good.get("before") == "1");
    good.set("after", "2");
    CHECK(good.get("after") == "2");
    TcpStore fresh("127.0.0.1", server.port(), kSecret, 5s);
    CHECK(fresh.get("before") == "1");
  }

  TEST_CASE("a connection without the right secret can neither read nor write") {
    StoreServer server(kSecret);
    TcpStore owner("127.0.0.1", server.port(), kSecret, 5s);
    owner.set("resume/choice", "step_00000100");
    owner.add("failures", 1);
    const std::string key = bytes("resume/choice");
    const std::string forged = bytes("step_00000000");
    const std::string set = frame("\x01" + key + forged);
    const std::string last_digit_changed = kSecret.substr(0, kSecret.size() - 1) + (kSecret.back() == '0' ? "1" : "0");
    struct Row {
      const char* what;
      std::string sent;  // the first bytes of a fresh connection
      const char* says;
    };
    const Row rows[] = {
        {"set", set, "must be the hello"},
        {"get", frame("\x02" + key), "must be the hello"},
        {"wait", frame("\x03" + le32(1) + key + i64(0)), "must be the hello"},
        {"add", frame("\x04" + bytes("failures") + i64(1)), "must be the hello"},
        {"compare_set", frame(std::string("\x05", 1) + key + std::string("\0", 1) + forged), "must be the hello"},
        {"remove", frame("\x06" + key), "must be the hello"},
        {"a wrong secret then a set", hello(new_store_secret()) + set, "wrong store secret"},
        {"the secret with its last digit changed", hello(last_digit_changed) + set, "wrong store secret"},
        {"an empty secret then a set", hello("") + set, "wrong store secret"},
        {"the secret twice", hello(kSecret + kSecret) + set, "wrong store secret"},
        {"a hello cut short", frame("\x07" + le32(64) + "abc") + set, "truncated"},
        {"a first frame above the hello's size", le32(2048), "cannot be the hello"},
        {"text that is not the protocol", "GET / HTTP/1.1\r\nHost: store\r\n\r\n", "cannot be the hello"},
    };
    for (const Row& row : rows) {
      INFO(row.what);
      Fd raw(raw_connect(server.port()));
      send_all(raw.get(), row.sent);
      Received reply = read_until_closed(raw.get(), 5s);
      CHECK(reply.closed);
      CHECK(contains(reply.bytes, row.says));
      CHECK_FALSE(contains(reply.bytes, "step_00000100"));
    }
    CHECK(owner.get("resume/choice") == "step_00000100");
    CHECK(owner.get("failures") == "1");
  }

  TEST_CASE("a client with a wrong secret gets a config error and the store is unchanged") {
    StoreServer server(kSecret);
    TcpStore owner("127.0.0.1", server.port(), kSecret, 5s);
    owner.set("k", "v");
    auto error = error_from([&] { connect_store(server.address(), new_store_secret(), 5s); });
    REQUIRE(error.has_value());
    CHECK(error->code() == ErrorCode::kBadConfig);
    CHECK(contains(error->what(), "wrong store secret"));
    CHECK(contains(error->what(), "KEEL_STORE_SECRET"));
    CHECK(owner.get("k") == "v");
  }

  TEST_CASE("a malformed secret is a config error that never quotes it") {
    StoreServer server(kSecret);
    for (const std::string& secret : {std::string(), kSecret.substr(1), kSecret + "0", std::string(64, 'A'),
                                      std::string(63, '0') + "g", std::string(63, '0') + "\n"}) {
      CAPTURE(secret);
      auto error = error_from([&] { connect_store(server.address(), secret, 5s); });
      REQUIRE(error.has_value());
      CHECK(error->code() == ErrorCode::kBadConfig);
      CHECK(contains(error->what(), "KEEL_STORE_SECRET"));
      if (!secret.empty()) CHECK_FALSE(contains(error->what(), secret));
    }
    auto server_error = error_from([] { StoreServer weak("password"); });
    REQUIRE(server_error.has_value());
    CHECK(server_error->code() == ErrorCode::kInternal);
  }

  TEST_CASE("every new secret is 64 hex digits and differs from the others") {
    std::vector<std::string> secrets;
    for (int i = 0; i < 100; ++i) {
      secrets.push_back(new_store_secret());
      CHECK(keel::store::store_secret_problem(secrets.back()).empty());
    }
    std::sort(secrets.begin(), secrets.end());
    CHECK(std::unique(secrets.begin(), secrets.end()) == secrets.end());
  }

  TEST_CASE("connect_store rejects malformed addresses with a config error") {
    for (const std::string address :
         {"", "127.0.0.1:29500", "http://127.0.0.1:29500", "tcp://", "tcp://127.0.0.1", "tcp://:29500",
          "tcp://127.0.0.1:", "tcp://127.0.0.1:port", "tcp://127.0.0.1:0", "tcp://127.0.0.1:65536",
          "tcp://127.0.0.1:-1", "tcp://127.0.0.1:29500/x", "tcp://127.0.0.1: 29500"}) {
      CAPTURE(address);
      auto error = error_from([&] { connect_store(address, kSecret, 100ms); });
      REQUIRE(error.has_value());
      CHECK(error->code() == ErrorCode::kBadConfig);
      CHECK(contains(error->what(), "'" + address + "'"));
      CHECK(contains(error->what(), "tcp://HOST:PORT"));
    }
  }

  TEST_CASE("connect_store reaches a server by its address") {
    StoreServer server(kSecret);
    CHECK(server.address() == store_address(server.port()));
    std::unique_ptr<Store> store = connect_store(server.address(), kSecret, 5s);
    store->set("k", "v");
    std::unique_ptr<Store> by_name = connect_store("tcp://localhost:" + std::to_string(server.port()), kSecret, 5s);
    CHECK(by_name->get("k") == "v");
  }

  TEST_CASE("a server cannot take a port that is already served") {
    StoreServer first(kSecret);
    auto error = error_from([&] { StoreServer second(kSecret, first.port()); });
    REQUIRE(error.has_value());
    CHECK(error->code() == ErrorCode::kBadConfig);
    CHECK(contains(error->what(), std::to_string(first.port())));
  }

  TEST_CASE("a client started before the server connects once it appears") {
    uint16_t port = static_cast<uint16_t>(keel::test::free_loopback_port());
    std::unique_ptr<StoreServer> server;
    std::thread late_start([&] {
      std::this_thread::sleep_for(300ms);
      server = std::make_unique<StoreServer>(kSecret, port);
    });
    auto start = Clock::now();
    std::unique_ptr<Store> store = connect_store(store_address(port), kSecret, 10s);
    double elapsed = seconds_since(start);
    late_start.join();
    CHECK(elapsed >= 0.25);
    store->set("early", "bird");
    CHECK(store->get("early") == "bird");
  }
}

TEST_SUITE("integration") {
  TEST_CASE("ranks in separate processes count elect one leader and meet at a barrier") {
    constexpr int kRanks = 4;
    constexpr int kAdds = 200;
    // Children are forked before the server thread exists; they learn its
    // port through a pipe.
    std::vector<std::unique_ptr<PortPipe>> pipes;
    std::vector<pid_t> pids;
    for (int rank = 0; rank < kRanks; ++rank) {
      pipes.push_back(std::make_unique<PortPipe>());
      PortPipe& pipe = *pipes.back();
      pids.push_back(fork_child([&pipe, rank] {
        uint16_t port = pipe.receive_port();
        if (port == 0) return 90;
        std::unique_ptr<Store> store = connect_store(store_address(port), kSecret, 10s);
        for (int i = 0; i < kAdds; ++i) store->add("count", 1);
        std::string me = "rank-" + std::to_string(rank);
        bool leader = store->compare_set("leader", std::nullopt, me) == me;
        store->set("ready/" + std::to_string(rank), me);
        std::vector<std::string> everyone;
        for (int r = 0; r < kRanks; ++r) everyone.push_back("ready/" + std::to_string(r));
        store->wait(everyone, 20s);
        // Past the barrier every rank has finished its adds.
        if (store->get("count") != std::to_string(kRanks * kAdds)) return 91;
        return leader ? 1 : 0;
      }));
    }
    StoreServer server(kSecret);
    for (auto& pipe : pipes) pipe->send_port(server.port());

    int leaders = 0;
    int leader_rank = -1;
    for (int rank = 0; rank < kRanks; ++rank) {
      int status = wait_child(pids[rank], 60s);
      CAPTURE(rank);
      CHECK((status == 0 || status == 1));
      if (status == 1) {
        ++leaders;
        leader_rank = rank;
      }
    }
    CHECK(leaders == 1);
    TcpStore store("127.0.0.1", server.port(), kSecret, 5s);
    CHECK(store.get("count") == std::to_string(kRanks * kAdds));
    CHECK(store.get("leader") == "rank-" + std::to_string(leader_rank));
  }

  TEST_CASE("a rank waiting on a store process that is killed gets a peer failure at once") {
    PortPipe pipe;
    pid_t server_pid = fork_child([&pipe] {
      StoreServer server(kSecret);
      pipe.send_port(server.port());
      for (;;) pause();
      return 0;
    });
    uint16_t port = pipe.receive_port();
    REQUIRE(port != 0);
    TcpStore store("127.0.0.1", port, kSecret, 5s);
    store.set("k", "v");
    CHECK(store.get("k") == "v");

    std::thread killer([server_pid] {
      std::this_thread::sleep_for(300ms);
      kill(server_pid, SIGKILL);
    });
    auto start = Clock::now();
    auto error = error_from([&] { store.wait({"never"}, 30s); });
    double elapsed = seconds_since(start);
    killer.join();
    CHECK(wait_child(server_pid, 10s) == 128 + SIGKILL);
    REQUIRE(error.has_value());
    CHECK(error->code() == ErrorCode::kPeerFailure);
    CHECK(contains(error->what(), "lost the connection"));
    CHECK(elapsed < 15);  // not the 30 s wait
  }

  TEST_CASE("a rank started before the store process connects once it appears") {
    uint16_t port = static_cast<uint16_t>(keel::test::free_loopback_port());
    pid_t rank_pid = fork_child([port] {
      std::unique_ptr<Store> store = connect_store(store_address(port), kSecret, 10s);
      store->set("hello", "from the rank");
      store->wait({"ack"}, 10s);
      return store->get("ack") == "seen" ? 0 : 1;
    });
    std::this_thread::sleep_for(300ms);
    StoreServer server(kSecret, port);
    TcpStore store("127.0.0.1", port, kSecret, 5s);
    store.wait({"hello"}, 10s);
    CHECK(store.get("hello") == "from the rank");
    store.set("ack", "seen");
    CHECK(wait_child(rank_pid, 20s) == 0);
  }
}
