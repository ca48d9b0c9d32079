// Keelds' rendezvous on a real three-member etcd cluster: each node here is
// a thread with its own etcd client, and a node is cut off for real by
// killing the one etcd member it talks to.
#include "cluster/rendezvous.h"

#include <doctest/doctest.h>

#include <chrono>
#include <future>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/error.h"
#include "store/etcd_store.h"
#include "tests/support/etcd_cluster.h"
#include "tests/support/etcd_test_cluster.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"
#include "tests/support/wait.h"

using keel::cluster::GenerationEvent;
using keel::cluster::GenerationFailure;
using keel::cluster::Membership;
using keel::cluster::Rendezvous;
using keel::cluster::RendezvousOptions;
using keel::common::Error;
using keel::common::ErrorCode;
using keel::store::ClusterStore;
using keel::test::EtcdCluster;
using keel::test::TempDir;
using namespace std::chrono_literals;

namespace {

// A keeld's view of the job: its own etcd client (through every member, or
// only through `only_member`) and its rendezvous.
struct Node {
  std::unique_ptr<ClusterStore> store;
  std::unique_ptr<Rendezvous> rendezvous;
};

Node make_node(const EtcdCluster& cluster, const std::string& name, RendezvousOptions options, int only_member = -1) {
  // Long enough to ride out an election when the member killed leads.
  keel::store::EtcdOptions etcd = keel::store::parse_etcd_address(cluster.address("job").substr(7), "", 10s);
  if (only_member >= 0) etcd.endpoints = {etcd.endpoints[static_cast<size_t>(only_member)]};
  Node node;
  node.store = std::make_unique<keel::store::EtcdStore>(etcd);
  options.node_name = name;
  node.rendezvous = std::make_unique<Rendezvous>(*node.store, options);
  return node;
}

RendezvousOptions options(int min_nodes, int max_nodes, std::chrono::milliseconds join_timeout = 30s) {
  RendezvousOptions o;
  o.ranks_per_node = 2;
  o.min_nodes = min_nodes;
  o.max_nodes = max_nodes;
  o.join_timeout = join_timeout;
  o.lease_ttl = 2s;
  return o;
}

// A node of each name, all with the same options, talking to every member.
std::vector<Node> make_nodes(const EtcdCluster& cluster, std::initializer_list<const char*> names,
                             const RendezvousOptions& o) {
  std::vector<Node> nodes;
  for (const char* name : names) nodes.push_back(make_node(cluster, name, o));
  return nodes;
}

// Every node joins at once, each on its own thread.
std::vector<Membership> join_all(std::vector<Node>& nodes, std::chrono::milliseconds timeout = 60s) {
  std::vector<std::future<Membership>> joins;
  for (auto& node : nodes) {
    joins.push_back(std::async(std::launch::async, [&node, timeout] { return node.rendezvous->join(timeout); }));
  }
  std::vector<Membership> memberships;
  for (auto& join : joins) memberships.push_back(join.get());
  return memberships;
}

// Waits on a member's events until the generation ends.
GenerationEvent wait_for_end(Node& node, Membership m) {
  for (;;) {
    auto event = node.rendezvous->next_event(m, 60s);
    REQUIRE(event.has_value());
    if (event->kind == GenerationEvent::kEnded) return *event;
  }
}

}  // namespace

TEST_SUITE("integration") {
  TEST_CASE("three keelds that join one generation read one membership with distinct node ranks and rank offsets") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path());
    if (!cluster) return;
    std::vector<Node> nodes;
    for (const char* name : {"node-c", "node-a", "node-b"}) {
      RendezvousOptions o = options(3, 3);
      o.address = std::string("10.0.0.") + name[5];  // node-a at 10.0.0.a, as the status shows it
      nodes.push_back(make_node(*cluster, name, o));
    }
    auto memberships = join_all(nodes);
    std::set<int> ranks;
    for (const auto& m : memberships) {
      CHECK(m.generation == 0);
      CHECK(m.nodes == std::vector<std::string>{"node-a", "node-b", "node-c"});
      CHECK(m.addresses == std::vector<std::string>{"10.0.0.a", "10.0.0.b", "10.0.0.c"});
      CHECK(m.world_size() == 6);
      CHECK(m.rank_offset() == 2 * m.node_rank);
      ranks.insert(m.node_rank);
    }
    CHECK(ranks == std::set<int>{0, 1, 2});
    CHECK(memberships[0].node_rank == 2);  // node-c sorts last
  }

  TEST_CASE(
      "a join short of max_nodes seals after the join timeout with min_nodes and fails naming who came with fewer") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path());
    if (!cluster) return;
    std::vector<Node> nodes;
    for (const char* name : {"a", "b"}) nodes.push_back(make_node(*cluster, name, options(2, 4, 1500ms)));
    const auto started = std::chrono::steady_clock::now();
    auto memberships = join_all(nodes);
    CHECK(std::chrono::steady_clock::now() - started >= 1500ms);
    CHECK(memberships[0].nodes == std::vector<std::string>{"a", "b"});
    CHECK(memberships[1].nodes == memberships[0].nodes);

    // A layout that runs on no count from min_nodes up waits, and says so.
    auto picky = options(1, 4, 200ms);
    picky.runs_on = [](int n) { return n % 4 == 0; };
    TempDir other_dir;
    EtcdCluster other(other_dir.path(), 1);
    keel::store::EtcdStore store(keel::store::parse_etcd_address(other.address("job").substr(7), "", 3s));
    picky.node_name = "alone";
    Rendezvous alone(store, picky);
    try {
      alone.join(1500ms);
      FAIL("a join with too few nodes returned");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kPeerFailure);
      CHECK(std::string(e.what()).find("1 node(s) joined (alone)") != std::string::npos);
    }
  }

  TEST_CASE("a keeld cut off from etcd loses its lease and the others go on without it in one new generation") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path());
    if (!cluster) return;
    std::vector<Node> nodes;
    // a and b talk to members 0 and 1; c only to member 2.
    nodes.push_back(make_node(*cluster, "a", options(2, 3, 1s), 0));
    nodes.push_back(make_node(*cluster, "b", options(2, 3, 1s), 1));
    nodes.push_back(make_node(*cluster, "c", options(2, 3, 1s), 2));
    auto memberships = join_all(nodes);
    REQUIRE(memberships[0].nodes.size() == 3);

    // Cut c off: its only member goes. Its renewals fail; after the TTL the
    // quorum ends its lease, and both survivors see it.
    cluster->kill(2);
    std::vector<std::future<GenerationEvent>> ends;
    for (int i = 0; i < 2; ++i) {
      ends.push_back(std::async(std::launch::async, [&, i] { return wait_for_end(nodes[i], memberships[i]); }));
    }
    for (auto& end : ends) {
      const GenerationEvent event = end.get();
      CHECK(event.cause.find("node 'c' lost its lease") != std::string::npos);
    }
    // c itself knows it cannot reach etcd (its renewals fail after their timeout).
    CHECK(keel::test::wait_until([&] { return nodes[2].rendezvous->unreachable_since().has_value(); }, 60));

    std::vector<Node> survivors;
    survivors.push_back(std::move(nodes[0]));
    survivors.push_back(std::move(nodes[1]));
    auto next = join_all(survivors);
    // Both saw the loss; the generation moved once.
    CHECK(next[0].generation == 1);
    CHECK(next[0].nodes == std::vector<std::string>{"a", "b"});
    CHECK(next[1].nodes == next[0].nodes);
    CHECK(next[0].world_size() == 4);

    // c reaches etcd again and learns that the job went on without it.
    cluster->start(2);
    CHECK(keel::test::wait_until([&] { return !nodes[2].rendezvous->alive(); }, 60));

    // It comes back as a new node, under a new lease, and the job grows back
    // to it once the members end their generation for it.
    auto back = std::async(std::launch::async, [&] { return nodes[2].rendezvous->join(60s); });
    for (int i = 0; i < 2; ++i) {
      const auto event = survivors[i].rendezvous->next_event(next[i], 60s);
      REQUIRE(event.has_value());
      CHECK(event->kind == GenerationEvent::kNodeWaiting);
      CHECK(event->cause.find("node 'c' waits to join") != std::string::npos);
    }
    survivors[0].rendezvous->fail(1, {"the job grows back to node c"});
    const auto grown = join_all(survivors);
    const Membership c = back.get();
    CHECK(c.generation == 2);
    CHECK(c.nodes == std::vector<std::string>{"a", "b", "c"});
    CHECK(grown[0].nodes == c.nodes);
    CHECK(nodes[2].rendezvous->alive());
  }

  TEST_CASE("a member whose watch etcd compacted away reads the present and still sees a node leave") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path());
    if (!cluster) return;
    auto nodes = make_nodes(*cluster, {"a", "b", "c"}, options(3, 3));
    auto memberships = join_all(nodes);
    // A quiet generation: the job's other traffic moves the revision on, and
    // etcd compacts its history past the members' cursors.
    for (int i = 0; i < 20; ++i) nodes[0].store->set("traffic", std::to_string(i));
    const int64_t now = nodes[0].store->list("traffic").revision;
    auto compacted = keel::test::run_process(
        {"etcdctl", "--endpoints=" + cluster->endpoint(0), "compaction", std::to_string(now)}, {}, 60);
    REQUIRE_MESSAGE(compacted.exit_code == 0, compacted.output);
    nodes[2].rendezvous.reset();  // c leaves: its lease revoked, its record gone
    const GenerationEvent event = wait_for_end(nodes[0], memberships[0]);
    CHECK(event.kind == GenerationEvent::kEnded);
    CHECK(event.cause.find("node 'c' lost its lease") != std::string::npos);
  }

  TEST_CASE("a keeld that comes after the seal waits and the job grows back to it in the next generation") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path());
    if (!cluster) return;
    std::vector<Node> nodes;
    for (const char* name : {"a", "b"}) nodes.push_back(make_node(*cluster, name, options(2, 3, 500ms)));
    auto first = join_all(nodes);
    REQUIRE(first[0].nodes.size() == 2);

    nodes.push_back(make_node(*cluster, "c", options(2, 3, 500ms)));
    auto late = std::async(std::launch::async, [&] { return nodes[2].rendezvous->join(60s); });
    // The members hear that c waits; at its next checkpoint the job ends
    // the generation to grow.
    std::optional<GenerationEvent> event;
    while (!event || event->kind != GenerationEvent::kNodeWaiting) {
      event = nodes[0].rendezvous->next_event(first[0], 60s);
      REQUIRE(event.has_value());
    }
    CHECK(event->cause == "node 'c' waits to join");
    // Told once: the next wait hears nothing new.
    CHECK_FALSE(nodes[0].rendezvous->next_event(first[0], 500ms).has_value());
    nodes[0].rendezvous->fail(first[0].generation, {"grow: node 'c' waits to join"});
    auto second = std::async(std::launch::async, [&] { return nodes[1].rendezvous->join(60s); });
    Membership a = nodes[0].rendezvous->join(60s);
    Membership b = second.get();
    Membership c = late.get();
    CHECK(a.generation == 1);
    CHECK(a.nodes == std::vector<std::string>{"a", "b", "c"});
    CHECK(b.nodes == a.nodes);
    CHECK(c.nodes == a.nodes);
    CHECK(c.node_rank == 2);
  }

  TEST_CASE("a keeld restarted under the same name waits out its old lease and ends the generation its ranks left") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path());
    if (!cluster) return;
    std::vector<Node> nodes;
    nodes.push_back(make_node(*cluster, "a", options(2, 2), 0));
    nodes.push_back(make_node(*cluster, "b", options(2, 2), 2));
    auto first = join_all(nodes);
    // b's keeld dies without a word: its only member goes first, so its
    // lease cannot be revoked; its lease is left to expire.
    cluster->kill(2);
    nodes[1].rendezvous.reset();
    cluster->start(2);
    // The new keeld of b takes the name once the old lease ends.
    Node restarted = make_node(*cluster, "b", options(2, 2));
    auto rejoin = std::async(std::launch::async, [&] { return restarted.rendezvous->join(60s); });
    const GenerationEvent end = wait_for_end(nodes[0], first[0]);
    CHECK(end.cause.find("'b'") != std::string::npos);
    Membership a = nodes[0].rendezvous->join(60s);
    Membership b = rejoin.get();
    CHECK(a.generation == 1);
    CHECK(b.generation == 1);
    CHECK(a.nodes == std::vector<std::string>{"a", "b"});
  }

  TEST_CASE("a keeld whose name is held for longer than its own lease lasts takes the name when the holder's ends") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path());
    if (!cluster) return;
    // The predecessor's record outlives a whole lease of the newcomer: an
    // etcd slow to expire leases under load does the same.
    keel::store::EtcdStore holder(keel::store::parse_etcd_address(cluster->address("job").substr(7), "", 10s));
    holder.set_with_lease("rdzv/nodes/b", R"({"name":"b"})", holder.grant_lease(5s));
    Node restarted = make_node(*cluster, "b", options(1, 1));
    Membership m = restarted.rendezvous->join(60s);
    CHECK(m.nodes == std::vector<std::string>{"b"});
  }

  TEST_CASE("a keeld that comes back after the others finished the job learns it finished unless the job changed") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path());
    if (!cluster) return;
    auto o = options(2, 3, 2s);
    o.job_config = R"({"train":{"steps":40}})";
    auto nodes = make_nodes(*cluster, {"a", "b"}, o);
    const auto first = join_all(nodes);
    // Both finish and leave, as keelds whose ranks all exited 0 do.
    for (auto& node : nodes) node.rendezvous->finish(first[0].generation);
    nodes.clear();
    Node late = make_node(*cluster, "c", o);
    const Membership m = late.rendezvous->join(30s);
    CHECK(m.job_finished);
    CHECK(m.generation == first[0].generation);
    CHECK(m.nodes == std::vector<std::string>{"a", "b"});
    // One of the nodes that finished starts again on the same config: finished too.
    Node again = make_node(*cluster, "a", o);
    CHECK(again.rendezvous->join(30s).job_finished);
    // The job restarted with more steps goes on instead.
    auto more = o;
    more.job_config = R"({"train":{"steps":80}})";
    late.rendezvous.reset();
    again.rendezvous.reset();
    std::vector<Node> next = make_nodes(*cluster, {"a", "b"}, more);
    const auto joined = join_all(next);
    CHECK_FALSE(joined[0].job_finished);
    CHECK(joined[0].generation > first[0].generation);
    CHECK(joined[0].nodes == std::vector<std::string>{"a", "b"});
  }

  TEST_CASE("many keelds failing one generation at once move it once and all read the first cause and its culprits") {
    TempDir dir;
    auto cluster = keel::test::start_etcd_or_skip(dir.path());
    if (!cluster) return;
    auto nodes = make_nodes(*cluster, {"a", "b", "c"}, options(3, 3));
    auto memberships = join_all(nodes);
    const std::vector<std::string> names = {"a", "b", "c"};
    std::vector<std::future<GenerationFailure>> fails;
    for (size_t i = 0; i < nodes.size(); ++i) {
      fails.push_back(std::async(std::launch::async, [&, i] {
        // Each names the next node's rank as the culprit.
        return nodes[i].rendezvous->fail(0, {"hang seen by node " + names[i], {names[(i + 1) % 3]}});
      }));
    }
    std::set<std::pair<std::string, std::vector<std::string>>> recorded;
    for (auto& f : fails) {
      const GenerationFailure first = f.get();
      recorded.insert({first.cause, first.culprit_nodes});
    }
    REQUIRE(recorded.size() == 1);
    const auto& [cause, culprits] = *recorded.begin();
    CHECK(nodes[0].store->get("rdzv/generation") == "1");
    auto event = nodes[1].rendezvous->next_event(memberships[1], 10s);
    REQUIRE(event.has_value());
    CHECK(event->kind == GenerationEvent::kEnded);
    CHECK(event->cause == cause);
    CHECK(event->culprit_nodes == culprits);
    REQUIRE(culprits.size() == 1);
    // The culprit is the node after the one whose cause came first.
    const size_t by = static_cast<size_t>(cause.back() - 'a');
    CHECK(culprits[0] == names[(by + 1) % 3]);

    // A record fail() did not write (another writer, a corrupted value) is a
    // cause naming no node, never a crash.
    auto next = join_all(nodes);
    REQUIRE(next[0].generation == 1);
    nodes[0].store->set("rdzv/g1/failed", "\x01not a record");
    nodes[0].store->compare_set("rdzv/generation", "1", "2");
    auto garbled = nodes[2].rendezvous->next_event(next[2], 10s);
    REQUIRE(garbled.has_value());
    CHECK(garbled->kind == GenerationEvent::kEnded);
    CHECK(garbled->cause == "\x01not a record");
    CHECK(garbled->culprit_nodes.empty());
  }
}

// A store the options check must never reach.
class Unreachable final : public ClusterStore {
 public:
  [[noreturn]] static void reached() { throw std::logic_error("the store was reached"); }
  void set(const std::string&, const std::string&) override { reached(); }
  std::optional<std::string> get(const std::string&) override { reached(); }
  void wait(const std::vector<std::string>&, std::chrono::milliseconds) override { reached(); }
  int64_t add(const std::string&, int64_t) override { reached(); }
  std::optional<std::string> compare_set(const std::string&, const std::optional<std::string>&,
                                         const std::string&) override {
    reached();
  }
  bool remove(const std::string&) override { reached(); }
  LeaseId grant_lease(std::chrono::seconds) override { reached(); }
  bool keep_alive(LeaseId, std::chrono::milliseconds) override { reached(); }
  void revoke(LeaseId) override { reached(); }
  void set_with_lease(const std::string&, const std::string&, LeaseId) override { reached(); }
  std::optional<std::string> compare_set_with_lease(const std::string&, const std::optional<std::string>&,
                                                    const std::string&, LeaseId) override {
    reached();
  }
  Listing list(const std::string&) override { reached(); }
  std::vector<Change> watch(const std::string&, int64_t, std::chrono::milliseconds) override { reached(); }
};

TEST_SUITE("unit") {
  TEST_CASE("a rendezvous with a bad node name or node counts is refused with exit code 2 before etcd is asked") {
    struct Case {
      std::string name;
      int min_nodes;
      int max_nodes;
      std::chrono::seconds ttl;
      const char* says;
    };
    for (const Case& c : std::vector<Case>{{"", 1, 1, 5s, "node_name ''"},
                                           {"a/b", 1, 1, 5s, "hold no '/'"},
                                           {"a", 0, 1, 5s, "min_nodes = 0"},
                                           {"a", 3, 2, 5s, "max_nodes = 2"},
                                           {"a", 1, 1, 1s, "lease_ttl_s = 1"}}) {
      CAPTURE(c.says);
      Unreachable store;
      RendezvousOptions o = options(c.min_nodes, c.max_nodes);
      o.node_name = c.name;
      o.lease_ttl = c.ttl;
      try {
        Rendezvous rendezvous(store, o);
        FAIL("accepted");
      } catch (const Error& e) {
        CHECK(e.code() == ErrorCode::kBadConfig);
        CHECK_MESSAGE(std::string(e.what()).find(c.says) != std::string::npos, e.what());
      }
    }
  }
}
