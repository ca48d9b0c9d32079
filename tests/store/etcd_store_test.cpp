// The etcd Store against real etcd clusters started by the tests (three
// members on loopback), and against answers no etcd would give, served by a
// fake member.
#include "store/etcd_store.h"

#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "store/etcd_gateway.h"
#include "tests/support/etcd_cluster.h"
#include "tests/support/etcd_test_cluster.h"
#include "tests/support/free_ports.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_certificates.h"
#include "tests/support/wait.h"

using keel::common::Error;
using keel::common::ErrorCode;
using keel::store::ClusterStore;
using keel::store::connect_store;
using keel::store::EtcdStore;
using keel::store::Store;
using keel::test::EtcdCluster;
using keel::test::TempDir;
using namespace std::chrono_literals;

namespace {

std::unique_ptr<ClusterStore> connect(const EtcdCluster& cluster, const std::string& prefix,
                                      std::chrono::milliseconds timeout = 10s, const std::string& credential = "") {
  auto store = connect_store(cluster.address(prefix), credential, timeout);
  auto* cluster_store = dynamic_cast<ClusterStore*>(store.get());
  REQUIRE(cluster_store != nullptr);
  store.release();
  return std::unique_ptr<ClusterStore>(cluster_store);
}

// Runs `call` and returns the Error it threw (a default kInternal one when
// it threw none, which the caller's CHECK then shows).
template <class Call>
Error error_of(Call call) {
  try {
    call();
  } catch (const Error& e) {
    return e;
  }
  return Error(ErrorCode::kInternal, "no error was thrown");
}

// A fake etcd member that answers every request with one canned HTTP
// answer (or closes the connection), for answers a real etcd never gives.
class FakeMember {
 public:
  explicit FakeMember(std::string answer) : answer_(std::move(answer)) {
    listener_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    REQUIRE(bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
    REQUIRE(listen(listener_, 16) == 0);
    REQUIRE(getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length) == 0);
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~FakeMember() {
    stop_ = true;
    thread_.join();
    close(listener_);
  }
  int port() const { return port_; }
  int requests() const { return requests_; }

 private:
  void serve() {
    while (!stop_) {
      pollfd ready{listener_, POLLIN, 0};
      if (poll(&ready, 1, 20) <= 0) continue;
      int connection = accept(listener_, nullptr, nullptr);
      if (connection < 0) continue;
      // Reads the request's head and body (the client sends both at once).
      std::string request;
      char buffer[4096];
      for (;;) {
        pollfd readable{connection, POLLIN, 0};
        if (poll(&readable, 1, 1000) <= 0) break;
        ssize_t n = read(connection, buffer, sizeof(buffer));
        if (n <= 0) break;
        request.append(buffer, n);
        // A TLS hello is no request: answered at once, as an HTTP server
        // answers bytes it cannot parse.
        if (request[0] == 0x16) break;
        size_t head_end = request.find("\r\n\r\n");
        if (head_end == std::string::npos) continue;
        size_t length_at = request.find("Content-Length: ");
        size_t length = length_at == std::string::npos ? 0 : std::stoul(request.substr(length_at + 16));
        if (request.size() >= head_end + 4 + length) break;
      }
      ++requests_;
      if (!answer_.empty()) (void)!write(connection, answer_.data(), answer_.size());
      close(connection);
    }
  }

  std::string answer_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> requests_{0};
  std::thread thread_;
};

std::string http_answer(int status, const std::string& body) {
  return "HTTP/1.1 " + std::to_string(status) +
         " X\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\nConnection: close\r\n\r\n" + body;
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("the etcd store keeps the store contract across members: set - get - add - compare-and-set and remove") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path());
    if (!cluster) return;
    auto store = connect(*cluster, "keel/job-a");
    CHECK_FALSE(store->get("absent").has_value());
    // Bytes of every value, a zero among them, go in and come out as they were.
    const std::string bytes("a\0b\xff\n", 5);
    store->set("k", bytes);
    CHECK(store->get("k") == bytes);
    CHECK(store->add("counter", 5) == 5);
    CHECK(store->add("counter", -2) == 3);
    CHECK(store->get("counter") == "3");
    store->set("text", "not a number");
    CHECK(error_of([&] { store->add("text", 1); }).code() == ErrorCode::kInternal);
    CHECK(store->compare_set("cas", std::nullopt, "first") == "first");
    CHECK(store->compare_set("cas", std::nullopt, "second") == "first");
    CHECK(store->compare_set("cas", "wrong", "third") == "first");
    CHECK(store->compare_set("cas", "first", "fourth") == "fourth");
    CHECK_FALSE(store->compare_set("absent", "x", "y").has_value());
    CHECK(store->remove("cas"));
    CHECK_FALSE(store->remove("cas"));
    CHECK_FALSE(store->get("cas").has_value());

    // Another member sees it: every call goes through the quorum.
    keel::store::EtcdOptions one_member;
    one_member.endpoints = {{"127.0.0.1", static_cast<uint16_t>(std::stoi(cluster->endpoint(2).substr(10)))}};
    one_member.prefix = "keel/job-a/";
    EtcdStore other(one_member);
    CHECK(other.get("counter") == "3");
    // A job under another prefix sees none of it.
    auto stranger = connect(*cluster, "keel/job-b");
    CHECK_FALSE(stranger->get("counter").has_value());
    CHECK(stranger->list("").entries.empty());
  }

  TEST_CASE("a wait on etcd returns when another client sets its keys and names the missing ones after its timeout") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path());
    if (!cluster) return;
    auto waiter = connect(*cluster, "job");
    auto setter = connect(*cluster, "job");
    std::atomic<bool> returned{false};
    std::thread waiting([&] {
      waiter->wait({"a", "b"}, 60s);
      returned = true;
    });
    setter->set("a", "1");
    // A sibling of a key does not count as the key.
    setter->set("ab", "sibling");
    CHECK(error_of([&] { setter->wait({"b"}, 300ms); }).code() == ErrorCode::kPeerFailure);
    setter->set("b", "2");
    waiting.join();
    CHECK(returned.load());

    auto started = std::chrono::steady_clock::now();
    Error timed_out = error_of([&] { waiter->wait({"a", "never", "nor-this"}, 300ms); });
    CHECK(std::chrono::steady_clock::now() - started >= 300ms);
    CHECK(timed_out.code() == ErrorCode::kPeerFailure);
    CHECK(std::string(timed_out.what()).find("'never', 'nor-this'") != std::string::npos);
  }

  TEST_CASE("concurrent adds from many etcd clients lose no increment") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path());
    if (!cluster) return;
    constexpr int kClients = 4;
    constexpr int kAdds = 25;
    std::vector<std::thread> clients;
    std::vector<std::vector<int64_t>> seen(kClients);
    for (int c = 0; c < kClients; ++c) {
      clients.emplace_back([&, c] {
        auto store = connect(*cluster, "job");
        for (int i = 0; i < kAdds; ++i) seen[c].push_back(store->add("n", 1));
      });
    }
    for (auto& client : clients) client.join();
    // Every value from 1 to the total was returned exactly once.
    std::vector<int64_t> all;
    for (const auto& values : seen) all.insert(all.end(), values.begin(), values.end());
    std::sort(all.begin(), all.end());
    std::vector<int64_t> expected(kClients * kAdds);
    std::iota(expected.begin(), expected.end(), 1);
    CHECK(all == expected);
  }

  TEST_CASE("a key under an etcd lease lives while the lease is renewed and vanishes once it is not") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path());
    if (!cluster) return;
    auto store = connect(*cluster, "job");
    ClusterStore::LeaseId lease = store->grant_lease(2s);
    store->set_with_lease("nodes/a", "alive", lease);
    CHECK(store->compare_set_with_lease("nodes/b", std::nullopt, "alive too", lease) == "alive too");
    const auto granted = std::chrono::steady_clock::now();
    // Renewed past twice its TTL, it stays.
    while (std::chrono::steady_clock::now() - granted < 4s) {
      CHECK(store->keep_alive(lease, 1s));
      std::this_thread::sleep_for(500ms);
    }
    CHECK(store->get("nodes/a") == "alive");
    // Left alone, etcd deletes its keys; a watch from now sees both go.
    const int64_t now = store->list("nodes/").revision;
    std::vector<ClusterStore::Change> gone;
    while (gone.size() < 2) {
      auto changes = store->watch("nodes/", gone.empty() ? now : gone.back().revision, 30s);
      REQUIRE_FALSE(changes.empty());
      gone.insert(gone.end(), changes.begin(), changes.end());
    }
    for (const auto& change : gone) CHECK_FALSE(change.value.has_value());
    CHECK_FALSE(store->get("nodes/a").has_value());
    CHECK_FALSE(store->keep_alive(lease, 10s));
    // Revoking what expired is no error; revoking a live lease deletes at once.
    store->revoke(lease);
    ClusterStore::LeaseId second = store->grant_lease(60s);
    store->set_with_lease("nodes/c", "x", second);
    store->revoke(second);
    CHECK_FALSE(store->get("nodes/c").has_value());
  }

  TEST_CASE("an etcd watch returns the changes under its prefix after a revision and none outside it") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path());
    if (!cluster) return;
    auto store = connect(*cluster, "job");
    store->set("members/0", "zero");
    const ClusterStore::Listing before = store->list("members/");
    REQUIRE(before.entries.size() == 1);
    CHECK(before.entries[0].key == "members/0");
    CHECK(before.entries[0].value == "zero");
    // Nothing changes: the watch times out empty.
    CHECK(store->watch("members/", before.revision, 200ms).empty());
    store->set("other/1", "outside");
    store->set("members/1", "one");
    store->remove("members/0");
    std::vector<ClusterStore::Change> changes;
    int64_t after = before.revision;
    while (changes.size() < 2) {
      auto more = store->watch("members/", after, 30s);
      REQUIRE_FALSE(more.empty());
      after = more.back().revision;
      changes.insert(changes.end(), more.begin(), more.end());
    }
    REQUIRE(changes.size() == 2);
    CHECK(changes[0].key == "members/1");
    CHECK(changes[0].value == "one");
    CHECK(changes[1].key == "members/0");
    CHECK_FALSE(changes[1].value.has_value());
    CHECK(changes[0].revision < changes[1].revision);
  }

  TEST_CASE("the etcd store goes on when the etcd leader is killed and fails with a sentence when the quorum is gone") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path());
    if (!cluster) return;
    auto store = connect(*cluster, "job", 20s);
    store->set("before", "1");
    const int leader = cluster->leader();
    REQUIRE(leader >= 0);
    cluster->kill(leader);
    // The two left elect a leader; the client moves to them by itself.
    CHECK(store->add("after", 1) == 1);
    CHECK(store->get("before") == "1");
    int new_leader = -1;
    CHECK(keel::test::wait_until(
        [&] {
          new_leader = cluster->leader();
          return new_leader >= 0;
        },
        60));
    // A killed member comes back and catches up.
    cluster->start(leader);
    store->set("back", "yes");

    // One member of three is no quorum: calls fail within their timeout,
    // naming every endpoint, and a rank would exit 12.
    for (int m = 0; m < cluster->size(); ++m) {
      if (m != leader) cluster->kill(m);
    }
    auto short_store_timeout = 2s;
    keel::store::EtcdOptions options =
        keel::store::parse_etcd_address(cluster->address("job").substr(7), "", short_store_timeout);
    keel::store::EtcdGateway gateway(options);
    Error lost = error_of([&] {
      gateway.call("/v3/kv/put", {{"key", keel::store::etcd_base64("job/x")}, {"value", ""}},
                   keel::store::EtcdGateway::Retry::kIdempotent);
    });
    CHECK(lost.code() == ErrorCode::kPeerFailure);
    // Every member was tried: each has its own reason in the message.
    for (int m = 0; m < cluster->size(); ++m) {
      CHECK(std::string(lost.what()).find(cluster->endpoint(m) + ": ") != std::string::npos);
    }
  }

  TEST_CASE("a wait on many keys of an etcd out of reach gives up within its own timeout - not a call timeout a key") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path(), 1);
    if (!cluster) return;
    auto store = connect(*cluster, "job", 10s);
    cluster->kill(0);
    const auto started = std::chrono::steady_clock::now();
    Error lost = error_of([&] { store->wait({"a", "b", "c", "d"}, 1s); });
    const double took_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    CHECK(lost.code() == ErrorCode::kPeerFailure);
    CHECK_MESSAGE(took_s < 5, "took " << took_s << " s");  // the call timeout alone is 10 s
  }

  TEST_CASE("a watch whose token etcd voided takes a new one and sees the change") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path(), 1);
    if (!cluster) return;
    cluster->enable_auth("keel", "keel-pw", "jobs/a/");
    auto watcher = connect(*cluster, "jobs/a", 10s, "keel:keel-pw");
    const int64_t before = watcher->list("w").revision;  // and its token
    cluster->void_tokens();
    // Another client, authenticated afresh, changes the key.
    connect(*cluster, "jobs/a", 10s, "keel:keel-pw")->set("w", "1");
    const auto changes = watcher->watch("w", before, 10s);
    REQUIRE(changes.size() == 1);
    CHECK(changes[0].key == "w");
    CHECK(changes[0].value == "1");
  }

  TEST_CASE("etcd with authentication takes the right user and password and refuses others with exit code 2") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path(), 1);
    if (!cluster) return;
    cluster->enable_auth("keel", "keel-pw", "jobs/a/");
    auto store = connect(*cluster, "jobs/a", 10s, "keel:keel-pw");
    store->set("k", "v");
    CHECK(store->get("k") == "v");
    auto wrong = error_of([&] { connect_store(cluster->address("jobs/a"), "keel:nope", 10s); });
    CHECK(wrong.code() == ErrorCode::kBadConfig);
    CHECK(std::string(wrong.what()).find("password") != std::string::npos);
    auto anonymous = error_of([&] { connect_store(cluster->address("jobs/a"), "", 10s)->set("k", "x"); });
    CHECK(anonymous.code() == ErrorCode::kBadConfig);
    auto outside = error_of([&] { connect_store(cluster->address("jobs/b"), "keel:keel-pw", 10s)->set("k", "x"); });
    CHECK(outside.code() == ErrorCode::kBadConfig);
    CHECK(std::string(outside.what()).find("jobs/b/") != std::string::npos);
  }

  TEST_CASE("etcd over TLS with client certificates keeps the store contract and its watches and leases past its leader's loss") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path(), 3, "", EtcdCluster::Transport::kTls);
    if (!cluster) return;
    REQUIRE(cluster->address("job").find("?ca=") != std::string::npos);
    auto store = connect(*cluster, "job", 20s);
    store->set("a", "1");
    CHECK(store->compare_set("a", "1", "2") == "2");
    const ClusterStore::LeaseId lease = store->grant_lease(30s);
    store->set_with_lease("nodes/a", "alive", lease);
    CHECK(store->keep_alive(lease, 5s));
    const int64_t before = store->list("nodes/").revision;
    const int leader = cluster->leader();
    REQUIRE(leader >= 0);
    cluster->kill(leader);
    // Another client's change reaches the watch over the members left.
    connect(*cluster, "job", 20s)->set("nodes/b", "joined");
    const auto changes = store->watch("nodes/", before, 30s);
    // The put may land twice when the member it went to died before
    // answering and it was sent again (the watch contract, store.h); a
    // clean clone saw 2 changes once. Nothing but that put is a change.
    std::string seen;
    for (const auto& change : changes) {
      seen += change.key + "=" + change.value.value_or("(deleted)") + "@" + std::to_string(change.revision) + " ";
    }
    INFO("changes after revision " << before << ": " << seen);
    REQUIRE(!changes.empty());
    CHECK(changes.size() <= 2);
    for (const auto& change : changes) {
      CHECK(change.key == "nodes/b");
      CHECK(change.value == std::optional<std::string>("joined"));
    }
    CHECK(store->add("count", 1) == 1);
    CHECK(store->get("a") == "2");
    store->revoke(lease);
    CHECK_FALSE(store->get("nodes/a").has_value());
  }

  TEST_CASE("TLS settings etcd turns away are refused with a sentence naming what to change") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path(), 1, "", EtcdCluster::Transport::kTls);
    if (!cluster) return;
    const auto& own = cluster->certificates();
    const auto stranger = keel::test::make_test_certificates(dir.path() / "stranger", {"127.0.0.1"});
    const std::string members = "etcd://" + cluster->endpoint(0) + "/job";
    struct Row {
      const char* name;
      keel::store::EtcdTls tls;
      ErrorCode code;
      const char* says;
    };
    const Row rows[] = {
        {"plain HTTP to a member that speaks TLS", {}, ErrorCode::kPeerFailure, "set cluster.tls_ca_file"},
        {"a CA that did not sign etcd's certificate",
         {stranger.ca, own.client_cert, own.client_key},
         ErrorCode::kBadConfig,
         "its TLS certificate is not trusted"},
        {"no client certificate where etcd asks for one",
         {own.ca, "", ""},
         ErrorCode::kBadConfig,
         "refused keel's TLS client certificate"},
        {"a client certificate of another CA",
         {own.ca, stranger.client_cert, stranger.client_key},
         ErrorCode::kBadConfig,
         "refused keel's TLS client certificate"},
        {"a CA file that is not there", {"/nonexistent/ca.pem", "", ""}, ErrorCode::kBadConfig, "/nonexistent/ca.pem"},
        {"a key that is not the certificate's",
         {own.ca, own.client_cert, stranger.client_key},
         ErrorCode::kBadConfig,
         "client key"},
    };
    for (const Row& row : rows) {
      const std::string name = row.name;
      CAPTURE(name);
      const auto started = std::chrono::steady_clock::now();
      Error refused = error_of([&] {
        connect_store(keel::store::etcd_address_with_tls(members, row.tls), "", 10s)->set("k", "v");
      });
      const std::string said = refused.what();
      CAPTURE(said);
      CHECK(std::chrono::steady_clock::now() - started < 30s);
      CHECK(refused.code() == row.code);
      CHECK(said.find(row.says) != std::string::npos);
    }
  }
}

TEST_SUITE("unit") {
  TEST_CASE("an etcd store address that is malformed is refused with a sentence and exit code 2") {
    struct Case {
      const char* address;
      const char* credential;
      const char* says;
    };
    for (const Case& c : std::vector<Case>{
             {"etcd://", "", "names no member"},
             {"etcd:///prefix", "", "names no member"},
             {"etcd://host", "", "'host' is not HOST:PORT"},
             {"etcd://:2379", "", "':2379' is not HOST:PORT"},
             {"etcd://h:0", "", "from 1 to 65535"},
             {"etcd://h:70000", "", "from 1 to 65535"},
             {"etcd://h:12ab", "", "from 1 to 65535"},
             {"etcd://h:2379,", "", "ends with a comma"},
             {"etcd://h:2379,,h:2380", "", "'' is not HOST:PORT"},
             {"etcd://h:2379", "no-colon", "USER:PASSWORD"},
             {"etcd://h:2379", ":pw", "USER:PASSWORD"},
             {"etc://h:2379", "", "neither tcp:// "},
             {"h:2379", "", "neither tcp:// "},
             {"etcd://h:2379/job?ca=", "", "'ca' names no file"},
             {"etcd://h:2379/job?tls=on", "", "'tls' is none of ca, cert and key"},
             {"etcd://h:2379/job?ca=/ca.pem&cert=/c.pem", "", "a client cert goes with its key"},
             {"etcd://h:2379/job?cert=/c.pem&key=/k.pem", "", "a client cert needs ca"},
         }) {
      CAPTURE(c.address);
      Error refused = error_of([&] { connect_store(c.address, c.credential, 1s); });
      CHECK(refused.code() == ErrorCode::kBadConfig);
      CHECK_MESSAGE(std::string(refused.what()).find(c.says) != std::string::npos, refused.what());
    }
    auto options = keel::store::parse_etcd_address("a:1,b:2/keel/job/", "u:p:q", 1s);
    REQUIRE(options.endpoints.size() == 2);
    CHECK(options.endpoints[1].name() == "b:2");
    CHECK(options.prefix == "keel/job/");
    CHECK(options.user == "u");
    CHECK(options.password == "p:q");
    CHECK_FALSE(options.tls.on());
    const keel::store::EtcdTls tls{"/etc/keel/ca.pem", "/etc/keel/node.pem", "/etc/keel/node.key"};
    const std::string with_tls = keel::store::etcd_address_with_tls("etcd://a:1,b:2/keel/job", tls);
    auto parsed = keel::store::parse_etcd_address(std::string_view(with_tls).substr(7), "", 1s);
    CHECK(parsed.prefix == "keel/job/");
    CHECK(parsed.endpoints.size() == 2);
    CHECK(parsed.tls.ca_file == tls.ca_file);
    CHECK(parsed.tls.cert_file == tls.cert_file);
    CHECK(parsed.tls.key_file == tls.key_file);
    CHECK(keel::store::parse_etcd_address("a:1?ca=/ca.pem", "", 1s).prefix.empty());
    Error unquotable = error_of([] { keel::store::etcd_address_with_tls("etcd://a:1", {"/pki/a&b.pem", "", ""}); });
    CHECK(unquotable.code() == ErrorCode::kBadConfig);
    CHECK(std::string(unquotable.what()).find("cluster.tls_ca_file") != std::string::npos);
  }

  TEST_CASE("TLS to a member that speaks plain HTTP is refused with a sentence and exit code 2") {
    TempDir dir;
    const auto pki = keel::test::make_test_certificates(dir.path(), {"127.0.0.1"});
    FakeMember plain(http_answer(200, R"({"header":{"revision":"1"}})"));
    const std::string address = keel::store::etcd_address_with_tls(
        "etcd://127.0.0.1:" + std::to_string(plain.port()) + "/job", {pki.ca, pki.client_cert, pki.client_key});
    Error refused = error_of([&] { connect_store(address, "", 2s)->set("k", "v"); });
    const std::string said = refused.what();
    CAPTURE(said);
    CHECK(refused.code() == ErrorCode::kBadConfig);
    CHECK_MESSAGE(std::string(refused.what()).find("is etcd's client URL https?") != std::string::npos,
                  refused.what());
  }

  TEST_CASE("no etcd answering is a peer failure within the timeout naming every endpoint") {
    const auto ports = keel::test::free_loopback_ports(2);  // nobody listens on them
    const int first = ports[0], second = ports[1];
    const std::string address = "etcd://127.0.0.1:" + std::to_string(first) + ",127.0.0.1:" + std::to_string(second);
    auto started = std::chrono::steady_clock::now();
    Error unreachable = error_of([&] { connect_store(address, "", 1s); });
    CHECK(std::chrono::steady_clock::now() - started < 10s);
    CHECK(unreachable.code() == ErrorCode::kPeerFailure);
    CHECK(std::string(unreachable.what()).find("127.0.0.1:" + std::to_string(first)) != std::string::npos);
    CHECK(std::string(unreachable.what()).find("127.0.0.1:" + std::to_string(second)) != std::string::npos);
  }

  TEST_CASE("answers no etcd would give are a peer failure naming the member and never a crash") {
    struct Case {
      const char* name;
      std::string answer;  // to every request
      const char* says;
    };
    for (const Case& c : std::vector<Case>{
             {"not JSON", http_answer(200, "<html>proxy</html>"), "not a JSON object"},
             {"a JSON array", http_answer(200, "[1,2]"), "not a JSON object"},
             {"no header", http_answer(200, R"({"kvs":[]})"), "has no 'header'"},
             {"a revision that is not a number", http_answer(200, R"({"header":{"revision":"x1"}})"), "not an integer"},
             {"a value that is not base64", http_answer(200, R"({"header":{"revision":"2"},"kvs":[{"value":"!!"}]})"),
              "not base64"},
             {"kvs that is not a list", http_answer(200, R"({"header":{"revision":"2"},"kvs":7})"), "cannot read"},
             {"an error status with garbage", http_answer(500, "\x01\x02 broken"), "refused /v3/maintenance/status"},
             {"a truncated answer", "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"header\":", "cannot be reached"},
             {"the connection closed at once", "", "cannot be reached"},
         }) {
      CAPTURE(c.name);
      FakeMember member(c.answer);
      const std::string address = "etcd://127.0.0.1:" + std::to_string(member.port()) + "/job";
      Error e = error_of([&] { connect_store(address, "", 1s)->get("a"); });
      CHECK(e.code() == ErrorCode::kPeerFailure);
      CHECK_MESSAGE(std::string(e.what()).find(c.says) != std::string::npos, e.what());
      CHECK_MESSAGE(std::string(e.what()).find("127.0.0.1:" + std::to_string(member.port())) != std::string::npos,
                    e.what());
      CHECK(member.requests() >= 1);
    }
  }
}
